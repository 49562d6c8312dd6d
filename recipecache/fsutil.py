"""Filesystem safety shared by everything that keeps artifacts in a directory.

Artifacts are code that ranks or devices run, so a directory holding them must be ours
alone, and a file in it must appear whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .buffers import Buffer
from .errors import ConfigError

#: prefix of in-flight temp files; scanners skip names starting with "."
TEMP_PREFIX = ".tmp-"


def private_directory(path: str | os.PathLike[str], what: str) -> Path:
    """Create ``path`` (0700) if needed and refuse it unless only we can change it.

    It must be a real directory (not a symlink), ours, not writable by group or others,
    and its parent must belong to us or root and, if others may write the parent, be
    sticky (as ``/tmp`` is), or another user could rename our directory away and put
    theirs in its place. ``what`` names the directory in the one-line error.
    """
    return _private_directory(path, what)[0]


def _private_directory(path: str | os.PathLike[str], what: str) -> tuple[Path, os.stat_result]:
    """:func:`private_directory`, and the ``lstat`` of the directory it checked."""
    directory = Path(path).expanduser()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
        parent = os.stat(directory.parent)
    except OSError as exc:
        raise ConfigError(f"{what} {directory} is not usable: {exc.strerror}") from None
    uid = _check_private(st, what, directory)
    others_write = parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if parent.st_uid not in (uid, 0) or (others_write and not parent.st_mode & stat.S_ISVTX):
        raise ConfigError(f"the parent of {what} {directory} may be changed by other users; use a private path")
    return directory, st


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_uid, st.st_mode


#: Whether a held directory fd can be named as a path (``/proc/self/fd/N``, Linux): every path-based call
#: (``filelock``, ``os.walk``, ``mkstemp``) then resolves through the fd, not through the name.
_FD_PATHS = Path("/proc/self/fd").is_dir()


class PrivateDirectory:
    """A :func:`private_directory` that stays checked, and is the one used, for as long as a process uses it.

    Checking once, when a process opens the directory, is not enough: a tmp cleaner may
    remove it mid-job, and in a parent others may write (a sticky ``/tmp``) another user
    may then create one of the same name and plant entries in it, which a store without a
    secret would serve (a pickle, a ``.so``: code run by every rank). Checking the name
    before each use is not enough either: the name can be swapped (renamed, symlinked)
    between the check and the open. So the directory is opened once (``O_DIRECTORY |
    O_NOFOLLOW``), checked through that fd, and :meth:`path` names it through the fd
    (``/proc/self/fd/N``): every file opened, renamed or removed under that path is in the
    directory that was checked, whatever is at its name by then. Before each use one
    ``lstat`` of the name: when the name no longer is the directory checked (or its owner or
    mode changed) the whole check runs again, which recreates a missing directory as
    :func:`private_directory` does and raises ConfigError for one that is not private, and
    a new fd is held. The fds held before stay open until :meth:`close` (a thread may be
    using one), so a number is never reused under a caller; there is one per change of the
    directory.
    """

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.what = what
        self.root = Path(path).expanduser()
        self._lock = threading.Lock()
        #: every fd held, the current one last; closed together (:meth:`close`, or when this is collected)
        self._fds: list[int] = []
        weakref.finalize(self, _close_fds, self._fds)
        self._checked = self._open()

    def _open(self) -> tuple[int, int, int, int]:
        """Check the directory, hold an fd of it (checked through the fd) and return what was checked."""
        directory, st = _private_directory(self.root, self.what)
        fd = open_private_directory(directory, self.what)
        if _identity(os.fstat(fd)) != _identity(st):
            os.close(fd)
            raise ConfigError(f"{self.what} {directory} was replaced while it was checked")
        self._fds.append(fd)
        return _identity(st)

    def path(self) -> Path:
        """The directory, through the held fd (checked again, and opened again, if its name is not the one checked)."""
        with self._lock:
            try:
                unchanged = _identity(os.lstat(self.root)) == self._checked
            except OSError:
                unchanged = False
            if not unchanged or not self._fds:  # changed, or closed and used again (a lease released at exit)
                self._checked = self._open()
            return Path(f"/proc/self/fd/{self._fds[-1]}") if _FD_PATHS else self.root

    def close(self) -> None:
        with self._lock:
            _close_fds(self._fds)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


def _check_private(st: os.stat_result, what: str, directory: str | os.PathLike[str], *, kind: str = "directory") -> int:
    """Refuse (ConfigError) a directory (or ``kind="file"``: a regular file) that is a symlink, not ours,
    or writable by group or others; our uid."""
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    is_kind = stat.S_ISREG if kind == "file" else stat.S_ISDIR
    if stat.S_ISLNK(st.st_mode) or not is_kind(st.st_mode):
        raise ConfigError(f"{what} {directory} is a symlink or not a {kind}")
    if st.st_uid != uid:
        raise ConfigError(f"{what} {directory} belongs to another user (uid {st.st_uid})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"{what} {directory} is writable by group or others, who could plant code that runs here; "
            f"run: chmod go-w {directory}"
        )
    return uid


def open_private_directory(path: str | os.PathLike[str], what: str, *, dir_fd: int | None = None) -> int:
    """A read-only fd of the private directory ``path`` (relative to ``dir_fd`` if given), created 0700 if missing.

    No symlink is followed at the last component (``O_NOFOLLOW``), and the directory opened
    is checked as :func:`private_directory` checks one (through the fd, so it cannot be
    swapped between check and use). Raises ConfigError naming ``what``. With ``dir_fd``,
    the caller vouches for that directory (see :func:`private_directory`), so nobody else
    can replace ``path`` in it afterwards.
    """
    try:
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"{what} {path} is not usable: {exc.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfigError(f"{what} {path} is a symlink or not a directory") from None
        raise ConfigError(f"{what} {path} is not usable: {exc.strerror}") from None
    try:
        _check_private(os.fstat(fd), what, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomic_at(dir_fd: int, name: str, *parts: Buffer, prefix: str = TEMP_PREFIX) -> None:
    """:func:`write_atomic` of ``name`` in the directory ``dir_fd``, following no symlink.

    The temp file is created with ``O_EXCL | O_NOFOLLOW`` (0600) next to ``name`` and
    renamed over it: a symlink planted at ``name`` is replaced, never written through.
    """
    tmp = f"{prefix}{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, parts)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


class NotRegularFileError(OSError):
    """Where a file belongs there is a symlink, a FIFO, a socket or a device, which is never read."""


def open_regular_file(
    path: str | os.PathLike[str], *, dir_fd: int | None = None, follow_links: bool = False
) -> int | None:
    """A read-only fd of the regular file at ``path`` (relative to ``dir_fd`` if given); None if there is none.

    Raises :class:`NotRegularFileError` for anything else there: a symlink is not followed
    (``O_NOFOLLOW``; ``follow_links`` for readers of files the user points them at, such as a
    run directory's logs), and a FIFO, socket or device is never read. Reading a FIFO (or opening
    it, without a writer) blocks forever, so the open does not block (``O_NONBLOCK``, which
    changes nothing for a regular file) and what was opened is checked through its fd, so
    nothing can be swapped in between the check and the read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow_links else os.O_NOFOLLOW) | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
            raise NotRegularFileError(exc.errno, "a symlink or a socket", str(path)) from None
        raise
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise NotRegularFileError(errno.EINVAL, "not a regular file", str(path))
    return fd


