"""Reading back the key records :class:`recipecache.keylog.KeyLog` wrote, for ``recipecache explain`` and reports.

The format and why it exists are in :mod:`recipecache.keylog`. Readers meet run directories that were copied,
cut or planted: :func:`load_keys` keeps only well-formed records and counts the rest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..keylog import KEYS_DIR
from .events import Skipped, read_events


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
