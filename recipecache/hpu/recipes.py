"""One node's recipe directory, read and written by the bridge's file protocol.

The protocol (see :mod:`recipecache.hpu` for what is documented and what is assumed):
a recipe is ``<name>.recipe`` plus ``<name>.meta``; a writer creates the metadata file,
holds ``flock(LOCK_EX)`` on it while it writes the recipe and then the metadata, and
releases it; a reader takes ``LOCK_SH`` without waiting and treats a busy lock, a missing
or empty metadata file as a miss. So a recipe is *complete* exactly when its metadata
file is non-empty and can be share-locked, and it stays complete while we hold that
lock.

Everything here is the agent's side of that protocol: it never shows the bridge a
metadata file before the recipe it describes is complete, and it never takes a recipe
that a writer still holds.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import msgpack

from ..buffers import Buffer
from ..fsutil import regular_files, write_atomic

log = logging.getLogger(__name__)

RECIPE_SUFFIX = ".recipe"
META_SUFFIX = ".meta"
#: The agent's temp files; the bridge only looks at its two suffixes, so it never sees them.
TEMP_PREFIX = ".recipecache-"
#: Recipe names are hashes; anything else (a path, "..") is refused before it becomes a file name.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")
_PAYLOAD_VERSION = 1


def valid_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.match(name) is not None


@dataclass(frozen=True)
class LocalRecipe:
    """What one ``scan`` saw of a recipe, without locking or reading it."""

    name: str
    #: recipe plus metadata bytes: what counts against the directory's cap
    size: int
    #: the recipe file's mtime: its creation time, the order in which the bridge evicts
    created: float
    #: the metadata file is non-empty: complete, or a writer is finishing it
    has_meta: bool


@dataclass(frozen=True)
class RecipeFiles:
    """A recipe and its metadata, as they travel through the store (opaque bytes both)."""

    name: str
    recipe: bytes
    meta: bytes

    @property
    def size(self) -> int:
        return len(self.recipe) + len(self.meta)

    def pack(self) -> bytes:
        return msgpack.packb(
            {"v": _PAYLOAD_VERSION, "name": self.name, "recipe": self.recipe, "meta": self.meta}, use_bin_type=True
        )

    @classmethod
    def unpack(cls, blob: Buffer, name: str) -> RecipeFiles | None:
        """The files in a verified store payload, or None if it is not a recipe named ``name``."""
        try:
            fields: Any = msgpack.unpackb(blob, raw=False)
        except (ValueError, msgpack.UnpackException):
            return None
        if not isinstance(fields, dict) or fields.get("v") != _PAYLOAD_VERSION or fields.get("name") != name:
            return None
        recipe, meta = fields.get("recipe"), fields.get("meta")
        if not isinstance(recipe, bytes) or not isinstance(meta, bytes) or not recipe or not meta:
            return None
        return cls(name, recipe, meta)


class Install(Enum):
    INSTALLED = "installed"
    #: a complete recipe of that name is already there (the bridge wrote it first)
    PRESENT = "present"
    #: a bridge rank holds the metadata lock: it is writing this recipe now
    BUSY = "busy"


class Busy(Exception):
    """The metadata file is locked by someone else."""


@contextmanager
def _locked(path: Path, mode: int, *, create: bool = False) -> Iterator[int]:
    """An fd of ``path`` under ``flock(mode)``, never waiting; raises Busy or FileNotFoundError.

    Checks after locking that ``path`` still names the locked file: a writer that
    replaced or removed it in between would otherwise leave us holding a lock nobody
    else looks at.
    """
    flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
    fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(str(path)) from None
        held, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (held.st_ino, held.st_dev) != (now.st_ino, now.st_dev):
            raise Busy(str(path))
        yield fd
    finally:
        os.close(fd)  # drops the lock


def _read_fd(fd: int) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """The whole file behind ``fd`` with its (size, mtime) before and after the read."""
    before = os.fstat(fd)
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    after = os.fstat(fd)
    return b"".join(chunks), (before.st_size, before.st_mtime_ns), (after.st_size, after.st_mtime_ns)


class RecipeDir:
    """A node-local recipe directory with a size cap, as the agent sees it."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes

    def _recipe(self, name: str) -> Path:
        return self.path / f"{name}{RECIPE_SUFFIX}"

    def _meta(self, name: str) -> Path:
        return self.path / f"{name}{META_SUFFIX}"

    def scan(self) -> dict[str, LocalRecipe]:
        """Every recipe file in the directory, complete or not (one ``os.scandir``, no reads)."""
        found: dict[str, LocalRecipe] = {}
        for filename, st in regular_files(self.path):
            name = filename[: -len(RECIPE_SUFFIX)]
            if filename.endswith(RECIPE_SUFFIX) and valid_name(name):
                meta_size = _size(self._meta(name))
                found[name] = LocalRecipe(name, st.st_size + meta_size, st.st_mtime, meta_size > 0)
        return found

    def read_complete(self, name: str) -> RecipeFiles | None:
        """Recipe and metadata if the recipe is complete, else None (being written, gone, or torn).

        Holds the shared lock while reading, so no writer of the bridge's protocol can
        start on this recipe meanwhile, and checks that neither file changed during the
        read, which catches a writer that does not lock.
        """
        try:
            with _locked(self._meta(name), fcntl.LOCK_SH) as meta_fd:
                meta, meta_before, meta_after = _read_fd(meta_fd)
                recipe_fd = os.open(self._recipe(name), os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    recipe, recipe_before, recipe_after = _read_fd(recipe_fd)
                finally:
                    os.close(recipe_fd)
        except (Busy, FileNotFoundError):
            return None
        if meta_before != meta_after or recipe_before != recipe_after or not meta or not recipe:
            return None
        return RecipeFiles(name, recipe, meta)

    def install(self, files: RecipeFiles) -> Install:
        """Put a recipe from another node in place without the bridge ever seeing half of it.

        Under the bridge's own exclusive lock on the metadata file: the recipe goes in
        first (temp file, rename), the metadata last (temp file, rename), so a reader
        finds either no usable metadata (a miss) or metadata whose recipe is complete.
        A bridge writer that starts meanwhile cannot get the lock, and the bridge's
        first-writer-wins rule makes it leave the recipe to us.
        """
        try:
            with _locked(self._meta(files.name), fcntl.LOCK_EX, create=True) as meta_fd:
                if os.fstat(meta_fd).st_size > 0:
                    return Install.PRESENT
                # fsync: the bridge cannot verify a recipe, so a crash must not leave metadata over a torn one
                write_atomic(self._recipe(files.name), files.recipe, durable=True, prefix=TEMP_PREFIX)
                write_atomic(self._meta(files.name), files.meta, durable=True, prefix=TEMP_PREFIX)
        except Busy:
            return Install.BUSY
        return Install.INSTALLED

    def evict(self, name: str) -> bool:
        """Remove a recipe unless a bridge rank holds its lock.

        Under the exclusive lock (created if the metadata is missing, as after a writer
        died), so no reader or writer of the bridge touches the name until both files
        are gone: a reader meanwhile fails its shared lock and misses, a writer fails
        its exclusive lock and leaves the name alone.
        """
        try:
            with _locked(self._meta(name), fcntl.LOCK_EX, create=True):
                self._recipe(name).unlink(missing_ok=True)
                self._meta(name).unlink(missing_ok=True)
        except Busy:
            return False
        return True

    def make_room(self, needed: int) -> tuple[bool, list[str]]:
        """Evict the oldest recipes until ``needed`` more bytes fit under the cap.

        Returns whether they fit and what was evicted. The bridge evicts the same way
        (oldest by creation time), so the agent keeps the cap the bridge would keep.
        Callers check that ``needed`` alone fits; otherwise this empties the directory.
        """
        recipes = sorted(self.scan().values(), key=lambda r: r.created)
        used = sum(r.size for r in recipes)
        evicted: list[str] = []
        for recipe in recipes:
            if used + needed <= self.max_bytes:
                break
            if self.evict(recipe.name):
                used -= recipe.size
                evicted.append(recipe.name)
        return used + needed <= self.max_bytes, evicted

    def clear(self) -> int:
        """Remove every recipe nobody holds, and our temp files; returns how many recipes went."""
        self.remove_temps()
        return sum(self.evict(name) for name in self.scan())

    def remove_temps(self) -> None:
        """Drop temp files a killed agent left (one agent per node, so none is in use now)."""
        for entry in os.scandir(self.path):
            if entry.name.startswith(TEMP_PREFIX):
                Path(entry.path).unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0
