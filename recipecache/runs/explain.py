"""Why graphs were compiled more than once: a job's event logs and key records, read after the job.

recipecache exists so that each graph is compiled once per job. :func:`analyse` reads a
run directory (``<run dir>/events``, :mod:`recipecache.runs.events`, and the key records of
:mod:`recipecache.runs.keyinfo`) and lists

* **duplicate compiles**: every graph compiled by more than one rank, each compile with
  the reason it was not served from the store when the reason is known;
* **misses others hit**: every rank that compiled a graph other ranks had already loaded
  from the store (or loaded under another key), with the reason.

A graph is known by its *graph identity* (:func:`recipecache.runs.keyinfo.graph_identity`), so
two ranks compiling the same graph under different keys (a different thread count, say)
count as a duplicate whose reason is "different key" and the components that differ.
:func:`explain` puts those components side by side for every graph met under more than
one key, from one or several run directories (a job that missed what an earlier job
built).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..keylog import without_device_index
from ..reasons import REFUSED, Reason
from .events import Skipped, read_events
from .keyinfo import KeyInfo, differing, graph_label, load_keys, short_key, torch_hash

#: why a rank compiled a graph it could have loaded, by the reason its events name
_REASON_TEXT = {
    Reason.WAIT_TIMEOUT: "waited past the deadline (wait_timeout)",
    Reason.GUARD_REJECTED: "torch's guards rejected the stored entry (guard_rejected)",
    Reason.BACKEND_DOWN: "store down (backend_down)",
    Reason.BACKEND_SLOW: "store too slow (backend_slow)",
    Reason.BACKEND_FULL: "store full (backend_full)",
    Reason.BACKEND_ERROR: "store failed (backend_error)",
}


@dataclass(frozen=True)
class Compile:
    """One compile of a graph by one rank; ``reason`` says why it was not a hit (None for the first one)."""

    rank: int
    key: str
    start: float
    seconds: float
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "key": self.key,
            "start": self.start,
            "seconds": round(self.seconds, 3),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Duplicate:
    """A graph compiled by more than one rank."""

    graph: str
    label: str
    compiles: tuple[Compile, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "label": self.label, "compiles": [c.to_dict() for c in self.compiles]}


@dataclass(frozen=True)
class Missed:
    """A rank that compiled a graph other ranks had loaded from the store."""

    rank: int
    graph: str
    label: str
    key: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "graph": self.graph, "label": self.label, "key": self.key, "reason": self.reason}


@dataclass
class Analysis:
    duplicates: list[Duplicate] = field(default_factory=list)
    missed: list[Missed] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"duplicates": [d.to_dict() for d in self.duplicates], "missed": [m.to_dict() for m in self.missed]}


def events_dir(run_dir: str | os.PathLike[str]) -> Path:
    """``<run dir>/events`` when it exists, else ``run_dir`` itself (given the events directory)."""
    base = Path(run_dir)
    return base / "events" if (base / "events").is_dir() else base


def load_events(
    run_dir: str | os.PathLike[str], *, since: float | None = None, skipped: Skipped | None = None
) -> list[dict[str, Any]]:
    """A run's event records in time order; ``since`` (Unix time) drops those of earlier jobs.

    Damaged records and files that are not regular files are left out, counted in ``skipped``.
    """
    directory = events_dir(run_dir)
    if not directory.is_dir():
        raise ConfigError(f"{run_dir} holds no event logs (expected {directory}/*.jsonl)")
    records = [r for r in read_events(directory, skipped=skipped) if since is None or r["time"] >= since]
    return sorted(records, key=lambda r: r["time"])


def with_follower_hits(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` plus a ``hit`` at the end of each wait that ended in the other rank's artifact.

    The store logs a follower's load as its ``wait`` only; a wait that ended otherwise is
    followed, for the same rank and key, by a ``compile_start`` (the lease came free) or a
    ``fallback`` (the deadline passed).
    """
    ended_otherwise = {(r["rank"], r.get("key")) for r in records if r["event"] in ("compile_start", "fallback")}
    loads = [
        {**r, "event": "hit", "duration": 0.0, "after_wait": True}
        for r in records
        if r["event"] == "wait" and (r["rank"], r.get("key")) not in ended_otherwise
    ]
    return sorted([*records, *loads], key=lambda r: float(r["time"]))


