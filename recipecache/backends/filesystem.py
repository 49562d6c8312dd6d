"""The default backend: a directory on local disk or on a mount shared by several hosts.

Layout under the root::

    objects/<namespace>/<hex[:2]>/<hex>        one file per entry
    leases/<namespace>/<hex>.lease             a lease: JSON {"token", "expires"}

Publishing writes a temp file in the target's own directory and renames it over the
target, so readers on any host see the old file, the new file or none, never a partial
one. No fsync: after a crash a torn file is possible, and the envelope checksum turns it
into a counted ``corrupt`` miss, which is cheaper than an fsync on every put.

Leases are created with ``link(2)`` of a fully written temp file (atomic and exclusive,
also on NFS); taking over an expired lease, renewing and releasing happen under a
``filelock`` on ``<lease>.lock``, re-reading the lease inside the lock. Expiry uses the
wall clock, so hosts sharing a mount need synchronised clocks (NTP) within a fraction of
the lease TTL.
Nothing wakes a waiting process here (no ``lease_wait``): waiters poll the lease file
with backoff, which costs a local read, not a network round trip.

The root must not be writable by group or others (anyone who can write the cache can
run code on every rank), and no path under it is followed through a symlink.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import filelock

from ..errors import BackendError
from ..reasons import Reason
from ..fsutil import TEMP_PREFIX, private_directory, regular_files, subdirectories, write_atomic
from .base import Backend, Clock, EntryInfo, LeaseState, check_key, is_key
from .url import StoreURL

log = logging.getLogger(__name__)

#: Temp files older than this belong to a writer that died; eviction removes them.
STALE_TEMP_S = 3600.0
#: Between size checks a process writes at most this fraction of the cap, or waits this long.
_EVICT_CHECK_FRACTION = 0.05
_EVICT_CHECK_S = 30.0


def _reason(exc: OSError) -> Reason:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Reason.BACKEND_FULL
    return Reason.BACKEND_ERROR


class FilesystemBackend(Backend):
    URL_OPTIONS = frozenset({"max_size"})

    @classmethod
    def from_url(cls, url: StoreURL) -> FilesystemBackend:
        """``file:///absolute/path[?max_size=10GiB]``."""
        url.check_options(cls.URL_OPTIONS)
        if url.parts.netloc not in ("", "localhost") or not url.parts.path:
            raise url.error("use file:///absolute/path")
        return cls(urllib.parse.unquote(url.parts.path), max_size=url.size("max_size", None))

    def __init__(self, root: str | os.PathLike[str], *, max_size: int | None = None, clock: Clock = time.time) -> None:
        self.root = private_directory(root, "cache directory")
        self.url = f"file://{self.root}"
        self.max_size = max_size
        self._clock = clock
        self._written_since_check = 0
        self._last_check = 0.0

    # -- paths ---------------------------------------------------------------------
    def _dir(self, *parts: str) -> Path:
        """``root/parts...``, created 0700, refusing any component that is a symlink."""
        path = self.root
        for part in parts:
            path = path / part
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise BackendError(Reason.BACKEND_ERROR, f"{path} is a symlink or not a directory; refusing it") from None
        return path

    def _object_path(self, key: str) -> Path:
        namespace, digest = check_key(key).split("/")
        return self.root / "objects" / namespace / digest[:2] / digest

    def _lease_path(self, name: str) -> Path:
        namespace, digest = check_key(name).split("/")
        return self.root / "leases" / namespace / f"{digest}.lease"

    # -- values --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        path = self._object_path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                log.warning("recipecache: %s is a symlink; removing it instead of following it", path)
                self.delete(key)
                return None
            raise BackendError(_reason(exc), f"read {path}: {exc.strerror}") from None
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read()
                os.utime(f.fileno())  # last access, for least-recently-used eviction
        except OSError as exc:
            raise BackendError(_reason(exc), f"read {path}: {exc.strerror}") from None
        return data

    def put(self, key: str, value: bytes) -> None:
        namespace, digest = check_key(key).split("/")
        try:
            write_atomic(self._dir("objects", namespace, digest[:2]) / digest, value)
        except OSError as exc:
            raise BackendError(_reason(exc), f"write {key}: {exc.strerror}") from None
        self._maybe_evict(len(value))

    def delete(self, key: str) -> None:
        try:
            self._object_path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise BackendError(_reason(exc), f"delete {key}: {exc.strerror}") from None

    def scan(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        """Entries in this store's layout only: a stray file someone dropped in is not ours to list or evict."""
        base = self.root / "objects"
        namespaces = [namespace] if namespace else subdirectories(base)
        for ns in namespaces:
            for fan in subdirectories(base / ns):
                for name, st in regular_files(base / ns / fan):
                    key = f"{ns}/{name}"
                    if name[:2] == fan and is_key(key):
                        yield EntryInfo(key, st.st_size, st.st_mtime)

    # -- size cap ------------------------------------------------------------------
    def _maybe_evict(self, written: int) -> None:
        if self.max_size is None:
            return
        self._written_since_check += written
        now = time.monotonic()
        if self._written_since_check < self.max_size * _EVICT_CHECK_FRACTION and now - self._last_check < _EVICT_CHECK_S:
            return
        self._written_since_check = 0
        self._last_check = now
        try:
            self.evict(self.max_size)
        except filelock.Timeout:
            pass  # another process is evicting right now

    def evict(self, max_bytes: int) -> int:
        """LRU eviction under one lock per cache, so concurrent evictors do not double-delete."""
        with filelock.FileLock(self.root / ".evict.lock", timeout=0):
            self.vacuum()
            return super().evict(max_bytes)

    def vacuum(self, namespace: str | None = None) -> int:
        """Remove what dead writers and finished leases left: stale temp files, expired leases, idle lease locks.

        A lease's ``.lock`` file outlives the lease (filelock never deletes it), one per key
        ever compiled. It is removed only when no lease file is beside it and nobody has
        taken the lock for :data:`STALE_TEMP_S` (filelock rewrites the file on every
        acquire), so no process can be waiting on the inode we unlink.
        """
        cutoff = self._clock() - STALE_TEMP_S
        removed = 0
        for top in ("objects", "leases"):
            base = self.root / top
            for ns in [namespace] if namespace else subdirectories(base):
                for directory, _dirs, files in os.walk(base / ns):
                    for name in files:
                        path = Path(directory) / name
                        try:
                            st = path.lstat()
                        except FileNotFoundError:
                            continue
                        if st.st_mtime >= cutoff:
                            continue
                        if name.endswith(".lease"):
                            removed += self._remove_expired_lease(path)
                        elif name.startswith(TEMP_PREFIX) or (
                            name.endswith(".lease.lock") and not path.with_suffix("").exists()
                        ):
                            path.unlink(missing_ok=True)
                            removed += 1
        return removed

    def _remove_expired_lease(self, path: Path) -> bool:
        """Delete a lease that expired long ago, under its lock so no takeover is under way."""
        try:
            with filelock.FileLock(f"{path}.lock", timeout=0):
                held = self._read_lease(path)
                if held is None or held[1] >= self._clock() - STALE_TEMP_S:
                    return False
                path.unlink(missing_ok=True)
                return True
        except filelock.Timeout:
            return False

    # -- leases --------------------------------------------------------------------
    def _read_lease(self, path: Path) -> tuple[str, float] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                record = json.loads(f.read())
            return str(record["token"]), float(record["expires"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return ("", 0.0)  # unreadable: treat as expired so it can be taken over

    def _write_temp_lease(self, directory: Path, token: str, ttl: float) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump({"token": token, "expires": self._clock() + ttl}, f)
        return Path(tmp)

    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        path = self._lease_path(name)
        tmp = None
        try:
            tmp = self._write_temp_lease(self._dir("leases", path.parent.name), token, ttl)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                pass
            with filelock.FileLock(f"{path}.lock"):
                held = self._read_lease(path)
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
        except OSError as exc:
            raise BackendError(_reason(exc), f"lease {name}: {exc.strerror}") from None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def lease_renew(self, name: str, token: str, ttl: float) -> bool:
        path = self._lease_path(name)
        try:
            with filelock.FileLock(f"{path}.lock"):
                held = self._read_lease(path)
                if held is None or held[0] != token or held[1] <= self._clock():
                    return False
                os.replace(self._write_temp_lease(path.parent, token, ttl), path)
                return True
        except OSError as exc:
            raise BackendError(_reason(exc), f"lease {name}: {exc.strerror}") from None

    def lease_release(self, name: str, token: str) -> None:
        path = self._lease_path(name)
        try:
            with filelock.FileLock(f"{path}.lock"):
                held = self._read_lease(path)
                if held is not None and held[0] == token:
                    path.unlink(missing_ok=True)
        except OSError as exc:
            raise BackendError(_reason(exc), f"lease {name}: {exc.strerror}") from None

    def lease_holder(self, name: str) -> LeaseState | None:
        """Read without the lock: the lease file is replaced whole (link or rename), never rewritten in place."""
        held = self._read_lease(self._lease_path(name))
        return None if held is None else LeaseState(held[0], held[1] - self._clock())
