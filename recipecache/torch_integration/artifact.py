"""The artifact one torch cache entry travels in: torch's entries plus the kernel files they need.

torch's FX-graph entry holds the generated *source* of its C++ kernels, not the built
``.so`` files, so a remote "hit" on a fresh node would still run g++ for every kernel.
An FX artifact therefore carries the ``<cache_dir>/<xx>/<hash>.main.so`` files its graph
loads, and a hit installs them where torch looks before it loads the entry.

One torch key may have several entries: a dynamic-shape graph compiled for sizes its
earlier compile's guards reject is a second *guard variant* under the same key (torch's
local cache keeps them all in one directory and lets its guards pick). An FX artifact
keeps up to :data:`MAX_VARIANTS` of them, newest first, each with the kernels it loads;
:meth:`Artifact.with_variant` merges a new one in (the caller does that inside a
compare-and-set, :meth:`recipecache.store.Store.update`). Other kinds hold one entry.

Framing is one msgpack map (never pickle)::

    {"format": "recipecache-torch/3", "kind": "fx"|"aot"|"pgo"|"isa"|"autotune",
     "entries": [{"data": <bytes>, "compile_s": <float>, "kernels": [<path>], "guards": <str>|None}],
     "files": [{"path": <str>, "data": <bytes>}], "bound": [[<FX key>, <shared FX key>], ...]}

``data`` is torch's own value (JSON with a base64 pickle inside) and stays opaque here:
the store has verified the envelope's BLAKE3 digest (and signature) over the whole
artifact before these bytes arrive, so the files need no digests of their own, and only
torch unpickles ``data``. ``guards`` is torch's guard expression of an FX variant, kept
to recognise a recompile of the same variant ("" for none: it accepts every input; None
when unknown). A file is accepted only with a relative path of the shape torch itself
writes (no ``/`` prefix, no ``..``, one two-character directory), and written only into a
directory that is ours alone (:func:`install`), so even a verified artifact cannot write
outside the kernel cache. Older formats are refused like any malformed value: the graph
compiles and its new artifact replaces them. This module does not import torch.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import msgpack

from ..buffers import Buffer
from ..errors import ConfigError
from ..fsutil import (
    open_private_directory,
    open_regular_file,
    private_directory,
    read_private_file_at,
    write_atomic_at,
)

log = logging.getLogger(__name__)

FORMAT = "recipecache-torch/3"
KINDS = ("fx", "aot", "pgo", "isa", "autotune")
#: guard variants an FX artifact keeps per key (the newest)
MAX_VARIANTS = 8
#: the only kernel paths torch writes under its cache dir: ``<2 chars>/<hash>[.main].so``, and the
#: empty :data:`PROBE_LOADED` marker torch >= 2.14 leaves beside a CPU-probe library it loaded
KERNEL_PATH = re.compile(r"^[a-z0-9]{2}/[a-z0-9]+(\.main)?\.so(\.load_ok)?\Z")
#: suffix of torch's "this probe library loaded" marker (cpu_vec_isa.VecISA.check_build, torch >= 2.14)
PROBE_LOADED = ".load_ok"
_ENTRY_FIELDS = {"data", "compile_s", "kernels", "guards"}


class ArtifactError(ValueError):
    """A stored value is not a well-formed artifact of the expected kind (counted as ``bad_artifact``)."""


@dataclass(frozen=True)
class KernelFile:
    """A built kernel: its path relative to torch's cache dir and its bytes; checked on creation."""

    path: str
    data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not KERNEL_PATH.match(self.path):
            raise ArtifactError(f"refusing kernel path {self.path!r}")
        if not isinstance(self.data, bytes):
            raise ArtifactError(f"kernel {self.path} has no bytes")


@dataclass(frozen=True)
class Entry:
    """One of torch's cache values, what compiling it cost, and the kernels a hit on it loads."""

    data: bytes
    #: seconds the producer spent compiling this entry (what a hit saves)
    compile_s: float = 0.0
    #: paths (among the artifact's files) of the kernels this entry loads
    kernels: tuple[str, ...] = ()
    #: FX: torch's guard expression ("" none), None when unknown; see the module docstring
    guards: str | None = None

    def replaces(self, older: Entry) -> bool:
        """Whether ``older`` is redundant next to this newer entry: the same variant, or shadowed by one without guards."""
        return self.guards is not None and (self.guards == "" or self.guards == older.guards)


