"""What each graph key is made of, recorded while the job runs so a miss can be explained after it.

torch names an FX graph's cache entry by a hash of ``FxGraphHashDetails``
(``torch/_inductor/codecache.py``, ``compiled_fx_graph_hash``), which also returns one
line per component, ``[<component hash>] <name>: <value>``: the graph code, each input's
metadata, the compile kwargs, torch's version, every inductor config entry, the thread
count kernels were specialised for, and more. Two ranks that compile the same graph
under different keys differ in some of these, and which ones is the answer to "why did
it not hit".

The torch integration hands every key it computes, with those lines, to :class:`KeyLog`,
which writes JSON lines (the event-log format, :mod:`recipecache.runs.events`) to
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
readers of ``*.jsonl`` event files (the simulator) never see these records.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ..env import process_rank
from .events import EventLog, Skipped, read_events

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
_ANY_INDEX = r"\1N"
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


def graph_identity(components: Mapping[str, tuple[str, str]]) -> str:
    """A digest of the graph components, device indices removed: equal for keys that should have matched.

    Components count by their hash, except those whose value names a device index (input
    metadata on ``cuda:1``): those count by their value with the index blanked.
    """
    parts = []
    for name in sorted(n for n in components if is_graph_component(n)):
        digest, value = components[name]
        parts.append(f"{name}={_DEVICE_INDEX.sub(_ANY_INDEX, value) if _DEVICE_INDEX.search(value) else digest}")
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


@dataclass(frozen=True)
class KeyInfo:
    """One key as a rank recorded it: its graph identity, label, and every component (graph and environment)."""

    key: str
    rank: int
    graph: str
    #: the compiled function and its input shapes
    name: str
    shapes: str
    #: name -> [hash, shown value]
    components: dict[str, list[str]] = field(default_factory=dict)
    #: facts about the recording process that are not part of the key (host, CPU)
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.name} {self.shapes}".strip()


def keys_dir(run_or_events_dir: str | os.PathLike[str]) -> Path:
    """``<run dir>/events/keys`` or ``<events dir>/keys``, whichever exists (the first if neither)."""
    base = Path(run_or_events_dir)
    for candidate in (base / "events" / KEYS_DIR, base / KEYS_DIR):
        if candidate.is_dir():
            return candidate
    return base / "events" / KEYS_DIR


def _components(value: Any) -> bool:
    """Whether ``value`` is a components map as :class:`KeyLog` writes it: ``name -> [hash, shown value]``."""
    return isinstance(value, dict) and all(
        isinstance(v, list) and len(v) == 2 and all(type(x) is str for x in v) for v in value.values()
    )


def _scalar(value: Any) -> bool:
    """A context value people can read: a string, a bool, None, or a number that prints and serialises."""
    return (
        value is None
        or type(value) in (str, bool)
        or (type(value) is int and abs(value) < 2**63)
        or (type(value) is float and math.isfinite(value))
    )


def _key_record(rec: dict[str, Any]) -> bool:
    """Whether a ``key_env`` or ``key`` record has every field :func:`load_keys` uses, of its type."""
    if type(rec.get("key")) is not str or not _components(rec.get("components", {})):
        return False
    if rec["event"] == "key_env":
        context = rec.get("context", {})
        return isinstance(context, dict) and all(_scalar(v) for v in context.values())
    return all(type(rec.get(name, "")) is str for name in ("graph", "env", "name", "shapes"))


def load_keys(
    run_or_events_dir: str | os.PathLike[str], *, since: float | None = None, skipped: Skipped | None = None
) -> dict[str, list[KeyInfo]]:
    """Every recorded key of a run, ``key -> [KeyInfo per recording rank]`` (a key can be met on several ranks).

    ``since`` (Unix time) skips records written before it (an earlier job in a reused run dir).
    Damaged records are left out, counted in ``skipped``.
    """
    directory = keys_dir(run_or_events_dir)
    if not directory.is_dir():
        return {}
    skipped = Skipped() if skipped is None else skipped
    #: (rank, env digest) -> (components, context): the context is the recording process's
    envs: dict[tuple[int, str], tuple[dict[str, list[str]], dict[str, Any]]] = {}
    keys: list[dict[str, Any]] = []
    for rec in read_events(directory, skipped=skipped):
        if (since is not None and rec["time"] < since) or rec["event"] not in ("key_env", "key"):
            continue
        if not _key_record(rec):
            skipped.records += 1
        elif rec["event"] == "key_env":
            envs[(rec["rank"], rec["key"])] = (rec.get("components", {}), rec.get("context", {}))
        else:
            keys.append(rec)
    out: dict[str, list[KeyInfo]] = {}
    for rec in keys:
        env_components, context = envs.get((rec["rank"], rec.get("env", "")), ({}, {}))
        components = {**env_components, **rec.get("components", {})}
        info = KeyInfo(
            rec["key"],
            rec["rank"],
            rec.get("graph") or rec["key"],
            rec.get("name", ""),
            rec.get("shapes", ""),
            components,
            dict(context),
        )
        known = out.setdefault(info.key, [])
        if all(k.rank != info.rank for k in known):
            known.append(info)
    return out


def differing(infos: Sequence[KeyInfo]) -> list[tuple[str, list[str]]]:
    """The components whose hash is not the same in every one of ``infos``: ``(name, [value per info])``.

    A component one key lacks is shown as ``(absent)``.
    """
    names = sorted(set().union(*(i.components for i in infos)))
    out = []
    for name in names:
        entries = [i.components.get(name) for i in infos]
        if len({None if e is None else e[0] for e in entries}) > 1:
            out.append((name, ["(absent)" if e is None else e[1] for e in entries]))
    return out


def torch_hash(key: str) -> str:
    """torch's own hash inside a store key (``torch3:cpu-<fingerprint>:pt2:fx-graph-v1::<hash>:c1``); the key itself otherwise."""
    inner = key.split("::", 1)[1] if "::" in key else key.rsplit(":", 1)[-1]
    return inner.split(":", 1)[0]


def short_key(key: str) -> str:
    """A store key as people read it: the first 10 characters of torch's hash."""
    return torch_hash(key)[:10]


def graph_label(key: str, keys: Mapping[str, Sequence[KeyInfo]]) -> str:
    """What people call the graph of ``key``: its recorded label (function and shapes), else ``graph <short key>``."""
    infos = keys.get(key)
    return infos[0].label if infos and infos[0].label else f"graph {short_key(key)}"
