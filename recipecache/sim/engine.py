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

* no_stall and pool: nobody waits for a compile; :mod:`.background` plays them.

Fetches contend: every fetch in flight takes an equal share of the store's bandwidth
(processor sharing, each at most one client's rate, :class:`~.parts.Link`), so the ranks of a
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
from .background import BEHIND, run_behind
from .model import POLICIES, Report, Workload, compile_balance, worst_case_delays
from .parts import Tally, store_link

log = logging.getLogger(__name__)


def _prewarm(w: Workload, tally: Tally) -> tuple[float, np.ndarray]:
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
    if policy in BEHIND:
        return run_behind(w, pool=policy == "pool")
    replay = _Replay(w, policy)
    for a, b in itertools.pairwise(replay.bounds):
        replay.play_step(a, b)
    report = replay.report()
    log.debug(
        "sim %s/%s: %d first meetings, %d compiles, stall %.1f s",
        policy,
        w.scenario.schedule,
        len(w.step),
        report.compile_events,
        report.stall_s,
    )
    return report


#: what an event of a step is: a first meeting; a fetch after a wait; a node copy read after the node's fetch
#: (those three wait on the step's heap at their time); a transfer's end on the link (the link says when)
_MEET, _FETCH, _COPY, _TRANSFER = 0, 1, 2, -1


class _Replay:
    """One stalling policy (not no_stall or pool) played over one workload, step after step: the state the steps share.

    Attributes are the run's: what the store holds and when (``ready``), the node tier's copies, the link and
    its fetches, the tally; and the step's being played (``start``, its heap ``later``, its ``longest`` rank).
    """

    def __init__(self, w: Workload, policy: str) -> None:
        sc = w.scenario
        self.w, self.policy = w, policy
        self.shares = shares = policy != "none"
        self.waits = policy in ("singleflight", "prewarm")
        prewarms = policy == "prewarm" and not sc.warm  # a warm store has nothing to prewarm
        self.tally = tally = Tally(w.ranks)
        # compiles of each shape so far: all but the first are wasted work
        self.per_shape = [1 if prewarms or (sc.warm and shares) else 0] * w.shapes
        prewarm_s, keep = _prewarm(w, tally) if prewarms else (0.0, slice(None))
        self.prewarm_s = prewarm_s
        step, rank, shape = w.step[keep], w.rank[keep], w.shape[keep]
        # ready[s]: when the store holds s (prewarm: by the start of step 0)
        self.ready = [0.0 if sc.warm and shares else prewarm_s if prewarms else math.inf] * w.shapes
        self._fetches(w, shares, prewarms)
        self._steps(step, rank, shape)
        self.compile_cost = w.compile_s.tolist()
        self.fetch_began: dict[int, float] = {}
        self.remote = self.node_reads = 0
        self.extra = 0.0  # seconds the cache added to the steps played so far
        self.delays = 0
        self.worst_step = float(w.compute_s.max()) if w.steps else 0.0
        self.first_step = float(w.compute_s[0]) if w.steps else 0.0
        # the step being played (play_step sets them)
        self.start = 0.0
        self.later: list[tuple[float, int, int]] = []
        self.longest = 0.0
        self.compiled_here = False

    def _fetches(self, w: Workload, shares: bool, prewarms: bool) -> None:
        """The link fetches share, a fetch's transfer and latency, and the node tier's copies."""
        sc, costs = w.scenario, w.scenario.costs
        # fetches: a link shared by everything in flight; a transfer of fetch_mb plus a fixed latency
        self.colocated = sc.colocated
        self.link, self.latency = store_link(w)
        self.fetch_mb = fetch_mb = w.fetch_mb
        # the node tier: node_of[i] * S + s -> when the node's copy of s exists, or the ranks waiting for its fetch
        self.per_node = per_node = sc.ranks_per_node if sc.node_tier and shares else 0
        self.node_copy: dict[int, float | list[int]] = {}
        self.local_s = fetch_mb / costs.local_mb_s
        self.local_mb = fetch_mb * costs.store_mb_s / costs.local_mb_s  # a copy read's share of a colocated link
        if per_node and prewarms:
            for s in range(w.shapes):
                self.node_copy[(s % w.ranks) // per_node * w.shapes + s] = self.prewarm_s

    def _steps(self, step: np.ndarray, rank: np.ndarray, shape: np.ndarray) -> None:
        """The first meetings to play, as lists, and where each step's (``bounds``) and each rank's first key is."""
        n = len(step)
        new_step = np.ones(n, dtype=bool)
        new_step[1:] = step[1:] != step[:-1]
        head = new_step.copy()  # the first key of its rank in its step
        head[1:] |= rank[1:] != rank[:-1]
        heads = np.flatnonzero(head)
        self.bounds = [*np.flatnonzero(new_step[heads]).tolist(), len(heads)]
        self.compute_before = np.concatenate(([0.0], np.cumsum(self.w.compute_s))).tolist()
        self.heads_l, self.head_l = heads.tolist(), [*head.tolist(), True]
        self.rank_l, self.shape_l, self.step_l = rank.tolist(), shape.tolist(), step.tolist()

    def play_step(self, a: int, b: int) -> None:
        """Play the step whose ranks' first keys are ``heads_l[a:b]``, its events in time order; the step then
        lasts its compute plus its longest rank's time on the cache."""
        heads_l, link = self.heads_l, self.link
        start = self.prewarm_s + self.compute_before[self.step_l[heads_l[a]]] + self.extra
        # every rank's first key is met at the step's start, in rank order; a rank's
        # further keys, fetches after a wait and copy reads go on a heap at their time
        self.start, self.later, self.longest, self.compiled_here = start, [], 0.0, False
        later = self.later
        j = a
        link.now = link.moved = 0.0
        link.advance(start)
        while True:
            t_link = link.next_end()
            if later and (j == b or later[0][:2] < (start, heads_l[j])):
                now, i, kind = later[0]
                if t_link <= now:
                    kind = _TRANSFER
                else:
                    heapq.heappop(later)
            elif j < b:
                now, i, kind = start, heads_l[j], _MEET
                if t_link <= now:
                    kind = _TRANSFER
                else:
                    j += 1
            elif t_link < math.inf:
                kind = _TRANSFER
            else:
                break
            if kind == _TRANSFER:
                self._transfer_ended(t_link)
            elif kind == _FETCH:
                self._fetch(i, now)
            elif kind == _COPY:
                self._read_copy(i, now)
            else:
                self._meet(i, now)
        self.extra += self.longest
        self.delays += self.compiled_here
        step = self.step_l[heads_l[a]]
        self.worst_step = max(self.worst_step, float(self.w.compute_s[step]) + self.longest)
        if step == 0:
            self.first_step = float(self.w.compute_s[0]) + self.longest

    def _meet(self, i: int, now: float) -> None:
        """First meeting ``i`` at ``now``: fetch what the store holds, wait for a compile in flight (single-flight
        policies), else compile."""
        r, s = self.rank_l[i], self.shape_l[i]
        ready_s = self.ready[s]
        tally = self.tally
        if ready_s <= now:
            self._fetch(i, now)
        elif self.waits and ready_s < math.inf:
            tally.waits[r] += 1
            tally.wait_s[r] += ready_s - now
            heapq.heappush(self.later, (ready_s, i, _FETCH))
        else:
            cost = self.compile_cost[s]
            tally.compiles[r] += 1
            tally.compile_s[r] += cost
            self.per_shape[s] += 1
            self.compiled_here = True
            if self.shares and now + cost < ready_s:
                self.ready[s] = now + cost
            if self.per_node:  # the compiler puts its artifact in its node's directory too
                code = r // self.per_node * self.w.shapes + s
                copy = self.node_copy.get(code)
                if copy is None or (isinstance(copy, float) and now + cost < copy):
                    self.node_copy[code] = now + cost
            self._done(i, now + cost)

    def _transfer_ended(self, now: float) -> None:
        """A transfer on the link ended at ``now``: a copy read, or a fetch from the store (its node's waiters then
        read the node's copy)."""
        i = self.link.pop(now)
        if i < 0:  # a colocated copy read
            self._fetched(~i, now)
            return
        end = now + self.latency
        if self.per_node:
            code = self.rank_l[i] // self.per_node * self.w.shapes + self.shape_l[i]
            waiting = self.node_copy[code]
            self.node_copy[code] = end
            assert isinstance(waiting, list)
            for k in waiting[1:]:
                heapq.heappush(self.later, (end, k, _COPY))
        self._fetched(i, end)

    def _done(self, i: int, end: float) -> None:
        """First meeting ``i`` was dealt with at ``end``: its rank meets its next key then, or its step ends."""
        if not self.head_l[i + 1]:
            heapq.heappush(self.later, (end, i + 1, _MEET))
        elif end - self.start > self.longest:
            self.longest = end - self.start

    def _fetched(self, i: int, end: float) -> None:
        r = self.rank_l[i]
        self.tally.fetches[r] += 1
        self.tally.fetch_s[r] += end - self.fetch_began.pop(i)
        self._done(i, end)

    def _read_copy(self, i: int, now: float) -> None:
        """Read the node's copy: on the link when it is the store's own (colocated), else at local speed."""
        self.node_reads += 1
        if self.colocated:
            self.link.add(now, self.local_mb, ~i)
        else:
            self._fetched(i, now + self.local_s)

    def _fetch(self, i: int, now: float) -> None:
        """Fetch for first meeting ``i`` at ``now``: from the store, or (node tier) the node's copy, or wait for the
        fetch another rank of the node made."""
        self.fetch_began[i] = now
        if self.per_node:
            code = self.rank_l[i] // self.per_node * self.w.shapes + self.shape_l[i]
            copy = self.node_copy.get(code)
            if copy is None:
                self.node_copy[code] = [i]  # this rank fetches for its node
            elif isinstance(copy, list):
                copy.append(i)
                return
            elif copy <= now:
                self._read_copy(i, now)
                return
        self.remote += 1
        self.link.add(now, self.fetch_mb, i)

    def report(self) -> Report:
        """What the run cost, once every step was played."""
        w, tally = self.w, self.tally
        compile_total = sum(tally.compile_s)
        compute_total = float(w.compute_s.sum())
        stall = self.prewarm_s + self.extra
        return Report(
            policy=self.policy,
            schedule=w.scenario.schedule,
            ranks=w.ranks,
            shapes=w.shapes,
            steps=w.steps,
            first_meetings=len(w.step),
            compile_events=sum(tally.compiles),
            compile_delays=self.delays,
            worst_case_delays=worst_case_delays(w.ranks, w.shapes),
            wait_events=sum(tally.waits),
            fetch_events=sum(tally.fetches),
            compile_s=compile_total,
            wasted_compile_s=float(np.dot(np.maximum(np.asarray(self.per_shape) - 1, 0), w.compile_s)),
            wait_s=sum(tally.wait_s),
            fetch_s=sum(tally.fetch_s),
            prewarm_s=self.prewarm_s,
            compute_s=compute_total,
            wall_s=compute_total + stall,
            stall_s=stall,
            rank_stall_s=compile_total + sum(tally.wait_s),
            per_rank=tally.figures(),
            compile_balance=compile_balance(tally.compile_s),
            remote_fetches=self.remote,
            remote_mb=self.remote * self.fetch_mb,
            node_reads=self.node_reads,
            worst_step_s=self.worst_step,
            first_step_s=self.first_step,
        )
