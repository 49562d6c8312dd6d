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

* behind (``--no-stall``): nobody waits for a compile. A rank that meets a shape not in
  the store traces it (``trace_s``, synchronous) and runs its steps without inductor
  (``eager_slowdown`` times their compute) until the artifact lands; the first rank whose
  trace ends compiles the rest of it (``compile_s - trace_s``) behind the steps, the others
  do not compile it. At its first call after the artifact landed a rank loads it (a fetch:
  the switch) and runs compiled from then on. While background compiles run, the steps get
  ``1 - no_stall_cpu_share`` of their CPU. :func:`_run_no_stall` plays it step by step, over
  every call (``Workload.calls``), since a shape still compiling costs at each call.

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
from .model import POLICIES, RankFigures, Report, Workload, calls_by_step, worst_case_delays

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
            RankFigures(
                rank=r,
                compiles=self.compiles[r],
                compile_s=self.compile_s[r],
                waits=self.waits[r],
                wait_s=self.wait_s[r],
                fetches=self.fetches[r],
                fetch_s=self.fetch_s[r],
            )
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
    if policy == "no_stall":
        return _run_no_stall(w)
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
    bounds = [*np.flatnonzero(new_step[heads]).tolist(), len(heads)]
    compute_before = np.concatenate(([0.0], np.cumsum(w.compute_s))).tolist()
    heads_l, head_l = heads.tolist(), [*head.tolist(), True]
    rank_l, shape_l, step_l = rank.tolist(), shape.tolist(), step.tolist()
    compile_cost = w.compile_s.tolist()
    t_compiles, t_compile_s = tally.compiles, tally.compile_s
    t_waits, t_wait_s, t_fetches, t_fetch_s = tally.waits, tally.wait_s, tally.fetches, tally.fetch_s
    fetch_began: dict[int, float] = {}
    remote = node_reads = 0
    MEET, FETCH, COPY = 0, 1, 2  # a first meeting; a fetch after a wait; a node copy read after the node's fetch

    extra = 0.0  # seconds the cache added to the steps played so far
    delays = 0
    worst_step = float(w.compute_s.max()) if w.steps else 0.0
    for a, b in itertools.pairwise(bounds):
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
                heapq.heappush(later, (end, i + 1, MEET))  # noqa: B023 - called within this iteration only
            elif end - start > longest:  # noqa: B023 - called within this iteration only
                longest = end - start  # noqa: B023 - called within this iteration only

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
        worst_step = max(worst_step, float(w.compute_s[step_l[heads_l[a]]]) + longest)

    compile_total = sum(t_compile_s)
    compute_total = float(w.compute_s.sum())
    stall = prewarm_s + extra
    report = Report(
        policy=policy,
        schedule=w.scenario.schedule,
        ranks=w.ranks,
        shapes=w.shapes,
        steps=w.steps,
        first_meetings=len(w.step),
        compile_events=sum(t_compiles),
        compile_delays=delays,
        worst_case_delays=worst_case_delays(w.ranks, w.shapes),
        wait_events=sum(t_waits),
        fetch_events=sum(t_fetches),
        compile_s=compile_total,
        wasted_compile_s=float(np.dot(np.maximum(np.asarray(per_shape) - 1, 0), w.compile_s)),
        wait_s=sum(t_wait_s),
        fetch_s=sum(t_fetch_s),
        prewarm_s=prewarm_s,
        compute_s=compute_total,
        wall_s=compute_total + stall,
        stall_s=stall,
        rank_stall_s=compile_total + sum(t_wait_s),
        per_rank=tally.figures(),
        remote_fetches=remote,
        remote_mb=remote * fetch_mb,
        node_reads=node_reads,
        worst_step_s=worst_step,
    )
    log.debug(
        "sim %s/%s: %d first meetings, %d compiles, stall %.1f s",
        policy,
        w.scenario.schedule,
        len(w.step),
        report.compile_events,
        stall,
    )
    return report


def _stretched(begin: np.ndarray, work: np.ndarray, lo: float, hi: float, rate: float) -> np.ndarray:
    """Seconds ``work`` seconds of compute take from ``begin`` when they run at ``rate`` in [lo, hi)."""
    before = np.clip(lo - begin, 0.0, work)
    slow = np.minimum((work - before) / rate, np.maximum(hi - begin - before, 0.0))
    return work + slow * (1.0 - rate)