class _Graphs:
    """Store keys grouped by graph identity, with a label per graph (from the key records)."""

    def __init__(self, keys: Mapping[str, Sequence[KeyInfo]]) -> None:
        self.keys = keys

    def identity(self, key: str) -> str:
        infos = self.keys.get(key)
        return infos[0].graph if infos else key

    def label(self, key: str) -> str:
        return graph_label(key, self.keys)

    def key_difference(self, key: str, other: str) -> str:
        """Why ``key`` is not ``other``: the names of the components that differ, if both were recorded."""
        mine, theirs = self.keys.get(key), self.keys.get(other)
        if not mine or not theirs:
            return f"different key ({short_key(key)} vs {short_key(other)})"
        differences = differing([mine[0], theirs[0]])
        named = named_differences(differences)
        if named:
            return "different key: " + "; ".join(named)
        names = [name for name, _values in differences]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"different key: {shown or 'components not recorded'}"


def _rank_reason(events: Iterable[dict[str, Any]]) -> str | None:
    """What a rank's own events for one key say about why it compiled (refusal, fallback, takeover)."""
    found: str | None = None
    for rec in events:
        reason = rec.get("reason")
        if rec["event"] == "fallback" and reason:
            return _REASON_TEXT.get(reason, f"compiled without the store ({reason})")
        if rec["event"] == "miss" and reason in REFUSED:
            found = f"refused: {reason}"
        elif rec["event"] == "miss" and reason == Reason.GUARD_REJECTED:
            found = _REASON_TEXT[Reason.GUARD_REJECTED]
        elif rec["event"] == "takeover" and found is None:
            found = "took over the lease of a rank that stopped renewing it"
    return found


def analyse(records: Sequence[dict[str, Any]], keys: Mapping[str, Sequence[KeyInfo]]) -> Analysis:
    """Duplicate compiles and misses of graphs others hit, from a run's events and key records."""
    graphs = _Graphs(keys)
    records = with_follower_hits(records)
    by_rank_key: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    compiles: dict[str, list[Compile]] = defaultdict(list)
    hits: dict[str, list[tuple[float, int, str]]] = defaultdict(list)  # graph -> (time, rank, key)
    for rec in records:
        key = rec.get("key")
        if not isinstance(key, str) or not key:
            continue
        by_rank_key[(rec["rank"], key)].append(rec)
        if rec["event"] == "compile":
            seconds = float(rec.get("duration") or 0.0)
            compiles[graphs.identity(key)].append(Compile(rec["rank"], key, rec["time"] - seconds, seconds))
        elif rec["event"] == "hit":
            hits[graphs.identity(key)].append((rec["time"], rec["rank"], key))

    def reason(c: Compile, first: Compile) -> str:
        if c.key != first.key:
            return graphs.key_difference(c.key, first.key)
        return _rank_reason(by_rank_key[(c.rank, c.key)]) or "unknown (the store was not asked, or the lease was lost)"

    analysis = Analysis()
    for graph, done in compiles.items():
        done = sorted(done, key=lambda c: c.start)
        first = done[0]
        if len({c.rank for c in done}) > 1:
            explained = (first, *(Compile(c.rank, c.key, c.start, c.seconds, reason(c, first)) for c in done[1:]))
            analysis.duplicates.append(Duplicate(graph, graphs.label(first.key), explained))
        for c in done:
            # hits by other ranks before this compile began, or of another key: the graph was there to load
            loaded = [(t, r, k) for t, r, k in hits.get(graph, ()) if r != c.rank and (t < c.start or k != c.key)]
            if loaded:
                other = loaded[0][2]
                why = graphs.key_difference(c.key, other) if other != c.key else reason(c, Compile(-1, other, 0.0, 0.0))
                analysis.missed.append(Missed(c.rank, graph, graphs.label(c.key), c.key, why))
    analysis.duplicates.sort(key=lambda d: d.compiles[0].start)
    analysis.missed.sort(key=lambda m: (m.rank, m.label))
    return analysis


