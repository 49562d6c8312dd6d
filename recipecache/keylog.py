"""What each graph key is made of, recorded while the job runs so a miss can be explained after it.

torch names an FX graph's cache entry by a hash of ``FxGraphHashDetails``
(``torch/_inductor/codecache.py``, ``compiled_fx_graph_hash``), which also returns one
line per component, ``[<component hash>] <name>: <value>``: the graph code, each input's
metadata, the compile kwargs, torch's version, every inductor config entry, the thread
count kernels were specialised for, and more. Two ranks that compile the same graph
under different keys differ in some of these, and which ones is the answer to "why did
it not hit".

The torch integration hands every key it computes, with those lines, to :class:`KeyLog`,
which writes JSON lines (the event-log format, :mod:`recipecache.eventlog`) to
``<event log dir>/keys/keys-rank<R>-<pid>.jsonl``:

* ``{"event": "key_env", "key": <env digest>, "components": {...}, "context": {...}}``
  once per process and environment: the components that describe the environment
  (versions, config, thread count, ...), which are the same for every graph of a process,
  and ``context``: facts about the process that are not in torch's key (host, CPU);
* ``{"event": "key", "key": <store key>, "graph": <graph identity>, "env": <env digest>,
  "name": <function>, "shapes": <input shapes>, "label": <both>, "components": {...}}`` per key: the components
  that describe the graph itself.

Components are ``name -> [hash, value]``, values cut to :data:`MAX_VALUE_CHARS`. The
*graph identity* hashes the graph components with device indices taken out, so keys that
differ only in their environment (or in ``cuda:0`` vs ``cuda:1``) share it: those are
keys that should have matched. The ``keys/`` directory sits below the event logs, so
readers of ``*.jsonl`` event files (the simulator) never see these records;
:mod:`recipecache.runs.keyinfo` reads them back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from .env import process_rank
from .eventlog import EventLog

log = logging.getLogger(__name__)

#: the subdirectory of the event-log directory that holds key records
KEYS_DIR = "keys"
#: a component's value is cut to this many characters (its hash is kept whole)
MAX_VALUE_CHARS = 240
#: ``FxGraphHashDetails`` attributes that describe the graph rather than the process compiling it
GRAPH_ATTRIBUTES = frozenset(
    {
        "gm",
        "example_inputs",
        "fx_kwargs",
        "inputs_to_check",
        "user_defined_triton_source",
        "process_group",
        "device_mesh",
    }
)

_LINE = re.compile(r"\[([A-Za-z0-9]+)\] ([^:\n]+?): (.*)\Z", re.DOTALL)
#: device indices differ between ranks on purpose (each rank its own GPU); they do not make another graph
_DEVICE_INDEX = re.compile(r"(index=|cuda:|xpu:|hpu:)\d+")
_UNPRINTABLE = re.compile(r"[^\t\n\x20-\x7e]")

#: name -> (hash, value)
Components = dict[str, tuple[str, str]]

#: CPU features that decide which vector code torch's kernels are built for (``torch._inductor.cpu_vec_isa``)
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


@cache
def cpu_summary() -> dict[str, str]:
    """This host's CPU for a reader: architecture, model name and vector features (from ``/proc/cpuinfo``).

    Not what keys carry (that is ``torch_integration.host_cpu.fingerprint()``, a digest of
    what the compiler and torch make of the CPU, or the operator's override); reports show
    this beside the key so a reader sees which CPU a key was built on.
    """
    model, flags = platform.processor() or "unknown", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "model name":
                    model = value.strip()
                elif name in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {
        "machine": platform.machine(),
        "cpu_model": model,
        "cpu_features": " ".join(f for f in VECTOR_FLAGS if f in flags) or "none",
    }


def parse_details(lines: Iterable[str]) -> Components:
    """torch's hash-detail lines as ``name -> (hash, full value)``; lines of another shape are skipped."""
    out: Components = {}
    for line in lines:
        match = _LINE.match(line)
        if match is not None:
            digest, name, value = match.groups()
            out[name.strip()] = (digest, value)
    return out


def is_graph_component(name: str) -> bool:
    """Whether component ``name`` (e.g. ``example_inputs[0]``) describes the graph, not the process."""
    return name.split("[", 1)[0] in GRAPH_ATTRIBUTES


def without_device_index(value: str) -> str:
    """``value`` with every device index blanked (``cuda:1`` -> ``cuda:N``): what two ranks' values share when
    they differ only in the device each rank runs on."""
    return _DEVICE_INDEX.sub(r"\1N", value)


def graph_identity(components: Mapping[str, tuple[str, str]]) -> str:
    """A digest of the graph components, device indices removed: equal for keys that should have matched.

    Components count by their hash, except those whose value names a device index (input
    metadata on ``cuda:1``): those count by their value with the index blanked.
    """
    parts = []
    for name in sorted(n for n in components if is_graph_component(n)):
        digest, value = components[name]
        blanked = without_device_index(value)
        parts.append(f"{name}={blanked if blanked != value else digest}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _shown(value: str, digest: str) -> str:
    """A component value as people read it: printable, cut short; the hash stands in for binary values."""
    if _UNPRINTABLE.search(value):
        return f"<binary, hash {digest[:12]}>"
    value = " ".join(value.split())
    return value if len(value) <= MAX_VALUE_CHARS else value[: MAX_VALUE_CHARS - 3] + "..."


def _digest(components: Mapping[str, tuple[str, str]]) -> str:
    return hashlib.sha256("\n".join(f"{n}={d}" for n, (d, _v) in sorted(components.items())).encode()).hexdigest()[:16]


def _encode(components: Mapping[str, tuple[str, str]]) -> dict[str, list[str]]:
    return {name: [digest, _shown(value, digest)] for name, (digest, value) in components.items()}


class KeyLog:
    """Writes this process's key records; a no-op without a directory (no event log configured)."""

    def __init__(self, directory: str | os.PathLike[str] | None, *, rank: int | None = None) -> None:
        self.rank = process_rank() if rank is None else rank
        path = None if directory is None else Path(directory) / f"keys-rank{self.rank}-{os.getpid()}.jsonl"
        self._log = EventLog(path, rank=self.rank)
        self._envs: set[str] = set()
        #: keys already recorded: torch may look one key up several times in a process
        self._keys: set[str] = set()

    @classmethod
    def beside(cls, events: EventLog) -> KeyLog:
        """The key log that belongs with the event log ``events`` (in its directory's ``keys/``)."""
        return cls(None if events.path is None else events.path.parent / KEYS_DIR, rank=events.rank)

    @property
    def enabled(self) -> bool:
        return self._log.enabled

    def record(
        self,
        key: str,
        details: Sequence[str],
        *,
        name: str = "",
        shapes: str = "",
        context: Mapping[str, Any] | None = None,
        identity: str | None = None,
    ) -> str:
        """Record what ``key`` is made of (torch's hash-detail lines) and what it compiles; returns the graph identity.

        ``name`` is the compiled function, ``shapes`` its inputs, ``context`` facts about this
        process that are not in the key (recorded once per environment). ``identity``: the
        graph's rank-independent key where the integration computed one (a graph that uses
        this rank's process groups), since its components name this rank's groups.
        """
        components = parse_details(details)
        graph = {n: c for n, c in components.items() if is_graph_component(n)}
        environment = {n: c for n, c in components.items() if not is_graph_component(n)}
        identity = identity or graph_identity(graph)
        if not self.enabled or key in self._keys:
            return identity
        self._keys.add(key)
        env_digest = _digest(environment)
        if env_digest not in self._envs:
            self._envs.add(env_digest)
            self._log.record("key_env", env_digest, components=_encode(environment), context=dict(context or {}))
        self._log.record(
            "key",
            key,
            graph=identity,
            env=env_digest,
            name=name,
            shapes=shapes,
            label=f"{name} {shapes}".strip(),
            components=_encode(graph),
        )
        return identity

    def close(self) -> None:
        self._log.close()
