"""The precompiled artifact: one whole compiled function, and the source files it was traced from.

A precompiled artifact lets a fresh process skip dynamo: it carries torch's serialized
``AOTCompiledFunction`` (dynamo's bytecode and guards plus the AOTInductor libraries of
the forward and backward graphs), so loading it runs neither the tracer nor a compiler.
The bytecode was derived from the Python source of every file dynamo traced, so the
artifact also lists those files with the sha256 of their content: a process whose files
differ must not load it (a changed model is a miss, not a stale load), and it can tell
so before torch unpickles anything.

Framing is one msgpack map (never pickle)::

    {"format": "recipecache-precompiled/1", "entry": <bytes>, "compile_s": <float>,
     "sources": [[<path>, <sha256 32 bytes>], ...], "unsupported": <detail> | None}

``entry`` is torch's own serialization and stays opaque here; only torch unpickles it,
and only after the store verified the envelope and :meth:`SourceDigests.stale` found
every listed file unchanged. ``unsupported`` marks a function that cannot be
precompiled for these sources (``graph_break``: dynamo cannot trace it whole;
``dynamic_shapes``: its graph takes sizes as inputs): ranks that read it go straight
to the normal path instead of each tracing it again. This module does not import torch.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from .artifact import ArtifactError, decode

FORMAT = "recipecache-precompiled/1"


@dataclass(frozen=True)
class SourceFile:
    """A file dynamo traced: its path as the producer's code objects name it, and its content's sha256."""

    path: str
    sha256: bytes


@dataclass(frozen=True)
class Precompiled:
    """A packed function, or (``unsupported`` set, ``entry`` empty) the verdict that it cannot be one."""

    entry: bytes
    sources: tuple[SourceFile, ...]
    #: seconds the producer spent precompiling (what a hit saves)
    compile_s: float = 0.0
    #: why it cannot be precompiled (a fallback detail), for a verdict
    unsupported: str | None = None

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "format": FORMAT,
                "entry": self.entry,
                "compile_s": float(self.compile_s),
                "sources": [[s.path, s.sha256] for s in self.sources],
                "unsupported": self.unsupported,
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, blob: bytes | bytearray | memoryview) -> Precompiled:
        """Decode and check ``blob``; raises :class:`ArtifactError` for anything unexpected."""
        obj = decode(blob, FORMAT, "recipecache precompiled artifact")
        entry, compile_s, sources, unsupported = (obj.get(k) for k in ("entry", "compile_s", "sources", "unsupported"))
        if not isinstance(entry, bytes) or not isinstance(compile_s, float) or compile_s < 0:
            raise ArtifactError("precompiled entry or compile time malformed")
        if unsupported is not None and not isinstance(unsupported, str):
            raise ArtifactError("precompiled verdict malformed")
        if not isinstance(sources, list) or not all(
            isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and isinstance(s[1], bytes)
            and len(s[1]) == 32 for s in sources
        ):
            raise ArtifactError("precompiled source list malformed")
        return cls(entry, tuple(SourceFile(path, digest) for path, digest in sources), compile_s, unsupported)


class SourceDigests:
    """sha256 of source files, remembered per (path, size, mtime) so a process hashes each file once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int, int], bytes] = {}

    def digest(self, path: str) -> bytes:
        """The sha256 of the file at ``path``; raises OSError if it cannot be read."""
        st = os.stat(path)
        stamp = (path, st.st_size, st.st_mtime_ns)
        with self._lock:
            known = self._known.get(stamp)
        if known is not None:
            return known
        with open(path, "rb") as f:
            value = hashlib.sha256(f.read()).digest()
        with self._lock:
            self._known[stamp] = value
        return value

    def describe(self, paths: Iterable[str]) -> tuple[SourceFile, ...]:
        """The files at ``paths`` with their digests, sorted by path; raises OSError for an unreadable one."""
        return tuple(SourceFile(path, self.digest(path)) for path in sorted(set(paths)))

    def current(self, paths: Iterable[str]) -> tuple[SourceFile, ...]:
        """Like :meth:`describe`, but a file that cannot be read gets an all-zero digest instead of an error."""
        out = []
        for path in sorted(set(paths)):
            try:
                out.append(SourceFile(path, self.digest(path)))
            except OSError:
                out.append(SourceFile(path, bytes(32)))
        return tuple(out)

    def stale(self, sources: Iterable[SourceFile]) -> list[str]:
        """The paths among ``sources`` whose content here differs from the recorded one (or that are missing)."""
        changed = []
        for source in sources:
            try:
                if self.digest(source.path) != source.sha256:
                    changed.append(source.path)
            except OSError:
                changed.append(source.path)
        return changed


def versioned_key(key: str, sources: Iterable[SourceFile]) -> str:
    """``key`` for one set of source versions: where a precompile of those sources is also published."""
    return f"{key}:{sources_digest(sources)}"


def sources_digest(sources: Iterable[SourceFile]) -> str:
    """One hex digest naming a set of source versions (for keys)."""
    h = hashlib.sha256()
    for source in sorted(sources, key=lambda s: s.path):
        h.update(source.path.encode())
        h.update(b"\0")
        h.update(source.sha256)
    return h.hexdigest()