def open_named_file(path: str | os.PathLike[str], what: str) -> BinaryIO:
    """The regular file a user named (a key file, an export) open for reading, symlinks followed; ConfigError
    ``"<what>: <why>"`` when there is none or something else is there.

    A FIFO would block the open or the read forever and a device such as ``/dev/zero`` never
    ends, so neither is read (:func:`open_regular_file`).
    """
    try:
        fd = open_regular_file(path, follow_links=True)
    except NotRegularFileError:
        raise ConfigError(f"{what}: not a regular file") from None
    except OSError as exc:
        raise ConfigError(f"{what}: {exc.strerror}") from None
    if fd is None:
        raise ConfigError(f"{what}: No such file or directory")
    return os.fdopen(fd, "rb")


def read_private_file_at(dir_fd: int, name: str, what: str) -> bytes | None:
    """The bytes of ``name`` in the directory ``dir_fd``, or None if there is no such file.

    The read twin of :func:`write_atomic_at`: the file is opened by :func:`open_regular_file`
    (no symlink followed, no FIFO read) and checked through its fd as
    :func:`private_directory` checks a directory (a regular file, ours, not writable by group
    or others), so what is read is what only we could have written. Raises ConfigError
    naming ``what`` otherwise.
    """
    try:
        fd = open_regular_file(name, dir_fd=dir_fd)
    except NotRegularFileError:
        raise ConfigError(f"{what} {name} is a symlink or not a file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {name} is not usable: {exc.strerror}") from None
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        _check_private(os.fstat(f.fileno()), what, name, kind="file")
        return f.read()


