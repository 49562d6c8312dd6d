"""Put an AOTInductor library where this node can load it, before torch loads it (a torch 2.13 defect).

A precompiled function's graphs are ``CompiledAOTI`` objects that carry their ``.so``
(and its sources and metadata) in ``_cached_files``, keyed by the absolute paths of the
*producer's* cache dir. On load, ``CompiledAOTI.__post_init__`` (torch/_inductor/
output_code.py:1051) dlopens ``filename`` first and only then writes ``_cached_files``
back (:1059), to those producer paths and without creating their directory: on a fresh
node the dlopen fails with "cannot open shared object file", and on a node where that
path happens to exist it would load whatever file lies there.

:func:`relocating` fixes both while torch unpickles a precompiled function in this
thread: every ``CompiledAOTI`` restored there gets its files written (directories
created, atomically, into directories that are ours alone, as kernels are) under this
node's inductor cache dir, in a directory named by the files' digest, and its
``filename`` pointed there, before anything is loaded. A name in
``filename`` that the object does not carry, or a carried file name that is not a plain
file name, makes the load fail (and the caller fall back) rather than load a file the
artifact did not ship.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch._inductor.output_code import CompiledAOTI

from ..buffers import Buffer
from .artifact import write_private

#: subdirectory of the inductor cache dir holding relocated AOTInductor files
SUBDIR = "recipecache-aoti"

_local = threading.local()
_install_lock = threading.Lock()
_original: Any = None


class RelocationError(RuntimeError):
    """A restored ``CompiledAOTI`` names files it does not carry, or carries unusable names."""


def _plain_name(path: str) -> str:
    name = Path(path).name
    if not name or name.startswith(".") or name != path.rsplit("/", 1)[-1]:
        raise RelocationError(f"refusing AOTInductor file name {path!r}")
    return name


def relocate(code: CompiledAOTI, root: Path) -> None:
    """Write ``code``'s carried files under ``root`` and point it at them (see the module docstring).

    As kernels are (:func:`.artifact.install`), they are written only into directories
    that are ours alone, opened without following symlinks (:func:`.artifact.write_private`):
    ``root`` (torch's cache dir), its ``recipecache-aoti`` and the digest-named directory;
    ConfigError otherwise, and nothing is loaded.
    """
    cached: dict[str, bytes] = code._cached_files
    names = {old: _plain_name(old) for old in cached}
    if len(set(names.values())) != len(names):
        raise RelocationError("AOTInductor files with the same name")
    bundle = hashlib.sha256()
    for old in sorted(cached):
        bundle.update(names[old].encode() + b"\0" + hashlib.sha256(cached[old]).digest())
    relative = f"{SUBDIR}/{bundle.hexdigest()}"
    write_private(root, ((f"{relative}/{names[old]}", data) for old, data in cached.items()),
                  "torch's kernel cache directory", keep=_holds)
    moved = {old: str(root / relative / names[old]) for old in cached}
    filename = code.filename
    if isinstance(filename, str):
        if filename not in moved:
            raise RelocationError(f"AOTInductor library {filename} is not in the artifact")
        code.filename = moved[filename]
    elif isinstance(filename, list):
        missing = [f for f in filename if isinstance(f, str) and f not in moved]
        if missing:
            raise RelocationError(f"AOTInductor files {missing} are not in the artifact")
        code.filename = [moved[f] if isinstance(f, str) else f for f in filename]
    code._cached_files = {moved[old]: data for old, data in cached.items()}


def _holds(dir_fd: int, name: str, data: Buffer) -> bool:
    """Whether the regular file ``name`` in ``dir_fd`` holds exactly ``data`` (a symlink does not)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read(len(data) + 1) == data
    except OSError:
        return False


def _setstate(self: CompiledAOTI, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    root = getattr(_local, "root", None)
    if root is not None and self._cached_files:
        relocate(self, root)


def install() -> None:
    """Give ``CompiledAOTI`` the unpickling hook (it has no ``__setstate__`` of its own); idempotent."""
    global _original
    with _install_lock:
        if _original is None:
            _original = CompiledAOTI.__dict__.get("__setstate__", False)
            CompiledAOTI.__setstate__ = _setstate  # type: ignore[attr-defined]


def uninstall() -> None:
    global _original
    with _install_lock:
        if _original is None:
            return
        if _original is False:
            del CompiledAOTI.__setstate__  # type: ignore[attr-defined]
        else:
            CompiledAOTI.__setstate__ = _original  # type: ignore[attr-defined]
        _original = None


@contextmanager
def relocating(root: Path) -> Iterator[None]:
    """While torch unpickles in this block (this thread only), restored libraries move under ``root``."""
    install()
    previous = getattr(_local, "root", None)
    _local.root = root
    try:
        yield
    finally:
        _local.root = previous
