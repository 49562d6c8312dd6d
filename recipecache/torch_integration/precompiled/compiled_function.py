"""The precompiled artifact: one whole compiled function, and the source files it was traced from.

A precompiled artifact lets a fresh process skip dynamo: it carries torch's serialized
``AOTCompiledFunction`` (dynamo's bytecode and guards plus inductor's bundled forward and
backward graphs) and the kernel libraries those graphs load (torch's entry holds their
source only, so a receiver would rebuild them), so loading it runs neither the tracer nor
a compiler.
The bytecode was derived from the code of every function dynamo traced, so the artifact
also lists their files, each with a digest of the code the producer ran from it
(:mod:`.code_digest`: its code objects and the globals the traced code reads, not the file on
disk):
a process that runs other code must not load it (a changed model is a miss, not a stale
load), and it can tell so before torch unpickles anything.

Framing is one msgpack map (never pickle)::

    {"format": "recipecache-precompiled/4", "entry": <bytes>, "compile_s": <float>,
     "sources": [[<path>, <code digest, 32 bytes>, [<global name>, ...]], ...],
     "files": [{"path": "<xx>/<name>.so", "data": <bytes>}, ...], "dynamic": <bool>,
     "pins": [[<guard source>, <value as traced>, <per call>], ...], "unsupported": <detail> | None,
     "groups": [[<process group name>, <its role>], ...], "modules": [[<global name>, <module name>], ...]}

``entry`` is torch's own serialization and stays opaque here; only torch unpickles it,
and only after the store verified the envelope and :func:`.code_digest.stale` found
this process running the same code from every listed file. ``unsupported`` marks a function that cannot be
precompiled for these sources (``graph_break``: dynamo cannot trace it whole): ranks
that read it go straight to the normal path instead of each tracing it again.
``dynamic``: the graph takes sizes as inputs (its guards serve many sizes), for the metrics.
``pins``: the values the traced code read besides its inputs, as the trace saw them
(:mod:`.traced_values`), which a loader compares with its own before it serves a call.
``groups``: the producer's process groups its compiled code runs collectives on, with their roles
(:mod:`..rank_binding`): torch bakes group names into the code, so a rank serves it only where those
are its own groups of those roles, and otherwise looks under the key naming its own.
``modules``: the globals dynamo installed for modules the bytecode loads (``___module_collections_<id>_c0``,
named by the producer's object ids: :func:`.traced_values.modules_installed`), which a loader binds first;
``scopes`` likewise for the namespaces of functions that belong to no module (``___unnamed_scope_<id>_c0``, a
namedtuple's ``__new__``: :func:`.traced_values.scopes_installed`), named by the class and function that hold them.
This module does not import torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from ..artifact import ArtifactError, KernelFile, checked_file, decode

#: 4: torch's default inductor backend with the kernel libraries beside it, not AOTInductor (its
#: artifacts, and the ``dynamic_shapes`` verdicts format 3 published, are retired with the key).
#: 5: the values the trace read (``pins``); format 4 artifacts served them unchecked.
#: 6: the process groups the code names (``groups``); format 5 had no functions with collectives (their
#: operators were unchecked values: verdicts, which format 6 retires).
#: 7: a closure dynamo calls pinned by its code, DTensor placements by value, dicts' items by key position
#: (format 6 left a module parallelised with ``parallelize_module`` an ``unchecked_value`` verdict: its hooks)
#: 8: the module globals dynamo installs (``modules``; format 7's artifacts of such code, diffusers' UNet, failed to
#: load anywhere: "Missing required external references")
FORMAT = "recipecache-precompiled/9"
#: what ``recipecache ls`` calls a precompiled artifact (the ``kind`` of its envelope meta), and the kind the
#: store counts its lookups and puts under
KIND_NAME = "precompiled"


@dataclass(frozen=True)
class SourceFile:
    """A file dynamo traced: its path as the producer's code objects name it, and the digest of the code
    the producer ran from it (:mod:`.code_digest`)."""

    path: str
    digest: bytes
    #: the globals the traced code of this file reads, whose values the digest covers
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pin:
    """A value the traced code read that is not in its code (:mod:`.traced_values`), as the trace saw it."""

    #: dynamo's name of the guarded value (``G['cfg'].SCALE``, ``L['k']``)
    source: str
    #: its description (:func:`.traced_values.describe`), equal in two processes holding equal values
    value: str
    #: torch's loaded guards do not check it: the tier checks it before every call, not only at load
    per_call: bool


@dataclass(frozen=True)
class Precompiled:
    """A packed function, or (``unsupported`` set, ``entry`` empty) the verdict that it cannot be one."""

    entry: bytes
    sources: tuple[SourceFile, ...]
    #: seconds the producer spent precompiling (what a hit saves)
    compile_s: float = 0.0
    #: why it cannot be precompiled (a fallback detail), for a verdict
    unsupported: str | None = None
    #: the kernel libraries the graphs load, installed before torch deserializes ``entry``
    files: tuple[KernelFile, ...] = ()
    #: the graph takes sizes as inputs (torch's dynamic graph)
    dynamic: bool = False
    #: the values the traced code read besides its inputs, as the trace saw them
    pins: tuple[Pin, ...] = ()
    #: (name, role) of each process group of the producer's that the compiled code runs collectives on
    groups: tuple[tuple[str, str], ...] = ()
    #: (global name, module name) of each module global dynamo installed that the bytecode reads
    modules: tuple[tuple[str, str], ...] = ()
    #: (global name, ``<module>:<class>.<function>``) of each unnamed scope dynamo installed (a function's globals
    #: that belong to no module), bound by a loader to its own namespace of that function
    scopes: tuple[tuple[str, str], ...] = ()

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "format": FORMAT,
                "entry": self.entry,
                "compile_s": float(self.compile_s),
                "sources": [[s.path, s.digest, list(s.names)] for s in self.sources],
                "unsupported": self.unsupported,
                "files": [{"path": f.path, "data": f.data} for f in self.files],
                "dynamic": self.dynamic,
                "pins": [[p.source, p.value, p.per_call] for p in self.pins],
                "groups": [list(g) for g in self.groups],
                "modules": [list(m) for m in self.modules],
                "scopes": [list(m) for m in self.scopes],
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, blob: bytes | bytearray | memoryview) -> Precompiled:
        """Decode and check ``blob``; raises :class:`ArtifactError` for anything unexpected."""
        obj = decode(blob, FORMAT, "recipecache precompiled artifact")
        entry, compile_s, sources, unsupported, files, dynamic, pins, groups, modules, scopes = (
            obj.get(k)
            for k in (
                "entry",
                "compile_s",
                "sources",
                "unsupported",
                "files",
                "dynamic",
                "pins",
                "groups",
                "modules",
                "scopes",
            )
        )
        if not isinstance(entry, bytes) or not isinstance(compile_s, float) or compile_s < 0:
            raise ArtifactError("precompiled entry or compile time malformed")
        if unsupported is not None and not isinstance(unsupported, str):
            raise ArtifactError("precompiled verdict malformed")
        if not isinstance(files, list) or not isinstance(dynamic, bool):
            raise ArtifactError("precompiled kernel list or shape flag malformed")
        if not isinstance(sources, list) or not all(
            isinstance(s, list)
            and len(s) == 3
            and isinstance(s[0], str)
            and isinstance(s[1], bytes)
            and len(s[1]) == 32
            and isinstance(s[2], list)
            and all(isinstance(n, str) for n in s[2])
            for s in sources
        ):
            raise ArtifactError("precompiled source list malformed")
        if not isinstance(pins, list) or not all(
            isinstance(p, list)
            and len(p) == 3
            and isinstance(p[0], str)
            and isinstance(p[1], str)
            and isinstance(p[2], bool)
            for p in pins
        ):
            raise ArtifactError("precompiled value pins malformed")
        return cls(
            entry,
            tuple(SourceFile(path, digest, tuple(names)) for path, digest, names in sources),
            compile_s,
            unsupported,
            tuple(checked_file(f) for f in files),
            dynamic,
            tuple(Pin(*p) for p in pins),
            _pairs(groups, "process groups"),
            _pairs(modules, "module globals"),
            _pairs(scopes, "unnamed scopes"),
        )


def _pairs(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    """A list of pairs of non-empty strings, as a tuple; ArtifactError for anything else."""
    if not isinstance(value, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) and part for part in pair)
        for pair in value
    ):
        raise ArtifactError(f"precompiled {what} malformed")
    return tuple((first, second) for first, second in value)


def versioned_key(key: str, sources: Iterable[SourceFile]) -> str:
    """``key`` for one set of source versions: where a precompile of those sources is also published."""
    return f"{key}:{sources_digest(sources)}"


def guard_variant_key(key: str, n: int) -> str:
    """Where the ``n``-th artifact of ``key`` lives whose guards serve what the ones before it reject (0: ``key``)."""
    return key if n == 0 else f"{key}:guards:{n}"


def grouped_key(key: str, local: dict[str, str]) -> str:
    """``key`` for code naming, for each role, the group ``local`` gives (role -> group name): where a rank whose
    groups the artifact under ``key`` does not name finds (or publishes) one naming its own."""
    h = hashlib.sha256(repr(sorted(local.items())).encode())
    return f"{key}:groups:{h.hexdigest()}"


def sources_digest(sources: Iterable[SourceFile]) -> str:
    """One hex digest naming a set of source versions (for keys)."""
    h = hashlib.sha256()
    for source in sorted(sources, key=lambda s: s.path):
        h.update(source.path.encode())
        h.update(b"\0")
        h.update(source.digest)
    return h.hexdigest()
