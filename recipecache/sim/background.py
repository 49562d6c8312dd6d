"""Policies no_stall and pool: nobody waits for a compile, it runs behind the steps.

* no_stall (``--no-stall``): a rank that meets a shape not in the store traces it (``trace_s``,
  synchronous) and runs its steps without inductor (``eager_slowdown`` times their compute)
  until the artifact lands; the first rank whose trace ends compiles the rest of it
  (``compile_s - trace_s``) behind the steps, the others do not compile it. Each rank has
  one worker that compiles one graph at a time, in the order its rank offered them (as
  ``torch_integration/no_stall/pool.py`` does), so a rank that leads many shapes queues
  them. At its first call after the artifact landed a rank loads it (a fetch: the switch)
  and runs compiled from then on. While background compiles run, the steps get
  ``1 - no_stall_cpu_share`` of their CPU.
* pool (issue 47): the same, but a compile queued behind a busy worker is offered through
  the store and the first worker of the job free to take it does, on any rank: the offering
  rank's own worker when that is free first, else the earliest free worker of another rank,
  which pays the hand-off (``pool_poll_s`` plus a fetch) before it starts. A cold job's
  compile work then spreads over every rank's worker instead of queueing on the ranks that
  met the graphs first; the graphs land sooner and the job's tail past its last step shortens.

The two differ only in :meth:`Workers.take` (which worker runs a compile); :class:`_Player`
plays both step by step, over every call (``Workload.calls``), since a shape still compiling
costs at each call.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .model import Report, Workload, calls_by_step, compile_balance, worst_case_delays
from .parts import Tally, store_link

log = logging.getLogger(__name__)

#: the policies this module plays
BEHIND = ("no_stall", "pool")


class Workers:
    """Each rank's one compile worker: when it is free, what it ran, and (pool) which worker takes an offer.

    ``handoff_s`` None is no_stall: a compile waits for its own rank's worker. A number is pool: a compile whose
    own worker is busy goes to the worker that can start it first, another rank's paying ``handoff_s`` more.
    """

    def __init__(self, ranks: int, handoff_s: float | None) -> None:
        self.free = np.zeros(ranks)  # when each worker has finished what it took
        self.compiles = np.zeros(ranks, dtype=np.int64)
        self.compile_s = np.zeros(ranks)
        self.handoff_s = handoff_s
        self.handoffs = 0
        self.running: list[tuple[float, float]] = []  # the compiles not yet ended: (start, end)

    def take(self, origin: int, offered: float, work: float) -> float:
        """Run a compile of ``work`` seconds that rank ``origin`` offered at ``offered``; returns when it lands."""
        worker, start = origin, max(offered, float(self.free[origin]))
        if self.handoff_s is not None and start > offered:
            other = int(np.argmin(self.free))  # ties to the lower rank
            taken = max(offered, float(self.free[other])) + self.handoff_s
            if taken < start:
                worker, start = other, taken
                self.handoffs += 1
        end = start + work
        self.free[worker] = end
        self.compiles[worker] += 1
        self.compile_s[worker] += work
        self.running.append((start, end))
        return end


def run_behind(w: Workload, pool: bool) -> Report:
    """Play ``w`` under no_stall, or under pool with ``pool`` (see the module docstring)."""
    player = _Player(w, pool)
    player.play()
    report = player.report()
    log.debug(
        "sim %s/%s: %d background compiles (%d handed off), %d eager steps, stall %.1f s",
        report.policy,
        w.scenario.schedule,
        report.compile_events,
        report.handoffs,
        report.eager_steps,
        report.stall_s,
    )
    return report


def _stretched(begin: np.ndarray, work: np.ndarray, lo: float, hi: float, rate: float) -> np.ndarray:
    """Seconds ``work`` seconds of compute take from ``begin`` when they run at ``rate`` in [lo, hi)."""
    before = np.clip(lo - begin, 0.0, work)
    slow = np.minimum((work - before) / rate, np.maximum(hi - begin - before, 0.0))
    return work + slow * (1.0 - rate)


class _Player:
    """One run of no_stall or pool, step by step.

    Per (rank, shape) a state: 0 not met, 1 met and run without inductor, 2 compiled in
    memory. A rank's calls of a step happen at the step's start in its call order; its
    traces follow one another (the leader of a shape is the rank whose trace of it ends
    first, ties to the lower rank, and it offers its compiles in the order its traces end),
    its fetches go out together as one transfer on the store's link. The node tier is not
    modelled here: every rank loads from the store.
    """

    def __init__(self, w: Workload, pool: bool) -> None:
        sc, costs = w.scenario, w.scenario.costs
        self.w, self.pool = w, pool
        self.trace = costs.trace_times(w.compile_s) if w.trace_s is None else w.trace_s
        self.background = w.compile_s - self.trace
        self.slowdown = costs.eager_slowdown if w.eager_slowdown is None else w.eager_slowdown
        self.rate = 1.0 - costs.no_stall_cpu_share
        self.state = np.zeros((w.ranks, w.shapes), dtype=np.int8)
        self.ready = np.full(w.shapes, 0.0 if sc.warm else math.inf)
        self.link, self.latency = store_link(w)
        self.workers = Workers(w.ranks, costs.pool_poll_s + w.fetch_s if pool else None)
        self.fetches, self.fetch_s = np.zeros(w.ranks, dtype=np.int64), np.zeros(w.ranks)
        self.trace_total = self.eager_total = 0.0
        self.eager_steps = 0
        self.now = self.worst = self.first = 0.0

    def play(self) -> None:
        """Every step in order: the steps that call nothing not compiled in memory cost their compute."""
        w = self.w
        no_calls = (np.zeros(0, dtype=np.int64),) * 2
        calls = w.calls() if w.calls is not None else calls_by_step(w.step, w.rank, w.shape)  # no repeats known
        upcoming = next(calls, None)
        for t, compute in enumerate(w.compute_s.tolist()):
            rank, shape = no_calls
            if upcoming is not None and upcoming[0] == t:
                _, rank, shape = upcoming
                upcoming = next(calls, None)
            running = self.workers.running = [c for c in self.workers.running if c[1] > self.now]
            if not running and bool(np.all(self.state[rank, shape] == 2)):  # everything compiled and in memory
                step = compute
            else:
                step = self._step(rank, shape, compute)
            if t == 0:
                self.first = step
            self.now += step
            self.worst = max(self.worst, step)

    def _step(self, rank: np.ndarray, shape: np.ndarray, compute: float) -> float:
        """One step that traces, runs eager, switches or shares its CPU with a compile; returns its length."""
        now, ranks = self.now, self.w.ranks
        st = self.state[rank, shape]
        arrived = self.ready[shape] <= now
        fetch = (st != 2) & arrived  # a first meeting of a stored shape, or the switch to a landed one
        traced = (st == 0) & ~arrived
        eager = traced | ((st == 1) & ~arrived)
        trace_of = np.where(traced, self.trace[shape], 0.0)
        # each call's trace end: the rank's traces of this step one after another
        ends = np.cumsum(trace_of)
        firsts = np.searchsorted(rank, rank, side="left")
        ends = now + ends - (ends[firsts] - trace_of[firsts])
        self._lead(np.flatnonzero(traced & (self.ready[shape] == math.inf)), rank, shape, ends)
        self.state[rank[fetch], shape[fetch]] = 2
        self.state[rank[traced], shape[traced]] = 1

        cache = np.bincount(rank, weights=trace_of, minlength=ranks)
        self.trace_total += float(cache.sum())
        count = np.bincount(rank[fetch], minlength=ranks)
        if count.any():
            took = self._fetch(count)
            cache += took
        ran_eager = np.bincount(rank[eager], minlength=ranks) > 0
        work = np.where(ran_eager, compute * self.slowdown, compute)
        running = self.workers.running
        if running and self.rate < 1.0:
            work = _stretched(now + cache, work, min(c[0] for c in running), max(c[1] for c in running), self.rate)
        self.eager_total += float(work.sum()) - compute * ranks
        self.eager_steps += int(ran_eager.sum())
        return float((cache + work).max())

    def _lead(self, new: np.ndarray, rank: np.ndarray, shape: np.ndarray, ends: np.ndarray) -> None:
        """The calls ``new`` traced shapes nobody compiles yet: the first trace of each to end offers its compile,
        in the order the traces end."""
        if not len(new):
            return
        by_end = new[np.lexsort((new, ends[new]))]
        _, lead = np.unique(shape[by_end], return_index=True)
        for i in by_end[np.sort(lead)].tolist():
            s = int(shape[i])
            self.ready[s] = self.workers.take(int(rank[i]), float(ends[i]), float(self.background[s]))

    def _fetch(self, count: np.ndarray) -> np.ndarray:
        """Each rank's fetches of this step (``count`` per rank) as one transfer on the link: seconds per rank."""
        now, fetch_mb = self.now, self.w.fetch_mb
        took = count * self.latency
        if fetch_mb:
            link = self.link
            link.now = link.moved = 0.0
            link.advance(now)
            for r in np.flatnonzero(count).tolist():
                link.add(now, count[r] * fetch_mb, r)
            while link.ends:
                end = link.next_end()
                took[link.pop(end)] += end - now
        self.fetches += count
        self.fetch_s += took
        return took

    def report(self) -> Report:
        """What the run cost, once every step was played."""
        w, workers = self.w, self.workers
        compute_total = float(w.compute_s.sum())
        tally = Tally(w.ranks)
        tally.compiles, tally.compile_s = workers.compiles.tolist(), workers.compile_s.tolist()
        tally.fetches, tally.fetch_s = self.fetches.tolist(), self.fetch_s.tolist()
        fetched = int(self.fetches.sum())
        return Report(
            policy="pool" if self.pool else "no_stall",
            schedule=w.scenario.schedule,
            ranks=w.ranks,
            shapes=w.shapes,
            steps=w.steps,
            first_meetings=len(w.step),
            compile_events=int(workers.compiles.sum()),
            compile_delays=0,
            worst_case_delays=worst_case_delays(w.ranks, w.shapes),
            wait_events=0,
            fetch_events=fetched,
            compile_s=float(workers.compile_s.sum()),
            wasted_compile_s=0.0,
            wait_s=0.0,
            fetch_s=float(self.fetch_s.sum()),
            prewarm_s=0.0,
            compute_s=compute_total,
            wall_s=self.now,
            stall_s=self.now - compute_total,
            rank_stall_s=self.trace_total,
            per_rank=tally.figures(),
            compile_balance=compile_balance(tally.compile_s),
            remote_fetches=fetched,
            remote_mb=fetched * w.fetch_mb,
            worst_step_s=self.worst,
            trace_s=self.trace_total,
            eager_steps=self.eager_steps,
            eager_s=self.eager_total,
            first_step_s=self.first,
            tail_s=max(float(workers.free.max(initial=0.0)) - self.now, 0.0),
            handoffs=workers.handoffs,
        )
