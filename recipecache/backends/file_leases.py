"""The filesystem store's leases: one JSON file each, ``{"token", "expires"}``.

Leases are created with ``link(2)`` of a fully written temp file (atomic and exclusive,
also on NFS); taking over an expired lease, renewing and releasing happen under a
``filelock`` on ``<lease>.lock``, re-reading the lease inside the lock. Nobody waits long
for that lock, since a holder that hangs (a stopped process, a stuck mount) must not hold
up the rest: a follower that finds it busy has not taken the lease and polls again, so its
deadline holds; a renewal (within a third of the TTL, before the lease could lapse) or a
release (within :data:`LEASE_LOCK_TIMEOUT_S`) that cannot get it is a ``backend_slow``
error: the leader then stops renewing, and the lease expires by itself. Expiry uses the
wall clock, so hosts sharing a mount need synchronised clocks (NTP) within a fraction of
the lease TTL. Nothing wakes a waiting process here (no ``lease_wait``): waiters poll the
lease file with backoff, which costs a local read, not a network round trip.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import filelock

from ..errors import BackendError
from ..fsutil import TEMP_PREFIX, open_regular_file
from ..reasons import Reason
from .base import Clock, LeaseState
from .file_layout import Layout, os_error_reason

#: The most a lease holder waits for ``<lease>.lock`` to renew or release; the lock guards a
#: read and a rename, so a holder keeping it longer is stuck.
LEASE_LOCK_TIMEOUT_S = 5.0


class LeaseFiles:
    """The lease primitive of :class:`~recipecache.backends.base.Backend` on lease files (see the module)."""

    def __init__(self, layout: Layout, clock: Clock) -> None:
        self._layout = layout
        self._clock = clock

    def add(self, name: str, token: str, ttl: float) -> bool:
        path = self._layout.lease_path(name)
        tmp = None
        try:
            tmp = self._write_temp(self._layout.directory("leases", path.parent.name), token, ttl)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                pass
            with filelock.FileLock(f"{path}.lock", timeout=0):
                held = self._read(path)
                if held is None:
                    # released meanwhile: others may be linking too, so only link(2) decides
                    try:
                        os.link(tmp, path)
                        return True
                    except FileExistsError:
                        return False
                if held[1] > self._clock():
                    return False
                os.replace(tmp, path)  # expired: replaced under the lock, and a linker fails on the existing file
                tmp = None
                return True
        except filelock.Timeout:
            return False  # another process is deciding this lease right now; the caller polls again
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"lease {name}: {exc.strerror}") from None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def renew(self, name: str, token: str, ttl: float) -> bool:
        path = self._layout.lease_path(name)
        lock_timeout = min(LEASE_LOCK_TIMEOUT_S, ttl / 3)
        try:
            with filelock.FileLock(f"{path}.lock", timeout=lock_timeout):
                held = self._read(path)
                if held is None or held[0] != token or held[1] <= self._clock():
                    return False
                os.replace(self._write_temp(path.parent, token, ttl), path)
                return True
        except filelock.Timeout:
            raise _lock_stuck(name, lock_timeout) from None
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"lease {name}: {exc.strerror}") from None

    def release(self, name: str, token: str) -> None:
        path = self._layout.lease_path(name)
        try:
            with filelock.FileLock(f"{path}.lock", timeout=LEASE_LOCK_TIMEOUT_S):
                held = self._read(path)
                if held is not None and held[0] == token:
                    path.unlink(missing_ok=True)
        except filelock.Timeout:
            raise _lock_stuck(name, LEASE_LOCK_TIMEOUT_S) from None
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"lease {name}: {exc.strerror}") from None

    def holder(self, name: str) -> LeaseState | None:
        """Read without the lock: the lease file is replaced whole (link or rename), never rewritten in place."""
        held = self._read(self._layout.lease_path(name))
        return None if held is None else LeaseState(held[0], held[1] - self._clock())

    def remove_expired(self, path: Path, older_than_s: float) -> bool:
        """Delete the lease at ``path`` if it expired more than ``older_than_s`` ago, under its lock so no takeover
        is under way."""
        try:
            with filelock.FileLock(f"{path}.lock", timeout=0):
                held = self._read(path)
                if held is None or held[1] >= self._clock() - older_than_s:
                    return False
                path.unlink(missing_ok=True)
                return True
        except filelock.Timeout:
            return False

    def _read(self, path: Path) -> tuple[str, float] | None:
        try:
            fd = open_regular_file(path)
            if fd is None:
                return None
            with os.fdopen(fd, "rb") as f:
                record = json.loads(f.read())
            return str(record["token"]), float(record["expires"])
        except (OSError, ValueError, KeyError, TypeError):
            return ("", 0.0)  # unreadable (or not a file): treat as expired so it can be taken over

    def _write_temp(self, directory: Path, token: str, ttl: float) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump({"token": token, "expires": self._clock() + ttl}, f)
        return Path(tmp)


def _lock_stuck(name: str, waited_s: float) -> BackendError:
    return BackendError(
        Reason.BACKEND_SLOW, f"lease {name}: its lock stayed held by another process for {waited_s:g} s"
    )