def _run_no_stall(w: Workload) -> Report:
    """Policy ``behind``, step by step (see the module docstring).

    Per (rank, shape) a state: 0 not met, 1 met and run without inductor, 2 compiled in
    memory. A rank's calls of a step happen at the step's start in its call order; its
    traces follow one another (the leader of a shape is the rank whose trace of it ends
    first, ties to the lower rank), its fetches go out together as one transfer on the
    store's link. The node tier is not modelled here: every rank loads from the store.
    """
    sc, costs = w.scenario, w.scenario.costs
    ranks, shapes = w.ranks, w.shapes
    trace = costs.trace_times(w.compile_s) if w.trace_s is None else w.trace_s
    background = w.compile_s - trace
    slowdown = costs.eager_slowdown if w.eager_slowdown is None else w.eager_slowdown
    rate = 1.0 - costs.no_stall_cpu_share
    state = np.zeros((ranks, shapes), dtype=np.int8)
    ready = np.full(shapes, 0.0 if sc.warm else math.inf)
    link = _Link(costs.store_mb_s, math.inf if sc.colocated else costs.bandwidth_mb_s)
    fetch_mb = w.fetch_mb
    latency = max(w.fetch_s - fetch_mb / min(costs.store_mb_s, costs.bandwidth_mb_s), 0.0)
    compiles, compile_s = np.zeros(ranks, dtype=np.int64), np.zeros(ranks)
    fetches, fetch_s = np.zeros(ranks, dtype=np.int64), np.zeros(ranks)
    in_flight: list[tuple[float, float]] = []  # background compiles: (start, end)
    trace_total = eager_total = 0.0
    eager_steps = 0
    no_calls = (np.zeros(0, dtype=np.int64),) * 2
    calls = w.calls() if w.calls is not None else calls_by_step(w.step, w.rank, w.shape)  # no repeats known
    upcoming = next(calls, None)
    now = worst = 0.0
    compute_l = w.compute_s.tolist()
    for t in range(w.steps):
        rank, shape = no_calls
        if upcoming is not None and upcoming[0] == t:
            _, rank, shape = upcoming
            upcoming = next(calls, None)
        compute = compute_l[t]
        in_flight = [c for c in in_flight if c[1] > now]
        st = state[rank, shape]
        if not in_flight and bool(np.all(st == 2)):  # everything compiled and in memory
            now += compute
            worst = max(worst, compute)
            continue
        arrived = ready[shape] <= now
        fetch = (st != 2) & arrived  # a first meeting of a stored shape, or the switch to a landed one
        traced = (st == 0) & ~arrived
        eager = traced | ((st == 1) & ~arrived)
        trace_of = np.where(traced, trace[shape], 0.0)
        # each call's trace end: the rank's traces of this step one after another
        ends = np.cumsum(trace_of)
        firsts = np.searchsorted(rank, rank, side="left")
        ends = now + ends - (ends[firsts] - trace_of[firsts])
        new = np.flatnonzero(traced & (ready[shape] == math.inf))
        if len(new):
            by_end = new[np.lexsort((new, ends[new]))]
            _, lead = np.unique(shape[by_end], return_index=True)
            for i in by_end[lead].tolist():
                s, r = int(shape[i]), int(rank[i])
                ready[s] = ends[i] + background[s]
                in_flight.append((float(ends[i]), float(ready[s])))
                compiles[r] += 1
                compile_s[r] += background[s]
        state[rank[fetch], shape[fetch]] = 2
        state[rank[traced], shape[traced]] = 1

        cache = np.bincount(rank, weights=trace_of, minlength=ranks)
        trace_total += float(cache.sum())
        count = np.bincount(rank[fetch], minlength=ranks)
        if count.any():
            took = count * latency
            if fetch_mb:
                link.now = link.moved = 0.0
                link.advance(now)
                for r in np.flatnonzero(count).tolist():
                    link.add(now, count[r] * fetch_mb, r)
                while link.ends:
                    end = link.next_end()
                    took[link.pop(end)] += end - now
            fetches += count
            fetch_s += took
            cache += took  # type: ignore[arg-type]  # numpy's stubs type bincount as integers, even with float weights
        ran_eager = np.bincount(rank[eager], minlength=ranks) > 0
        work = np.where(ran_eager, compute * slowdown, compute)
        if in_flight and rate < 1.0:
            work = _stretched(now + cache, work, min(c[0] for c in in_flight), max(c[1] for c in in_flight), rate)
        eager_total += float(work.sum()) - compute * ranks
        eager_steps += int(ran_eager.sum())
        step = float((cache + work).max())
        now += step
        worst = max(worst, step)

    compute_total = float(w.compute_s.sum())
    tally = _Tally(ranks)
    tally.compiles, tally.compile_s = compiles.tolist(), compile_s.tolist()
    tally.fetches, tally.fetch_s = fetches.tolist(), fetch_s.tolist()
    report = Report(
        policy="no_stall",
        schedule=sc.schedule,
        ranks=ranks,
        shapes=shapes,
        steps=w.steps,
        first_meetings=len(w.step),
        compile_events=int(compiles.sum()),
        compile_delays=0,
        worst_case_delays=worst_case_delays(ranks, shapes),
        wait_events=0,
        fetch_events=int(fetches.sum()),
        compile_s=float(compile_s.sum()),
        wasted_compile_s=0.0,
        wait_s=0.0,
        fetch_s=float(fetch_s.sum()),
        prewarm_s=0.0,
        compute_s=compute_total,
        wall_s=now,
        stall_s=now - compute_total,
        rank_stall_s=trace_total,
        per_rank=tally.figures(),
        remote_fetches=int(fetches.sum()),
        remote_mb=float(fetches.sum()) * fetch_mb,
        worst_step_s=worst,
        trace_s=trace_total,
        eager_steps=eager_steps,
        eager_s=eager_total,
    )
    log.debug(
        "sim behind/%s: %d background compiles, %d eager steps, stall %.1f s",
        sc.schedule,
        report.compile_events,
        eager_steps,
        report.stall_s,
    )
    return report
