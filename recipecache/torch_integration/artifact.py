"""The artifact one torch cache entry travels in: torch's entry plus the kernel files it needs.

torch's FX-graph entry holds the generated *source* of its C++ kernels, not the built
``.so`` files, so a remote "hit" on a fresh node would still run g++ for every kernel.
An FX artifact therefore carries the ``<cache_dir>/<xx>/<hash>.main.so`` files its graph
loads, and a hit installs them where torch looks before it loads the entry.

Framing is one msgpack map (never pickle)::

    {"format": "recipecache-torch/1", "kind": "fx"|"aot"|"pgo"|"isa", "entry": <bytes>,
     "compile_s": <float>, "files": [{"path": <str>, "sha256": <32 bytes>, "data": <bytes>}]}

``entry`` is torch's own value (JSON with a base64 pickle inside) and stays opaque here:
the store has verified the envelope's sha256/HMAC before these bytes arrive, and only
torch unpickles them. A file is accepted only with a relative path of the shape torch
itself writes (no ``/`` prefix, no ``..``, one two-character directory) and a matching
sha256, so even a verified artifact cannot write outside the kernel cache. This module
does not import torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from ..fsutil import write_atomic

log = logging.getLogger(__name__)

FORMAT = "recipecache-torch/1"
KINDS = ("fx", "aot", "pgo", "isa")
#: the only kernel paths torch writes under its cache dir: ``<2 chars>/<hash>[.main].so``
KERNEL_PATH = re.compile(r"^[a-z0-9]{2}/[a-z0-9]+(\.main)?\.so\Z")


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
class Artifact:
    kind: str
    entry: bytes
    files: tuple[KernelFile, ...] = ()
    #: seconds the producer spent compiling this entry (what a hit saves)
    compile_s: float = 0.0

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "format": FORMAT,
                "kind": self.kind,
                "entry": self.entry,
                "compile_s": float(self.compile_s),
                "files": [
                    {"path": f.path, "sha256": hashlib.sha256(f.data).digest(), "data": f.data} for f in self.files
                ],
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, blob: bytes, kind: str) -> Artifact:
        """Decode and check ``blob``; raises :class:`ArtifactError` for anything unexpected."""
        obj = decode(blob, FORMAT, "recipecache torch artifact")
        if obj.get("kind") != kind:
            raise ArtifactError(f"artifact kind {obj.get('kind')!r}, expected {kind!r}")
        entry, compile_s, files = obj.get("entry"), obj.get("compile_s"), obj.get("files")
        if not isinstance(entry, bytes) or not isinstance(compile_s, float) or compile_s < 0:
            raise ArtifactError("artifact entry or compile time malformed")
        if not isinstance(files, list):
            raise ArtifactError("artifact file list malformed")
        return cls(kind, entry, tuple(_checked_file(f) for f in files), compile_s)


def decode(blob: bytes | bytearray | memoryview, fmt: str, what: str) -> dict[str, Any]:
    """The msgpack map in ``blob`` if it says it is format ``fmt``; :class:`ArtifactError` otherwise."""
    try:
        obj = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ArtifactError(f"undecodable {what}: {exc}") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise ArtifactError(f"not a {what} (or another format version)")
    return obj


def _checked_file(item: Any) -> KernelFile:
    if not isinstance(item, dict):
        raise ArtifactError("artifact file record malformed")
    kernel = KernelFile(item.get("path"), item.get("data"))  # type: ignore[arg-type]  # checked in __post_init__
    if item.get("sha256") != hashlib.sha256(kernel.data).digest():
        raise ArtifactError(f"checksum mismatch for {kernel.path}")
    return kernel


def install(files: Iterable[KernelFile], root: Path) -> int:
    """Write each kernel under ``root`` unless it is already there; returns how many were written.

    A present file is kept: torch names kernels by a hash of their source and build
    command, so it is the same kernel, and it may already be loaded in this process.
    Each write is atomic, so a concurrent reader never loads half a library.
    """
    written = 0
    for kernel in files:
        target = root / kernel.path
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, kernel.data)
        written += 1
    return written


def collect(paths: Iterable[str], root: Path) -> tuple[list[KernelFile], list[str]]:
    """Read the built kernels at ``paths`` (absolute) as artifact files; also returns the missing ones.

    Paths that are not kernels of ``root`` in torch's layout are skipped with a warning:
    a receiver would refuse them anyway.
    """
    real_root = os.path.realpath(root)
    files: list[KernelFile] = []
    missing: list[str] = []
    for path in sorted(set(paths)):
        rel = os.path.relpath(os.path.realpath(path), real_root)
        if not KERNEL_PATH.match(rel):
            log.warning("recipecache: kernel %s is outside torch's cache layout; not shipped", path)
            continue
        try:
            files.append(KernelFile(rel, Path(path).read_bytes()))
        except FileNotFoundError:
            missing.append(path)
    return files, missing
