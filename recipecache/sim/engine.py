"""The discrete-event core: one policy over one workload, in lockstep.

Every step ends in a collective, so step t starts for all ranks at the same instant and
lasts ``compute_s[t]`` plus the longest time any rank spent on the cache in it. A rank
meets the keys of a step one after another at the step's start (torch.compile compiles
at the first forward call, before the step's compute).

Within a step, first meetings are handled in time order (a heap), ties by rank: when two
ranks meet the same new shape at the same instant, the lower rank takes the lease. The
per-shape state is ``ready[s]``: when an artifact for ``s`` is (or will be) in the store.

* none: nothing is ever in the store; every first meeting compiles.
* shared: ``ready <= now`` fetches; otherwise the rank compiles too (even while another
  rank is half way through), and the earliest finish publishes.
* singleflight/prewarm: ``ready <= now`` fetches; a compile in flight is waited for, then
  fetched; otherwise the rank compiles and everyone else will wait for it.

Because of the lockstep a compile never outlives its step, so a singleflight waiter can
only meet a compile that started in the same step: it waits as long as the compiler plus
a fetch. In time, shared and singleflight are therefore close; what single-flight saves
is the duplicate compile work (``wasted_compile_s``), which on real hosts contends for
the CPUs of the ranks beside it.

Fetches contend: every fetch in flight takes an equal share of the store's bandwidth
(processor sharing, each at most one client's rate, :class:`_Link`), so the ranks of a
large job fetching at the same moment slow each other down, as they do at a real store.
With the node tier, the first rank of a node to need an artifact fetches it, the node's
other ranks that need it meanwhile wait for that fetch, and later ones read the node's
copy; the store then sees one fetch per node, not per rank.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math

import numpy as np

from ..errors import ConfigError
from .model import POLICIES, RankFigures, Report, Workload, worst_case_delays

log = logging.getLogger(__name__)


class _Link:
    """A link of ``capacity`` MB/s shared equally by the transfers on it, each at most ``cap`` MB/s.

    Every transfer in flight moves at the same rate, so the link keeps one "virtual"
    clock of megabytes moved per transfer: a transfer of ``mb`` that starts when that
    clock reads ``v`` ends when it reads ``v + mb``, whatever starts or ends meanwhile.
    Ends come off a heap in that order, which makes n transfers cost O(n log n).
    """

    def __init__(self, capacity: float, cap: float) -> None:
        self.capacity, self.cap = capacity, cap
        self.now = 0.0
        self.moved = 0.0  # the virtual clock: MB each transfer in flight has moved since the link began
        self.ends: list[tuple[float, int, int]] = []
        self._order = itertools.count()

    def _rate(self) -> float:
        return min(self.capacity / len(self.ends), self.cap)

    def advance(self, t: float) -> None:
        if self.ends and t > self.now:
            self.moved += (t - self.now) * self._rate()
        self.now = max(self.now, t)

    def add(self, t: float, mb: float, item: int) -> None:
        self.advance(t)
        heapq.heappush(self.ends, (self.moved + mb, next(self._order), item))

    def next_end(self) -> float:
        if not self.ends:
            return math.inf
        return self.now + max(self.ends[0][0] - self.moved, 0.0) / self._rate()

    def pop(self, t: float) -> int:
        self.advance(t)
        return heapq.heappop(self.ends)[2]


class _Tally:
    """Per-rank counters, kept as plain lists because the event loop updates them one by one."""

    def __init__(self, ranks: int) -> None:
        self.compiles = [0] * ranks
        self.compile_s = [0.0] * ranks
        self.waits = [0] * ranks
        self.wait_s = [0.0] * ranks
        self.fetches = [0] * ranks
        self.fetch_s = [0.0] * ranks

    def figures(self) -> list[RankFigures]:
        return [
            RankFigures(rank=r, compiles=self.compiles[r], compile_s=self.compile_s[r], waits=self.waits[r],
                        wait_s=self.wait_s[r], fetches=self.fetches[r], fetch_s=self.fetch_s[r])
            for r in range(len(self.compiles))
        ]


def _prewarm(w: Workload, tally: _Tally) -> tuple[float, np.ndarray]:
    """Compile shape i on rank i mod N before step 0; the ranks work in parallel.

    Returns the prewarm time (the busiest rank's share) and a mask of the first meetings
    still to play: a rank that prewarmed a shape has it in memory.
    """
    owner = np.arange(w.shapes) % w.ranks
    counts = np.bincount(owner, minlength=w.ranks)
    seconds = np.bincount(owner, weights=w.compile_s, minlength=w.ranks)
    for r in range(w.ranks):
        tally.compiles[r] += int(counts[r])
        tally.compile_s[r] += float(seconds[r])
    return float(seconds.max()), w.shape % w.ranks != w.rank


def run_policy(w: Workload, policy: str) -> Report:
    """Play ``w`` under ``policy`` and account for every second the cache cost."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    sc, costs = w.scenario, w.scenario.costs
    shares = policy != "none"
    waits = policy in ("singleflight", "prewarm")
    prewarms = policy == "prewarm" and not sc.warm  # a warm store has nothing to prewarm
    tally = _Tally(w.ranks)
    # compiles of each shape so far: all but the first are wasted work
    per_shape = [1 if prewarms or (sc.warm and shares) else 0] * w.shapes
    prewarm_s, keep = _prewarm(w, tally) if prewarms else (0.0, slice(None))
    step, rank, shape = w.step[keep], w.rank[keep], w.shape[keep]
    # ready[s]: when the store holds s (prewarm: by the start of step 0)
    ready = [0.0 if sc.warm and shares else prewarm_s if prewarms else math.inf] * w.shapes

    # fetches: a link shared by everything in flight; a transfer of fetch_mb plus a fixed latency
    colocated = sc.colocated
    link = _Link(costs.store_mb_s, math.inf if colocated else costs.bandwidth_mb_s)
    fetch_mb = w.fetch_mb
    latency = max(w.fetch_s - fetch_mb / min(costs.store_mb_s, costs.bandwidth_mb_s), 0.0)
    # the node tier: node_of[i] * S + s -> when the node's copy of s exists, or the ranks waiting for its fetch
    per_node = sc.ranks_per_node if sc.node_tier and shares else 0
    node_copy: dict[int, float | list[int]] = {}
    local_s = fetch_mb / costs.local_mb_s
    local_mb = fetch_mb * costs.store_mb_s / costs.local_mb_s  # a copy read's share of a colocated link
    if per_node and prewarms:
        for s in range(w.shapes):
            node_copy[(s % w.ranks) // per_node * w.shapes + s] = prewarm_s

    n = len(step)
    new_step = np.ones(n, dtype=bool)
    new_step[1:] = step[1:] != step[:-1]
    head = new_step.copy()  # the first key of its rank in its step
    head[1:] |= rank[1:] != rank[:-1]
    heads = np.flatnonzero(head)
    bounds = np.flatnonzero(new_step[heads]).tolist() + [len(heads)]
    compute_before = np.concatenate(([0.0], np.cumsum(w.compute_s))).tolist()
    heads_l, head_l = heads.tolist(), head.tolist() + [True]
    rank_l, shape_l, step_l = rank.tolist(), shape.tolist(), step.tolist()
    compile_cost = w.compile_s.tolist()
    t_compiles, t_compile_s = tally.compiles, tally.compile_s
    t_waits, t_wait_s, t_fetches, t_fetch_s = tally.waits, tally.wait_s, tally.fetches, tally.fetch_s
    fetch_began: dict[int, float] = {}
    remote = node_reads = 0
    MEET, FETCH, COPY = 0, 1, 2  # a first meeting; a fetch after a wait; a node copy read after the node's fetch

    extra = 0.0  # seconds the cache added to the steps played so far
    delays = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        start = prewarm_s + compute_before[step_l[heads_l[a]]] + extra
        # every rank's first key is met at the step's start, in rank order; a rank's
        # further keys, fetches after a wait and copy reads go on a heap at their time
        later: list[tuple[float, int, int]] = []
        j = a
        longest = 0.0
        compiled_here = False
        link.now = link.moved = 0.0
        link.advance(start)

        def done(i: int, end: float) -> None:
            nonlocal longest
            if not head_l[i + 1]:
                heapq.heappush(later, (end, i + 1, MEET))
            elif end - start > longest:
                longest = end - start

        def fetched(i: int, end: float) -> None:
            r = rank_l[i]
            t_fetches[r] += 1
            t_fetch_s[r] += end - fetch_began.pop(i)
            done(i, end)

        def read_copy(i: int, now: float) -> None:
            nonlocal node_reads
            node_reads += 1
            if colocated:
                link.add(now, local_mb, ~i)
            else:
                fetched(i, now + local_s)

        def fetch(i: int, now: float) -> None:
            nonlocal remote
            fetch_began[i] = now
            if per_node:
                code = rank_l[i] // per_node * w.shapes + shape_l[i]
                copy = node_copy.get(code)
                if copy is None:
                    node_copy[code] = [i]  # this rank fetches for its node
                elif isinstance(copy, list):
                    copy.append(i)
                    return
                elif copy <= now:
                    read_copy(i, now)
                    return
            remote += 1
            link.add(now, fetch_mb, i)

        while True:
            t_link = link.next_end()
            if later and (j == b or later[0][:2] < (start, heads_l[j])):
                now, i, kind = later[0]
                if t_link <= now:
                    kind = -1
                else:
                    heapq.heappop(later)
            elif j < b:
                now, i, kind = start, heads_l[j], MEET
                if t_link <= now:
                    kind = -1
                else:
                    j += 1
            elif t_link < math.inf:
                kind = -1
            else:
                break
            if kind == -1:  # a transfer ended
                now = t_link
                i = link.pop(now)
                if i < 0:  # a colocated copy read
                    fetched(~i, now)
                    continue
                end = now + latency
                if per_node:
                    code = rank_l[i] // per_node * w.shapes + shape_l[i]
                    waiting = node_copy[code]
                    node_copy[code] = end
                    assert isinstance(waiting, list)
                    for k in waiting[1:]:
                        heapq.heappush(later, (end, k, COPY))
                fetched(i, end)
                continue
            if kind == FETCH:
                fetch(i, now)
                continue
            if kind == COPY:
                read_copy(i, now)
                continue
            r, s = rank_l[i], shape_l[i]
            ready_s = ready[s]
            if ready_s <= now:
                fetch(i, now)
            elif waits and ready_s < math.inf:
                t_waits[r] += 1
                t_wait_s[r] += ready_s - now
                heapq.heappush(later, (ready_s, i, FETCH))
            else:
                cost = compile_cost[s]
                t_compiles[r] += 1
                t_compile_s[r] += cost
                per_shape[s] += 1
                compiled_here = True
                if shares and now + cost < ready_s:
                    ready[s] = now + cost
                if per_node:  # the compiler puts its artifact in its node's directory too
                    code = r // per_node * w.shapes + s
                    copy = node_copy.get(code)
                    if copy is None or (isinstance(copy, float) and now + cost < copy):
                        node_copy[code] = now + cost
                done(i, now + cost)
        extra += longest
        delays += compiled_here

    compile_total = sum(t_compile_s)
    compute_total = float(w.compute_s.sum())
    stall = prewarm_s + extra
    report = Report(
        policy=policy, schedule=w.scenario.schedule, ranks=w.ranks, shapes=w.shapes, steps=w.steps,
        first_meetings=len(w.step),
        compile_events=sum(t_compiles), compile_delays=delays,
        worst_case_delays=worst_case_delays(w.ranks, w.shapes),
        wait_events=sum(t_waits), fetch_events=sum(t_fetches),
        compile_s=compile_total,
        wasted_compile_s=float(np.dot(np.maximum(np.asarray(per_shape) - 1, 0), w.compile_s)),
        wait_s=sum(t_wait_s), fetch_s=sum(t_fetch_s), prewarm_s=prewarm_s,
        compute_s=compute_total, wall_s=compute_total + stall, stall_s=stall,
        rank_stall_s=compile_total + sum(t_wait_s),
        per_rank=tally.figures(),
        remote_fetches=remote, remote_mb=remote * fetch_mb, node_reads=node_reads,
    )
    log.debug("sim %s/%s: %d first meetings, %d compiles, stall %.1f s",
              policy, w.scenario.schedule, len(w.step), report.compile_events, stall)
    return report
