"""The default backend: a directory on local disk or on a mount shared by several hosts.

Where each thing lives: :mod:`.file_layout`; the leases: :mod:`.file_leases`.

Publishing writes a temp file in the target's own directory and renames it over the
target, so readers on any host see the old file, the new file or none, never a partial
one. No fsync: after a crash a torn file is possible, and the envelope checksum turns it
into a counted ``corrupt`` miss, which is cheaper than an fsync on every put.

Reads copy nothing they need not: a small file is read straight into the one ``bytes``
object returned, and a large one (``MMAP_MIN`` and up) on a local filesystem is mapped
(``mmap``, pre-faulted) and returned as a ``memoryview`` of the mapping, which saves both
the copy out of the page cache and the page faults of a fresh buffer (measured:
``benchmarks/store_bench.py``; a 64 MB get costs half a plain read). Never on a network
filesystem: there a server error or another host's eviction turns a touch of a mapped
page into SIGBUS, where ``read`` gives an error the store counts. A mapped file is never
truncated under its reader, because nothing here rewrites a file in place: every write
is a new file renamed into place, and a removed file lives on while mapped.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import filelock

from ..buffers import Buffer
from ..errors import BackendError
from ..fsutil import (
    TEMP_PREFIX,
    NotRegularFileError,
    open_regular_file,
    regular_files,
    subdirectories,
    write_atomic,
    write_temp,
)
from ..health import FAIL, PASS, HealthCheck, free_space, private
from ..reasons import Reason
from .base import Backend, Clock, EntryInfo, LeaseState, is_key, value_matches
from .file_layout import Layout, os_error_reason
from .file_leases import LeaseFiles
from .url import StoreURL

log = logging.getLogger(__name__)

#: Temp files older than this belong to a writer that died; eviction removes them.
STALE_TEMP_S = 3600.0
#: Clock difference to the file server above which leases on a shared mount are unsafe (they expire by writers' clocks).
MAX_CLOCK_SKEW_S = 2.0
#: Between size checks a process writes at most this fraction of the cap, or waits this long.
_EVICT_CHECK_FRACTION = 0.05
_EVICT_CHECK_S = 30.0
#: Files this large are mapped instead of read, on the filesystems below.
MMAP_MIN = 1 << 20
#: Fault every page in at mmap time (Linux), so hashing the view takes no page faults.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: Filesystems on local storage, where a mapped file cannot fail under its reader (but for a
#: disk error, which the kernel libraries every rank maps would not survive either).
LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "zfs", "bcachefs", "jfs", "reiserfs", "overlay"}
)
#: A conditional write holds its key's lock for one small compare; waiting longer means a stuck holder.
VALUE_LOCK_TIMEOUT_S = 10.0
#: An explicit eviction (``recipecache prune``) waits this long for one under way in another process.
EVICT_LOCK_TIMEOUT_S = 120.0


class FilesystemBackend(Backend):
    URL_OPTIONS = frozenset({"max_size"})

    @property
    def identity(self) -> str:
        """The directory's real path: ``file:///a/../b``, a symlink to it and the directory itself are one store."""
        return f"file://{os.path.realpath(self.root)}"

    @classmethod
    def from_url(cls, url: StoreURL) -> FilesystemBackend:
        """``file:///absolute/path[?max_size=10GiB]``."""
        url.check_options(cls.URL_OPTIONS)
        if url.parts.netloc not in ("", "localhost") or not url.parts.path:
            raise url.error("use file:///absolute/path")
        return cls(urllib.parse.unquote(url.parts.path), max_size=url.size("max_size", None))

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_size: int | None = None,
        clock: Clock = time.time,
        what: str = "cache directory",
    ) -> None:
        #: where each thing lives under the root
        self.layout = Layout(root, what)
        self.root = self.layout.root
        self.url = f"file://{self.root}"
        self.max_size = max_size
        self._clock = clock
        self._leases = LeaseFiles(self.layout, clock)
        self._written_since_check = 0
        self._last_check = 0.0
        self._atime_warned = False
        self._map_large_files = filesystem_type(self.root) in LOCAL_FILESYSTEMS

    # -- values --------------------------------------------------------------------
    def get(self, key: str) -> bytes | memoryview | None:
        path = self.layout.object_path(key)
        try:
            fd = open_regular_file(path)
        except NotRegularFileError:
            if path.is_symlink():
                log.warning(
                    "recipecache: %s is a symlink; removing it instead of following it", self.layout.shown(path)
                )
                self.delete(key)
            else:  # a FIFO, socket or device: never read; a put replaces it
                log.warning("recipecache: %s is not a regular file; ignoring it", self.layout.shown(path))
            return None
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"read {self.layout.shown(path)}: {exc.strerror}") from None
        if fd is None:
            return None
        try:
            data: memoryview | bytes | None = _map_fd(fd) if self._map_large_files else None
            if data is None:
                data = _read_fd(fd)
            self._touch(fd)
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"read {self.layout.shown(path)}: {exc.strerror}") from None
        finally:
            os.close(fd)
        return data

    def _touch(self, fd: int) -> None:
        """Record the access for least-recently-used eviction, if the store can be written.

        A read-only store (a pre-warmed mount) refuses it; the data read is good all the
        same, so that is no reason to miss. Eviction then goes by write times.
        """
        try:
            os.utime(fd)
        except OSError as exc:
            if not self._atime_warned:
                self._atime_warned = True
                log.warning(
                    "recipecache: cannot record access times in %s (%s); reading on, eviction goes by write time",
                    self.root,
                    exc.strerror,
                )

    def put(self, key: str, value: Buffer, *more: Buffer) -> None:
        try:
            write_atomic(self.layout.new_object_path(key), value, *more)
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"write {key}: {exc.strerror}") from None
        self._maybe_evict(len(value) + sum(len(m) for m in more))

    def put_if(self, key: str, expected: Buffer | None, value: Buffer, *more: Buffer) -> bool:
        """Compare and rename under the key's value lock; the new file is written before the lock is taken."""
        tmp: Path | None = None
        try:
            target = self.layout.new_object_path(key)
            tmp = write_temp(target.parent, (value, *more))
            with self._value_lock(key):
                if not value_matches(_read_path(target), expected):
                    return False
                os.replace(tmp, target)
                tmp = None
        except filelock.Timeout:
            raise BackendError(Reason.BACKEND_SLOW, f"write {key}: its value lock is held too long") from None
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"write {key}: {exc.strerror}") from None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        self._maybe_evict(len(value) + sum(len(m) for m in more))
        return True

    def delete(self, key: str) -> None:
        try:
            self.layout.object_path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"delete {key}: {exc.strerror}") from None

    def delete_if(self, key: str, expected: Buffer) -> bool:
        """Move the file aside (atomic), compare the file we now own, and put it back unless it is ``expected``.

        Comparing in place and then unlinking would delete a value another process renamed
        in between; the file moved aside is ours alone. If it was not the expected value it
        goes back with ``link``, which fails, leaving the newer file, if yet another value
        was published meanwhile.
        """
        target = self.layout.object_path(key)
        aside = target.with_name(f"{TEMP_PREFIX}deleting-{secrets.token_hex(8)}")
        try:
            with self._value_lock(key):
                try:
                    os.rename(target, aside)
                except FileNotFoundError:
                    return False
                try:
                    if value_matches(_read_path(aside), expected):
                        return True
                    with contextlib.suppress(FileExistsError):  # a newer value was published meanwhile; it stays
                        os.link(aside, target, follow_symlinks=False)
                    return False
                finally:
                    aside.unlink(missing_ok=True)
        except filelock.Timeout:
            raise BackendError(Reason.BACKEND_SLOW, f"delete {key}: its value lock is held too long") from None
        except OSError as exc:
            raise BackendError(os_error_reason(exc), f"delete {key}: {exc.strerror}") from None

    def _value_lock(self, key: str) -> filelock.BaseFileLock:
        """The lock that orders conditional writes of one key (plain puts do not take it)."""
        return filelock.FileLock(self.layout.value_lock_path(key), timeout=VALUE_LOCK_TIMEOUT_S)

    def scan(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        """Entries in this store's layout only: a stray file someone dropped in is not ours to list or evict."""
        base = self.layout.checked_root() / "objects"
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
        if (
            self._written_since_check < self.max_size * _EVICT_CHECK_FRACTION
            and now - self._last_check < _EVICT_CHECK_S
        ):
            return
        self._written_since_check = 0
        self._last_check = now
        with contextlib.suppress(filelock.Timeout):  # another process is evicting right now
            self._evict(self.max_size, lock_timeout=0)

    def evict(self, max_bytes: int) -> int:
        """Evict down to ``max_bytes`` once an eviction under way in another process has finished.

        An explicit eviction (``recipecache prune``) must not fail because a put elsewhere
        happens to be evicting: it waits for that one, then evicts what is still above its
        own cap. A lock held past :data:`EVICT_LOCK_TIMEOUT_S` is a ``backend_slow`` error.
        """
        try:
            return self._evict(max_bytes, lock_timeout=EVICT_LOCK_TIMEOUT_S)
        except filelock.Timeout:
            raise BackendError(
                Reason.BACKEND_SLOW,
                f"another process has been evicting from {self.root} for {EVICT_LOCK_TIMEOUT_S:g} s; try again later",
            ) from None

    def _evict(self, max_bytes: int, *, lock_timeout: float) -> int:
        """LRU eviction under one lock per cache, so concurrent evictors do not double-delete."""
        with filelock.FileLock(self.layout.evict_lock_path(), timeout=lock_timeout):
            self.vacuum()
            return super().evict(max_bytes)

    def vacuum(self, namespace: str | None = None) -> int:
        """Remove what dead writers and finished leases left: stale temp files, expired leases, idle locks.

        A lease's ``.lock`` file outlives the lease (filelock never deletes it), one per key
        ever compiled, and so does the ``.value.lock`` of a key written with ``put_if`` or
        ``delete_if``. It is removed only when no lease file is beside it and nobody has
        taken the lock for :data:`STALE_TEMP_S` (filelock rewrites the file on every
        acquire), so no process can be waiting on the inode we unlink.
        """
        cutoff = self._clock() - STALE_TEMP_S
        removed = 0
        root = self.layout.checked_root()
        for top in ("objects", "leases"):
            base = root / top
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
                            removed += self._leases.remove_expired(path, STALE_TEMP_S)
                        elif (
                            name.startswith(TEMP_PREFIX)
                            or name.endswith(".value.lock")
                            or (name.endswith(".lease.lock") and not path.with_suffix("").exists())
                        ):
                            path.unlink(missing_ok=True)
                            removed += 1
        return removed

    # -- leases (lease files: :mod:`.file_leases`) ---------------------------------
    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        return self._leases.add(name, token, ttl)

    def lease_renew(self, name: str, token: str, ttl: float) -> bool:
        return self._leases.renew(name, token, ttl)

    def lease_release(self, name: str, token: str) -> None:
        self._leases.release(name, token)

    def lease_holder(self, name: str) -> LeaseState | None:
        return self._leases.holder(name)

    def close(self) -> None:
        self.layout.close()

    # -- doctor --------------------------------------------------------------------
    def health_checks(self, probe_key: str) -> list[HealthCheck]:
        """The root's permissions and free space, and this host's clock against the file system's."""
        return [
            private("permissions", self.root, "cache directory"),
            free_space("free space", self.root),
            self._clock_check(),
        ]

    def _clock_check(self) -> HealthCheck:
        """Compare the clock with a new file's mtime, which a network file system's server sets.

        Hosts sharing the store on a mount must agree on the time: a lease names its expiry
        in the writer's clock and is taken over by the reader's.
        """
        before = self._clock()
        try:
            tmp = write_temp(self.root, ())
            mtime = tmp.stat().st_mtime
            tmp.unlink()
        except OSError as exc:
            return HealthCheck(
                "clock",
                FAIL,
                f"cannot create a file in {self.root}: {exc.strerror}",
                "fix the store directory's permissions",
            )
        after = self._clock()
        skew = 0.0 if before - 1.0 <= mtime <= after + 1.0 else mtime - (before + after) / 2  # 1 s: mtime granularity
        if abs(skew) > MAX_CLOCK_SKEW_S:
            return HealthCheck(
                "clock",
                FAIL,
                f"this host's clock is {-skew:+.1f} s off the file system's",
                "synchronise the clocks (NTP): leases on a shared store expire by the writers' clocks",
            )
        return HealthCheck("clock", PASS, f"within {MAX_CLOCK_SKEW_S:.0f} s of the file system's (leases are safe)")


def _read_fd(fd: int) -> bytes:
    """The whole file behind ``fd``, read straight into the one ``bytes`` object returned (no further copy)."""
    with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
        return f.readall()


def _map_fd(fd: int) -> memoryview | None:
    """A read-only view of the whole file behind ``fd`` if it is large enough to map, else None.

    The mapping stays while the view (or a slice of it) is referenced, and goes with it.
    """
    size = os.fstat(fd).st_size
    if size < MMAP_MIN:
        return None
    try:
        return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ))
    except (OSError, ValueError):
        return None  # no mapping for this file (address space, or a file that cannot be mapped): read it


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (``ext4``, ``nfs4``...), from /proc/self/mountinfo; None if unknown."""
    try:
        dev = os.stat(path).st_dev
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    device = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:
        fields = line.split()  # id parent major:minor root mountpoint options [optional...] - type source ...
        if len(fields) > 8 and fields[2] == device and "-" in fields[6:]:
            return fields[fields.index("-", 6) + 1]
    return None


def _read_path(path: Path) -> bytes | None:
    """The file at ``path`` as ``get`` would return it (read, not mapped: it is only compared)."""
    try:
        fd = open_regular_file(path)
    except NotRegularFileError:
        return None  # get returns no value for what is not a file
    if fd is None:
        return None
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)