@dataclass(frozen=True)
class Artifact:
    kind: str
    #: FX: guard variants, newest first; other kinds: exactly one
    entries: tuple[Entry, ...]
    files: tuple[KernelFile, ...] = ()
    #: AOTAutograd: (FX key the entry names, the shared key its graph is stored under), see the module docstring
    bound: tuple[tuple[str, str], ...] = ()

    @classmethod
    def single(
        cls,
        kind: str,
        data: bytes,
        files: Iterable[KernelFile] = (),
        compile_s: float = 0.0,
        bound: Iterable[tuple[str, str]] = (),
    ) -> Artifact:
        """An artifact of one entry that loads all of ``files``."""
        files = tuple(files)
        return cls(kind, (Entry(data, compile_s, tuple(f.path for f in files)),), files, tuple(bound))

    @property
    def entry(self) -> bytes:
        """The newest entry's value (the only one, for kinds other than ``fx``)."""
        return self.entries[0].data

    def files_of(self, entry: Entry) -> list[KernelFile]:
        wanted = set(entry.kernels)
        return [f for f in self.files if f.path in wanted]

    def with_variant(self, entry: Entry, files: Iterable[KernelFile], limit: int = MAX_VARIANTS) -> Artifact:
        """This artifact with ``entry`` (whose kernels are among ``files``) as the newest variant.

        Entries it replaces (:meth:`Entry.replaces`) go, then the oldest beyond ``limit``;
        files no remaining entry loads go with them.
        """
        kept = (entry, *(e for e in self.entries if not entry.replaces(e)))[:limit]
        available = {f.path: f for f in self.files} | {f.path: f for f in files}
        needed = sorted({path for e in kept for path in e.kernels})
        return Artifact(self.kind, kept, tuple(available[path] for path in needed), self.bound)

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "format": FORMAT,
                "kind": self.kind,
                "entries": [
                    {"data": e.data, "compile_s": float(e.compile_s), "kernels": list(e.kernels), "guards": e.guards}
                    for e in self.entries
                ],
                "files": [{"path": f.path, "data": f.data} for f in self.files],
                **({"bound": [list(pair) for pair in self.bound]} if self.bound else {}),
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, blob: Buffer, kind: str) -> Artifact:
        """Decode and check ``blob``; raises :class:`ArtifactError` for anything unexpected."""
        obj = decode(blob, FORMAT, "recipecache torch artifact")
        if obj.get("kind") != kind:
            raise ArtifactError(f"artifact kind {obj.get('kind')!r}, expected {kind!r}")
        entries, files = obj.get("entries"), obj.get("files")
        if not isinstance(files, list):
            raise ArtifactError("artifact file list malformed")
        checked_files = tuple(checked_file(f) for f in files)
        paths = {f.path for f in checked_files}
        if len(paths) != len(checked_files):
            raise ArtifactError("artifact lists a kernel twice")
        limit = MAX_VARIANTS if kind == "fx" else 1
        if not isinstance(entries, list) or not 1 <= len(entries) <= limit:
            raise ArtifactError("artifact entry list malformed")
        bound = obj.get("bound", [])
        if not isinstance(bound, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(k, str) and k for k in pair) for pair in bound
        ):
            raise ArtifactError("artifact list of bound graph keys malformed")
        return cls(
            kind,
            tuple(_checked_entry(e, paths) for e in entries),
            checked_files,
            tuple((fx_key, shared) for fx_key, shared in bound),
        )


def torch_pickle(value: bytes) -> bytes:
    """The pickle inside torch's remote-cache value (JSON ``{"data": <base64 pickle>, ...}``), not unpickled.

    Raises what ``json``/``base64`` raise (or KeyError/TypeError) for another shape.
    """
    return base64.b64decode(json.loads(value)["data"])


def _checked_entry(item: Any, paths: set[str]) -> Entry:
    if not isinstance(item, dict) or set(item) != _ENTRY_FIELDS:
        raise ArtifactError("artifact entry malformed")
    data, compile_s, kernels, guards = item["data"], item["compile_s"], item["kernels"], item["guards"]
    if not isinstance(data, bytes) or not isinstance(compile_s, float) or not compile_s >= 0:
        raise ArtifactError("artifact entry or compile time malformed")
    if guards is not None and not isinstance(guards, str):
        raise ArtifactError("artifact guard expression malformed")
    if not isinstance(kernels, list) or not all(isinstance(p, str) and p in paths for p in kernels):
        raise ArtifactError("artifact entry names a kernel it does not carry")
    return Entry(data, compile_s, tuple(kernels), guards)


def decode(blob: bytes | bytearray | memoryview, fmt: str, what: str) -> dict[str, Any]:
    """The msgpack map in ``blob`` if it says it is format ``fmt``; :class:`ArtifactError` otherwise."""
    try:
        obj = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ArtifactError(f"undecodable {what}: {exc}") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise ArtifactError(f"not a {what} (or another format version)")
    return obj


def checked_file(item: Any) -> KernelFile:
    if not isinstance(item, dict) or set(item) != {"path", "data"}:
        raise ArtifactError("artifact file record malformed")
    return KernelFile(item["path"], item["data"])  # checked in __post_init__