#: ``writev`` takes at most this many buffers per call (POSIX guarantees 16; Linux allows 1024).
_IOV_MAX = 16


def write_all(fd: int, parts: tuple[Buffer, ...]) -> None:
    """Write every byte of ``parts`` to ``fd`` with ``writev``: the parts are never joined (copied) first.

    ``writev`` may write less than asked (a signal, a 2 GiB per-call limit); the rest is
    written by further calls.
    """
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        if written == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _file_type(mode: int) -> str:
    """What a non-regular file is, for an error message."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "something else"


def check_directory_to_be(path: Path, what: str) -> Path:
    """``path`` if it is a directory, or one could be made there: its nearest existing ancestor is a directory this
    process may create entries in. Anything else is a ConfigError naming ``what``, said before the work starts
    rather than a traceback from the ``mkdir`` once it has (``--run-dir /dev/null``); nothing is created here, so
    bad input leaves nothing behind.
    """
    for place in (path, *path.parents):
        try:
            mode = os.stat(place).st_mode
        except (FileNotFoundError, NotADirectoryError):  # not there, or under a file: the ancestor says which
            continue
        except OSError as exc:
            raise ConfigError(f"{what} {path}: {exc.strerror}") from None
        if not stat.S_ISDIR(mode):
            shown = "it" if place == path else str(place)
            kind = "a regular file" if stat.S_ISREG(mode) else _file_type(mode)
            raise ConfigError(f"{what} {path}: {shown} is {kind}, not a directory")
        if place != path and not os.access(place, os.W_OK | os.X_OK):
            raise ConfigError(f"{what} {path}: cannot create it in {place} (permission denied)")
        return path
    return path


def check_output_file(path: Path, what: str) -> Path:
    """``path`` if a file may be published there by a rename: a new name, or a regular file (not a symlink to one).

    Anything else is a ConfigError naming ``what``, never replaced: a rename onto a symlink,
    FIFO or device node puts a regular file in its place (as root, an output of
    ``/dev/stdout`` would replace that link), and onto a directory it fails after all the
    work is done. Callers check before the work and again just before the rename.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what} {path} is {_file_type(mode)}, not a regular file: refusing to replace it")
    return path


def write_output_file(path: Path, what: str, *parts: Buffer) -> None:
    """:func:`write_atomic` of a file a user named (a report, a trace, a picture): onto a new name or a regular
    file only (:func:`check_output_file`, ConfigError naming ``what`` otherwise)."""
    write_atomic(check_output_file(path, what), *parts)


def write_atomic(target: Path, *parts: Buffer, durable: bool = False, prefix: str = TEMP_PREFIX) -> None:
    """Write the concatenation of ``parts`` as ``target`` through a temp file in its own directory and a rename.

    Readers see the old file, the new one or none, never a partial one. ``durable``
    adds an fsync before the rename, for files whose readers cannot verify a checksum
    (after a crash the rename may otherwise survive while the data does not). ``prefix``
    names the temp file, so whoever cleans up after dead writers can find it.
    """
    tmp = write_temp(target.parent, parts, durable=durable, prefix=prefix)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_temp(directory: Path, parts: tuple[Buffer, ...], *, durable: bool = False, prefix: str = TEMP_PREFIX) -> Path:
    """A new private (0600) temp file in ``directory`` holding the concatenation of ``parts``."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        try:
            write_all(fd, parts)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def subdirectories(path: Path) -> list[str]:
    """Names of the real (not symlinked) directories in ``path``, sorted; none if ``path`` is missing."""
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def regular_files(path: Path) -> Iterator[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of each regular file in ``path``, without following links.

    Skips hidden names (temp files, locks), anything that is not a plain file, and files
    that vanish while we look (other processes publish and evict concurrently); a missing
    directory has no files.
    """
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            yield entry.name, st
