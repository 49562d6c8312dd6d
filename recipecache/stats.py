"""Counters of one store in one process, JSON-serialisable, thread-safe.

Misses, failed puts and fallbacks are counted by reason (as sccache does), because "the
cache did not help" has very different fixes depending on why: ``not_found`` is a cold
cache, ``corrupt`` a damaged entry, ``unsigned``/``bad_signature`` a refused artifact,
``backend_down``/``backend_slow``/``backend_full``/``backend_error`` the service,
``wait_timeout`` a leader that took too long, ``conflict`` an update that lost every race.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

_COUNTS = ("hits", "misses", "puts", "bytes_read", "bytes_written", "compiles", "waits", "leader", "follower", "busy",
           "fallback", "takeovers", "deleted_bad", "update_conflicts",
           # the node tier (recipecache.node_tier): served from the node directory, waited for the node's
           # fetcher, read the remote store for the node (and the bytes it got), took a dead fetcher's place,
           # refused a bad copy, could not use the directory
           "node_hits", "node_waits", "node_fetches", "node_fetched_bytes", "node_takeovers", "node_deleted_bad",
           "node_errors")
_SECONDS = ("compile_s", "wait_s")
_BY_REASON = ("misses_by_reason", "put_failures_by_reason", "fallback_by_reason")


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._seconds: dict[str, float] = dict.fromkeys(_SECONDS, 0.0)
        self._reasons: dict[str, Counter[str]] = {name: Counter() for name in _BY_REASON}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_seconds(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds

    def reason(self, group: str, reason: str) -> None:
        """Count one event of ``group`` (``misses``, ``put_failures``, ``fallback``) with its reason."""
        with self._lock:
            self._reasons[f"{group}_by_reason"][reason] += 1
            if group != "put_failures":
                self._counts[group] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {name: self._counts[name] for name in _COUNTS}
            out.update({name: round(value, 6) for name, value in self._seconds.items()})
            out.update({name: dict(counter) for name, counter in self._reasons.items()})
        return out
