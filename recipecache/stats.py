"""Counters of one store in one process, JSON-serialisable, thread-safe.

Misses, failed puts and fallbacks are counted by reason (as sccache does), because "the
cache did not help" has very different fixes depending on why: ``not_found`` is a cold
cache, ``corrupt`` a damaged entry, ``unsigned``/``bad_signature`` a refused artifact,
``backend_down``/``backend_slow``/``backend_full``/``backend_error`` the service,
``wait_timeout`` a leader that took too long, ``conflict`` an update that lost every race.

Each lookup has one outcome, counted once: a hit, or a miss for a reason. A caller that
tells the store what it looks up (``kind``, e.g. ``fx`` or ``precompiled``) gets the
outcomes and puts of each kind in ``by_kind``; ``hits``, ``misses`` and ``puts`` are the
sums over every kind and over lookups and puts of no kind. A hit the caller then could not
use is turned into a miss (:meth:`Stats.unused_hit`), not counted again.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any

from .metrics_schema import LOOKUP_HIT, LOOKUP_MISS, LOOKUP_PUT, OUTCOMES

_COUNTS = (
    "hits",
    "misses",
    "puts",
    "bytes_read",
    "bytes_written",
    "compiles",
    "waits",
    "leader",
    "follower",
    "busy",
    "fallback",
    "takeovers",
    "deleted_bad",
    "update_conflicts",
    # the node tier (recipecache.node_tier): served from the node directory, waited for the node's
    # fetcher, read the remote store for the node (and the bytes it got), took a dead fetcher's place,
    # refused a bad copy, could not use the directory
    "node_hits",
    "node_waits",
    "node_fetches",
    "node_fetched_bytes",
    "node_takeovers",
    "node_deleted_bad",
    "node_errors",
)
_SECONDS = ("compile_s", "wait_s")
_BY_REASON = ("misses_by_reason", "put_failures_by_reason", "fallback_by_reason")


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._seconds: dict[str, float] = dict.fromkeys(_SECONDS, 0.0)
        self._reasons: dict[str, Counter[str]] = {name: Counter() for name in _BY_REASON}
        #: kind -> {"hit", "miss", "put"} (:data:`~recipecache.metrics_schema.OUTCOMES`: the metrics' ``lookups``)
        self._kinds: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_seconds(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds

    def reason(self, group: str, reason: str) -> None:
        """Count one event of ``group`` (``put_failures``, ``fallback``) with its reason (misses: :meth:`outcome`)."""
        with self._lock:
            self._reasons[f"{group}_by_reason"][reason] += 1
            if group != "put_failures":
                self._counts[group] += 1

    def outcome(self, kind: str | None, miss: str | None) -> None:
        """One lookup's outcome: a hit (``miss`` None) or a miss for the reason ``miss``, under ``kind`` if given."""
        with self._lock:
            self._outcome(kind, miss, 1)

    def unused_hit(self, kind: str | None, miss: str | None) -> None:
        """A hit counted by :meth:`outcome` was not used: a miss for ``miss`` instead.

        ``miss`` None withdraws the hit without a miss in its place: the caller looks again
        (under another key), and that lookup's outcome is this one's.
        """
        with self._lock:
            self._outcome(kind, None, -1)
            if miss is not None:
                self._outcome(kind, miss, 1)

    def _outcome(self, kind: str | None, miss: str | None, n: int) -> None:
        if miss is None:
            self._counts["hits"] += n
        else:
            self._counts["misses"] += n
            self._reasons["misses_by_reason"][miss] += n
        if kind is not None:
            self._kinds[kind][(LOOKUP_HIT if miss is None else LOOKUP_MISS).key] += n

    def put(self, kind: str | None, nbytes: int) -> None:
        """One value written (``nbytes`` of payload), under ``kind`` if given."""
        with self._lock:
            self._counts["puts"] += 1
            self._counts["bytes_written"] += nbytes
            if kind is not None:
                self._kinds[kind][LOOKUP_PUT.key] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {name: self._counts[name] for name in _COUNTS}
            out.update({name: round(value, 6) for name, value in self._seconds.items()})
            out.update({name: dict(counter) for name, counter in self._reasons.items()})
            out["by_kind"] = {kind: {name: counts[name] for name in OUTCOMES} for kind, counts in self._kinds.items()}
        return out