def analyse_run(
    run_dir: str | os.PathLike[str], *, since: float | None = None, skipped: Skipped | None = None
) -> Analysis:
    """:func:`analyse` on a run directory (``since`` drops the records of earlier jobs in a reused one).

    What the readers left out (damaged records, special files) is counted in ``skipped``.
    """
    return analyse(load_events(run_dir, since=since, skipped=skipped), load_keys(run_dir, since=since, skipped=skipped))


# -- explain ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyGroup:
    """One graph met under several keys: the keys (with the ranks that used each) and what differs."""

    graph: str
    label: str
    keys: tuple[tuple[str, tuple[int, ...]], ...]
    differences: tuple[tuple[str, tuple[str, ...]], ...]
    context: tuple[dict[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "label": self.label,
            "keys": [{"key": k, "ranks": list(r)} for k, r in self.keys],
            "differences": [{"component": n, "values": list(v)} for n, v in self.differences],
            "context": list(self.context),
        }


@dataclass
class Explanation:
    """What :func:`explain` found: the graphs met under several keys, and what it could not look at."""

    groups: list[KeyGroup]
    #: run directories with event logs but no key records: their ranks asked the store for no graph
    #: (torch's local cache served every one, or nothing was compiled), so no key can differ there
    without_keys: list[str] = field(default_factory=list)


def explain(
    run_dirs: Sequence[str | os.PathLike[str]], *, key: str | None = None, skipped: Skipped | None = None
) -> Explanation:
    """Every graph recorded under more than one key in ``run_dirs``, with the components that differ.

    ``key`` (a store key, or the start of torch's hash as reports print it) keeps only
    the graph of that key. Raises ConfigError for a directory that holds neither key
    records nor event logs (no run directory), or if ``key`` was never recorded. Damaged
    records are left out, counted in ``skipped``.
    """
    infos: dict[str, list[KeyInfo]] = defaultdict(list)
    without_keys: list[str] = []
    for run_dir in run_dirs:
        found = load_keys(run_dir, skipped=skipped)
        if not found:
            if not events_dir(run_dir).is_dir():
                raise ConfigError(
                    f"{run_dir} holds no key records (events/keys/*.jsonl); was the job run with "
                    f"recipecache-run or RECIPECACHE_EVENT_LOG set?"
                )
            without_keys.append(str(run_dir))
        for k, recorded in found.items():
            infos[k].extend(i for i in recorded if all(j.rank != i.rank for j in infos[k]))
    if key is not None:
        matching = [k for k in infos if k == key or torch_hash(k).startswith(key)]
        if not matching:
            raise ConfigError(f"key {key!r} was not recorded in {', '.join(map(str, run_dirs))}")
        wanted = {infos[matching[0]][0].graph}
    else:
        wanted = None
    by_graph: dict[str, list[str]] = defaultdict(list)
    for k, recorded in infos.items():
        by_graph[recorded[0].graph].append(k)
    groups = []
    for graph, group_keys in by_graph.items():
        if len(group_keys) < 2 or (wanted is not None and graph not in wanted):
            continue
        group_keys.sort(key=lambda k: min(i.rank for i in infos[k]))
        representatives = [infos[k][0] for k in group_keys]
        groups.append(
            KeyGroup(
                graph=graph,
                label=next((i.label for i in representatives if i.label), f"graph {graph}"),
                keys=tuple((k, tuple(sorted(i.rank for i in infos[k]))) for k in group_keys),
                differences=tuple((name, tuple(values)) for name, values in differing(representatives)),
                context=tuple(i.context for i in representatives),
            )
        )
    return Explanation(sorted(groups, key=lambda g: g.label), without_keys)


def format_explanation(found: Explanation) -> str:
    """:func:`format_groups`, after a line for each run directory whose ranks recorded no key."""
    notes = [
        f"{run_dir} holds no key records: its ranks asked the store for no graph (torch's local cache "
        f"served every one, or nothing was compiled), so no key could differ there"
        for run_dir in found.without_keys
    ]
    if notes and not found.groups:
        return "\n".join(notes)
    return "\n".join([*notes, format_groups(found.groups)])


_GROUP_NAME = re.compile(r"^('[^']*')")
_MESH = re.compile(r"^rank (\d+), coordinate (\([^)]*\))")


def named_differences(differences: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """What differs between the keys, in the words of a distributed job: ``process group '3' vs '4'``,
    ``device mesh coordinate (0,) vs (1,)``, ``device ordinal``; empty if none of these.

    The components come from the key records: ``process_group[i]`` and ``device_mesh[i]``
    are what the integration records of a graph that uses the rank's process groups; a
    device ordinal is a value that is equal once ``cuda:N`` / ``index=N`` are blanked.
    """
    out: list[str] = []
    for name, values in differences:
        kind = name.split("[", 1)[0]
        if kind == "process_group":
            shown = [m.group(1) if (m := _GROUP_NAME.match(v)) else v for v in values]
            out.append("process group " + " vs ".join(dict.fromkeys(shown)))
        elif kind == "device_mesh":
            found = [m for v in values if (m := _MESH.match(v))]
            if len(found) == len(values):
                coordinates = dict.fromkeys(m.group(2) for m in found)
                if len(coordinates) > 1:
                    out.append("device mesh coordinate " + " vs ".join(coordinates))
                out.append("rank " + " vs ".join(dict.fromkeys(m.group(1) for m in found)))
        elif len({without_device_index(v) for v in values}) == 1 and len(set(values)) > 1:
            out.append("device ordinal")
    if any(n.startswith("device_mesh[") for n, _v in differences):
        out.append("torch pickles the rank's device mesh into the key (with its group names, rank and coordinate)")
    return list(dict.fromkeys(out))


def format_groups(groups: Sequence[KeyGroup], *, width: int = 38) -> str:
    """The groups side by side, one column per key, for people."""
    if not groups:
        return "no graph was compiled under more than one key: every rank computed the same keys"
    lines: list[str] = []
    for group in groups:
        lines.append(f"graph {group.label} (identity {group.graph}): {len(group.keys)} keys")
        name_width = max([len("component"), *(len(n) for n, _v in group.differences)]) if group.differences else 9

        def row(name: str, values: Iterable[str]) -> str:
            cells = [v if len(v) <= width else v[: width - 3] + "..." for v in values]
            return "  " + f"{name:<{name_width}}  " + "  ".join(f"{c:<{width}}" for c in cells).rstrip()  # noqa: B023 - called within this iteration only

        lines.append(row("key", (f"{short_key(k)} (rank {', '.join(map(str, r))})" for k, r in group.keys)))
        named = named_differences(group.differences)
        if named:
            lines.append("  differs in: " + "; ".join(named))
        for name, values in group.differences:
            lines.append(row(name, values))
        context_names = sorted({n for c in group.context for n in c if len({str(x.get(n)) for x in group.context}) > 1})
        for name in context_names:
            lines.append(row(f"({name})", (str(c.get(name, "?")) for c in group.context)))
        if not group.differences and not named:
            lines.append("  (the recorded components are equal; the keys differ in something torch does not list)")
        lines.append("")
    return "\n".join(lines).rstrip()
