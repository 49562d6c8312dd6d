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
from collections.abc import Iterator
from pathlib import Path

import filelock

from ..errors import BackendError
from ..reasons import Reason
from ..fsutil import TEMP_PREFIX, private_directory, write_atomic
from .base import Backend, Clock, EntryInfo, check_key

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
            _unlink(self._object_path(key))
        except OSError as exc:
            raise BackendError(_reason(exc), f"delete {key}: {exc.strerror}") from None

    def scan(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        base = self.root / "objects"
        namespaces = [namespace] if namespace else _listdir(base)
        for ns in namespaces:
            for fan in _listdir(base / ns):
                for entry in _scandir(base / ns / fan):
                    if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield EntryInfo(f"{ns}/{entry.name}", st.st_size, st.st_mtime)

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
            self._remove_stale_temps()
            return super().evict(max_bytes)

    def _remove_stale_temps(self) -> None:
        cutoff = self._clock() - STALE_TEMP_S
        for directory, _dirs, files in os.walk(self.root / "objects"):
            for name in files:
                if name.startswith(TEMP_PREFIX):
                    path = Path(directory) / name
                    try:
                        if path.lstat().st_mtime < cutoff:
                            path.unlink()
                    except FileNotFoundError:
                        pass

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
                if held is not None and held[1] > self._clock():
                    return False
                os.replace(tmp, path)
                tmp = None
                return True
        except OSError as exc:
            raise BackendError(_reason(exc), f"lease {name}: {exc.strerror}") from None
        finally:
            if tmp is not None:
                _unlink(tmp)

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
                    _unlink(path)
        except OSError as exc:
            raise BackendError(_reason(exc), f"lease {name}: {exc.strerror}") from None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(path))
    except FileNotFoundError:
        return []
