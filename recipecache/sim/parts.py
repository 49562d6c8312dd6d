"""What both players of the simulator share: the store's link (fetches in flight share its bandwidth) and the
per-rank counters a report is made of. A module of its own so that :mod:`.engine` and :mod:`.background` import it
without importing each other."""

from __future__ import annotations

import heapq
import itertools
import math

from .model import RankFigures, Workload


class Link:
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


def store_link(w: Workload) -> tuple[Link, float]:
    """The store's link for ``w``'s fetches, and a fetch's fixed latency: its measured seconds less its transfer at
    the slower of the store's and one client's bandwidth. A store colocated with the ranks caps no single fetch."""
    costs = w.scenario.costs
    link = Link(costs.store_mb_s, math.inf if w.scenario.colocated else costs.bandwidth_mb_s)
    return link, max(w.fetch_s - w.fetch_mb / min(costs.store_mb_s, costs.bandwidth_mb_s), 0.0)


class Tally:
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
