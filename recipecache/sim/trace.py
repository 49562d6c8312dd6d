"""Replay of recorded event logs (``RECIPECACHE_EVENT_LOG``, format in ``recipecache.runs.events``).

Each rank's records, in time order, are cut into steps:

* with ``step`` events (any in the trace): the store events between two ``step`` events
  belong to the later one, which names the step (its ``step`` field aligns ranks; a
  field that does not increase is taken as the next index, e.g. a counter reset per
  epoch). Store events after the last ``step`` event form one more step.
* without: each *meeting* is a step, a meeting being a run of records of one key (a
  ``miss`` then ``compile`` then ``put`` is one meeting), and ranks align by ordinal.

Costs come from the trace where it has them: a key's compile time is the mean of its
``compile`` durations (keys never compiled in the trace take the median of those that
were, else ``Costs.compile_s``); a fetch is the median ``hit`` or ``switch`` duration (else
``Costs.fetch_s``).

A run with ``--no-stall`` (policy ``no_stall``) adds records: ``eager`` (one per call of a
graph run without inductor, ``duration`` = that call), ``switch`` (the process loaded the
landed artifact of ``key``, ``duration`` = the load) and its background compiles'
``compile_start``/``compile`` with ``"behind": true``. Background records price the
key's compile but are no time of the rank's steps, so they neither cut nor cover steps.
An eager call is the step's compute, run slower: a step with one is priced at what it
would cost compiled, its estimate over the eager slowdown, which the trace gives as its
steps with only eager calls over its steps with no store record (``Costs.eager_slowdown``
when it lacks either). Dynamo's trace has no record: it stays inside its step's compute
(``Workload.trace_s`` is 0). The calls the replay knows (``Workload.calls``) are the keys
each rank's steps have records of: a key a rank met, ran eager or switched in that step.

Compute per step: on one rank, the step's span (from the previous step's end, or the
rank's first record) minus the time covered by its store events. A rank that finished
early also waited in the collective for the slowest one, which the log cannot see, so
the step's compute is the *least* of the ranks' estimates: the slowest rank's, which
had no collective wait. Every rank gets that figure (see :class:`Workload`).

``ranks`` larger than the trace's replays trace rank ``r mod n`` on rank ``r``, which
predicts the same job at a larger scale.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..eventlog import EVENT_KINDS
from ..runs.events import read_events
from .model import Scenario, Workload, calls_by_step

log = logging.getLogger(__name__)

Record = dict[str, Any]
#: one rank's step: (index, begin, end, the store records in it)
Segment = tuple[int, float, float, list[Record]]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _usable(rec: Record) -> bool:
    """A store event the replay can place: a kind it knows (not e.g. an HPU agent's), numbers, a key."""
    return (
        rec["event"] in EVENT_KINDS
        and _is_number(rec.get("time"))
        and isinstance(rec.get("rank"), int)
        and _is_number(rec.get("duration", 0.0))
        and (rec["event"] == "step" or isinstance(rec.get("key"), str))
    )


def _start(rec: Record) -> float:
    return float(rec["time"]) - float(rec.get("duration", 0.0))


def _covered(begin: float, end: float, records: Iterable[Record]) -> float:
    """Seconds of [begin, end] inside at least one record's span (spans may overlap)."""
    total, reach = 0.0, begin
    for lo, hi in sorted((max(_start(r), begin), min(float(r["time"]), end)) for r in records):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def _by_step_events(records: list[Record]) -> list[Segment]:
    out: list[Segment] = []
    begin, pending, last = _start(records[0]), [], -1
    for rec in records:
        if rec["event"] != "step":
            pending.append(rec)
            continue
        named = rec.get("step")
        index = named if isinstance(named, int) and named > last else last + 1
        out.append((index, begin, float(rec["time"]), pending))
        begin, pending, last = float(rec["time"]), [], index
    if pending:
        out.append((last + 1, begin, max(float(r["time"]) for r in pending), pending))
    return out


def _by_meetings(records: list[Record]) -> list[Segment]:
    runs: list[list[Record]] = []
    for rec in records:
        if runs and runs[-1][-1]["key"] == rec["key"]:
            runs[-1].append(rec)
        else:
            runs.append([rec])
    ends = [_start(run[0]) for run in runs[1:]] + [max(float(r["time"]) for r in runs[-1])]
    return [(k, _start(run[0]), end, run) for k, (run, end) in enumerate(zip(runs, ends, strict=True))]


def _background(rec: Record) -> bool:
    """A record of a compile behind the steps (``--no-stall``): no time of the rank's own."""
    return rec.get("behind") is True


@dataclass(frozen=True)
class _Step:
    """One rank's step: its index, the keys it has records of (in order first met), its
    compute estimate (span minus store time; eager calls are compute), and the kinds of
    its records."""

    index: int
    keys: list[str]
    compute_s: float
    kinds: frozenset[str]

    @property
    def eager(self) -> bool:
        return "eager" in self.kinds


def _rank_steps(records: list[Record], by_steps: bool) -> list[_Step]:
    segments = _by_step_events(records) if by_steps else _by_meetings(records)
    return [
        _Step(
            index,
            list(dict.fromkeys(r["key"] for r in recs)),
            max(0.0, end - begin - _covered(begin, end, [r for r in recs if r["event"] != "eager"])),
            frozenset(r["event"] for r in recs),
        )
        for index, begin, end, recs in segments
    ]


def _eager_slowdown(steps: Iterable[_Step], default: float) -> float:
    """The median compute of steps whose records are all eager calls over that of steps
    without records (``default`` when the trace lacks either, never below 1)."""
    eager = [s.compute_s for s in steps if s.kinds == {"eager"}]
    plain = [s.compute_s for s in steps if not s.kinds]
    if not eager or not plain or statistics.median(plain) <= 0:
        return default
    return max(1.0, statistics.median(eager) / statistics.median(plain))


def _median_or(values: list[float], default: float) -> float:
    return statistics.median(values) if values else default


def _read(path: Path) -> tuple[list[Record], list[list[_Step]], bool]:
    """The usable records under ``path``, each trace rank's steps (by rank), and whether
    steps come from step events."""
    if not path.is_dir():
        raise ConfigError(f"trace directory {path} does not exist")
    records = [r for r in read_events(path) if _usable(r)]
    foreground = [r for r in records if not _background(r)]
    if not foreground:
        raise ConfigError(f"no usable events in {path}/*.jsonl")
    by_steps = any(r["event"] == "step" for r in foreground)
    by_rank: dict[int, list[Record]] = defaultdict(list)
    for rec in sorted(foreground, key=lambda r: float(r["time"])):
        by_rank[rec["rank"]].append(rec)
    return records, [_rank_steps(by_rank[r], by_steps) for r in sorted(by_rank)], by_steps


def recorded_eager_steps(path: str | Path) -> int:
    """The (rank, step) pairs of a recorded run that ran a graph without inductor, cut into
    steps as the replay cuts them: what :attr:`Report.eager_steps` predicts."""
    _, steps_of, _ = _read(Path(path))
    return sum(step.eager for rank_steps in steps_of for step in rank_steps)


def _replicate(rows: list[tuple[int, int, int, int]], ranks: int, trace_ranks: int) -> tuple[np.ndarray, ...]:
    """(step, trace rank position, order, shape) rows as (step, rank, shape) arrays on ``ranks``
    ranks, rank ``r`` replaying trace rank ``r mod trace_ranks``, sorted by step, rank, order."""
    src = np.array(rows, dtype=np.int64).reshape(-1, 4)
    parts = [src[src[:, 1] == r % trace_ranks] for r in range(ranks)]
    out = np.concatenate(parts)
    rank = np.repeat(np.arange(ranks, dtype=np.int64), [len(p) for p in parts])
    order = np.lexsort((out[:, 2], rank, out[:, 0]))
    return out[order, 0], rank[order], out[order, 3]


def trace_workload(scenario: Scenario) -> Workload:
    """Turn the event logs under ``scenario.trace`` into first meetings, calls and costs."""
    path = Path(scenario.trace or "")
    records, steps_of, by_steps = _read(path)
    slowdown = _eager_slowdown((step for rank_steps in steps_of for step in rank_steps), scenario.costs.eager_slowdown)

    indices = sorted({step.index for rank_steps in steps_of for step in rank_steps})
    dense = {index: d for d, index in enumerate(indices)}
    compute = np.full(len(indices), math.inf)
    met: list[tuple[int, int, int, str]] = []  # (step, trace rank position, order, key): first meetings
    called: list[tuple[int, int, int, str]] = []  # the same for every call the trace shows
    for pos, rank_steps in enumerate(steps_of):
        seen: set[str] = set()
        for rank_step in rank_steps:
            d = dense[rank_step.index]
            compute[d] = min(compute[d], rank_step.compute_s / slowdown if rank_step.eager else rank_step.compute_s)
            called += [(d, pos, order, key) for order, key in enumerate(rank_step.keys)]
            met += [(d, pos, order, key) for order, key in enumerate(rank_step.keys) if key not in seen]
            seen.update(rank_step.keys)
    steps = len(indices) if scenario.steps is None else min(scenario.steps, len(indices))
    met = sorted(m for m in met if m[0] < steps)
    shape_of = {key: s for s, key in enumerate(dict.fromkeys(key for *_, key in met))}

    compiles: dict[str, list[float]] = defaultdict(list)
    for rec in records:
        if rec["event"] == "compile" and rec["key"] in shape_of:
            compiles[rec["key"]].append(float(rec.get("duration", 0.0)))
    known = [statistics.fmean(v) for v in compiles.values()]
    fallback_compile = _median_or(known, scenario.costs.compile_s)
    compile_s = np.array([statistics.fmean(compiles[k]) if k in compiles else fallback_compile for k in shape_of])
    fetch_s = _median_or(
        [float(r.get("duration", 0.0)) for r in records if r["event"] in ("hit", "switch")], scenario.costs.fetch_s
    )

    ranks = scenario.ranks or len(steps_of)
    step, rank, shape = _replicate([(d, pos, order, shape_of[key]) for d, pos, order, key in met], ranks, len(steps_of))
    calls = _replicate(
        [(d, pos, order, shape_of[key]) for d, pos, order, key in called if d < steps], ranks, len(steps_of)
    )
    log.info(
        "trace %s: %d ranks, %d steps (%s), %d keys; replayed on %d ranks",
        path,
        len(steps_of),
        len(indices),
        "step events" if by_steps else "one per meeting",
        len(shape_of),
        ranks,
    )
    return Workload(
        scenario=scenario,
        ranks=ranks,
        shapes=len(shape_of),
        steps=steps,
        step=step,
        rank=rank,
        shape=shape,
        compute_s=compute[:steps],
        compile_s=compile_s,
        fetch_s=fetch_s,
        calls=lambda: calls_by_step(*calls),
        trace_s=np.zeros(len(shape_of)),
        eager_slowdown=slowdown,
    )
