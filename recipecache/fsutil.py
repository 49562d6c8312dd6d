"""Filesystem safety shared by everything that keeps artifacts in a directory.

Artifacts are code that ranks or devices run, so a directory holding them must be ours
alone, and a file in it must appear whole or not at all.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

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
    directory = Path(path).expanduser()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
        parent = os.stat(directory.parent)
    except OSError as exc:
        raise ConfigError(f"{what} {directory} is not usable: {exc.strerror}") from None
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {directory} is a symlink or not a directory")
    if st.st_uid != uid:
        raise ConfigError(f"{what} {directory} belongs to another user (uid {st.st_uid})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"{what} {directory} is writable by group or others, who could plant code that runs here; "
            f"run: chmod go-w {directory}"
        )
    others_write = parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if parent.st_uid not in (uid, 0) or (others_write and not parent.st_mode & stat.S_ISVTX):
        raise ConfigError(f"the parent of {what} {directory} may be changed by other users; use a private path")
    return directory


def write_atomic(target: Path, data: bytes | memoryview, *, durable: bool = False, prefix: str = TEMP_PREFIX) -> None:
    """Write ``target`` through a temp file in its own directory and a rename.

    Readers see the old file, the new one or none, never a partial one. ``durable``
    adds an fsync before the rename, for files whose readers cannot verify a checksum
    (after a crash the rename may otherwise survive while the data does not). ``prefix``
    names the temp file, so whoever cleans up after dead writers can find it.
    """
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


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
