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
"""

from __future__ import annotations

import heapq
import logging
import math

import numpy as np

from ..errors import ConfigError
from .model import POLICIES, RankFigures, Report, Workload, worst_case_delays

log = logging.getLogger(__name__)


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
    shares = policy != "none"
    waits = policy in ("singleflight", "prewarm")
    tally = _Tally(w.ranks)
    # compiles of each shape so far: all but the first are wasted work
    per_shape = [1 if policy == "prewarm" else 0] * w.shapes
    prewarm_s, keep = _prewarm(w, tally) if policy == "prewarm" else (0.0, slice(None))
    step, rank, shape = w.step[keep], w.rank[keep], w.shape[keep]
    # ready[s]: when the store holds s (prewarm: by the start of step 0)
    ready = [prewarm_s if policy == "prewarm" else math.inf] * w.shapes

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
    compile_cost, fetch = w.compile_s.tolist(), w.fetch_s
    t_compiles, t_compile_s = tally.compiles, tally.compile_s
    t_waits, t_wait_s, t_fetches, t_fetch_s = tally.waits, tally.wait_s, tally.fetches, tally.fetch_s

    extra = 0.0  # seconds the cache added to the steps played so far
    delays = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        start = prewarm_s + compute_before[step_l[heads_l[a]]] + extra
        # every rank's first key is met at the step's start, in rank order; a rank's
        # further keys go on a heap at the time its previous key is done
        later: list[tuple[float, int]] = []
        j = a
        longest = 0.0
        compiled_here = False
        while True:
            if later and (j == b or later[0] < (start, heads_l[j])):
                now, i = heapq.heappop(later)
            elif j < b:
                now, i = start, heads_l[j]
                j += 1
            else:
                break
            r, s = rank_l[i], shape_l[i]
            done = ready[s]
            if done <= now:
                cost = fetch
                t_fetches[r] += 1
                t_fetch_s[r] += fetch
            elif waits and done < math.inf:
                cost = done - now + fetch
                t_waits[r] += 1
                t_wait_s[r] += done - now
                t_fetches[r] += 1
                t_fetch_s[r] += fetch
            else:
                cost = compile_cost[s]
                t_compiles[r] += 1
                t_compile_s[r] += cost
                per_shape[s] += 1
                compiled_here = True
                if shares and now + cost < done:
                    ready[s] = now + cost
            end = now + cost
            if not head_l[i + 1]:
                heapq.heappush(later, (end, i + 1))
            elif end - start > longest:
                longest = end - start
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
    )
    log.debug("sim %s/%s: %d first meetings, %d compiles, stall %.1f s",
              policy, w.scenario.schedule, len(w.step), report.compile_events, stall)
    return report