def install(files: Iterable[KernelFile], root: Path) -> int:
    """Write each kernel under ``root`` unless it is already there, byte for byte; returns how many were written.

    The same file is kept: it may already be loaded in this process. Any other file at the
    name is replaced: torch names kernels by a hash of their source and build command, but
    g++ writes the library at that name itself, so a compile killed mid-link leaves a torn
    one there, and what torch then loads must be the verified library this artifact carries.
    Each write is atomic, so a concurrent reader never loads half a library (and one that
    mapped the file before keeps its mapping).

    ``root`` (torch's ``cache_dir()``) and each ``<xx>`` directory written into must be
    ours alone (:func:`write_private`); anything else raises ConfigError before that
    directory gets a byte.
    """
    return write_private(root, ((f.path, f.data) for f in files), "torch's kernel cache directory", keep=_same_file_at)


def write_private(
    root: Path, files: Iterable[tuple[str, Buffer]], what: str, *, keep: Callable[[int, str, Buffer], bool]
) -> int:
    """Write ``(relative path, data)`` files under ``root`` through directories that are ours alone.

    ``root`` and every directory on a file's path must be private, as the store's own
    directory must (:func:`recipecache.fsutil.private_directory`): a real directory, not a
    symlink, owned by us, not writable by group or others (what is written here is code
    that runs on every rank that loads it). Directories are created if missing, opened
    without following symlinks and written through their descriptors, so a link planted
    or swapped in is never written through; each file is written atomically next to its
    name unless ``keep(dir_fd, name, data)`` says the one there will do. Returns how many
    were written; ConfigError (``what`` names ``root``) before a refused directory gets a
    byte. Paths are the caller's checked relative paths (``a/b/name``, at least one
    directory).
    """
    files = sorted(files, key=lambda f: f[0])
    if not files:
        return 0
    private_directory(root, what)  # the parent check: nobody else can swap root
    written = 0
    root_fd = open_private_directory(root, what)
    try:
        for directory, group in groupby(files, key=lambda f: f[0].rpartition("/")[0]):
            fds: list[int] = []
            try:
                for sub in directory.split("/"):
                    fds.append(
                        open_private_directory(
                            sub, f"the directory {directory} in {root}:", dir_fd=fds[-1] if fds else root_fd
                        )
                    )
                for path, data in group:
                    name = path.rpartition("/")[2]
                    if not keep(fds[-1], name, data):
                        write_atomic_at(fds[-1], name, data)
                        written += 1
            finally:
                for fd in reversed(fds):
                    os.close(fd)
    finally:
        os.close(root_fd)
    return written


def _same_file_at(dir_fd: int, name: str, data: Buffer) -> bool:
    """Whether the regular file ``name`` in ``dir_fd`` holds exactly ``data`` (no symlink followed)."""
    try:
        fd = open_regular_file(name, dir_fd=dir_fd)
    except OSError:  # a symlink, a FIFO...: replaced
        return False
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size != memoryview(data).nbytes:
            return False
        return f.read() == data


def collect(paths: Iterable[str], root: Path) -> tuple[list[KernelFile], list[str]]:
    """Read the built kernels at ``paths`` (absolute) as artifact files; also returns the ones not read.

    What this returns is shipped to every rank, so kernels are read as :func:`install`
    writes them: only from a ``root`` and ``<xx>`` directories that are ours alone, through
    descriptors that follow no symlink, and only regular files we own that group and others
    cannot write. A kernel that fails this (or is not there) is returned as not read, with a
    warning: the entry is published without it and a receiver compiles it. Paths that are
    not kernels of ``root`` in torch's layout are skipped with a warning: a receiver would
    refuse them anyway.
    """
    real_root = os.path.realpath(root)
    by_dir: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(set(paths)):
        rel = os.path.relpath(os.path.realpath(path), real_root)
        if not KERNEL_PATH.match(rel):
            log.warning("recipecache: kernel %s is outside torch's cache layout; not shipped", path)
            continue
        sub, name = rel.split("/")
        by_dir.setdefault(sub, []).append((name, path))
    files: list[KernelFile] = []
    missing: list[str] = []
    if not by_dir:
        return files, missing
    what = "torch's kernel cache directory"
    try:
        private_directory(root, what)
        root_fd = open_private_directory(root, what)
    except ConfigError as exc:
        log.warning("recipecache: kernels not shipped: %s", exc)
        return files, [path for group in by_dir.values() for _name, path in group]
    try:
        for sub, group in by_dir.items():
            try:
                dir_fd = open_private_directory(sub, f"the kernel directory in {root}:", dir_fd=root_fd)
            except ConfigError as exc:
                log.warning("recipecache: kernels not shipped: %s", exc)
                missing.extend(path for _name, path in group)
                continue
            try:
                for name, path in group:
                    try:
                        data = read_private_file_at(dir_fd, name, f"the kernel in {root}/{sub}:")
                    except ConfigError as exc:
                        log.warning("recipecache: kernel not shipped: %s", exc)
                        data = None
                    if data is None:
                        missing.append(path)
                    else:
                        files.append(KernelFile(f"{sub}/{name}", data))
            finally:
                os.close(dir_fd)
    finally:
        os.close(root_fd)
    return files, missing
