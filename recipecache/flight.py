"""Single flight through the store: one process per key compiles, the others wait for its artifact.

:meth:`Flights.begin` (the store's :meth:`~recipecache.store.Store.begin`) looks a key up; on a miss it
takes the key's lease (:class:`~recipecache.lease.SingleFlight`) or waits for its holder, and
hands the caller a :class:`Flight`: a hit, a follower's artifact, or the duty to compile and
publish (a leader, or a fallback that compiles without a lease because the backend failed
or the wait timed out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .breaker import Breakers
from .buffers import Buffer
from .entries import Entries, Lookup
from .errors import BackendError
from .eventlog import EventLog
from .keys import storage_key
from .lease import HeldLease, Outcome, SingleFlight
from .reasons import Reason, Role
from .stats import Stats

if TYPE_CHECKING:
    from .store import Store


@dataclass
class Flight:
    """One key's trip through single-flight: a hit, a follower's result, or the duty to compile.

    ``data`` is set for ``hit`` and ``follower``. A ``leader`` (or ``fallback``) must
    compile and then :meth:`publish`, or :meth:`release` if it cannot; using the flight
    as a context manager releases the lease in every case.
    """

    store: Store
    key: str
    role: Role
    data: memoryview | None = None
    #: why a ``fallback`` compiles without a lease (a backend failure or ``wait_timeout``)
    reason: Reason | None = None
    waited_s: float = 0.0
    #: why the first lookup missed (``not_found``, a refusal such as ``bad_signature``, or a
    #: backend failure); None for a hit
    miss_reason: Reason | None = None
    lease: HeldLease | None = field(default=None, repr=False)
    #: whether the flight is in the event log (:meth:`Store.begin`'s ``trace``)
    trace: bool = True
    #: what the flight looks up and publishes (:meth:`Store.begin`'s ``kind``), counted under it
    kind: str | None = None

    def publish(self, data: Buffer, *, meta: dict[str, Any] | None = None) -> bool:
        """Store ``data`` (described by ``meta``, see :meth:`Store.put`) and release the lease; False if not taken."""
        stored = self.store.put(self.key, data, meta=meta, trace=self.trace, kind=self.kind)
        self.release()
        return stored

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def __enter__(self) -> Flight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class _Trip:
    """What one :meth:`Flights._lead_or_follow` carries from the lookup that missed to the flight it returns."""

    key: str
    #: why the lookup missed
    miss: Reason
    #: whether the flight counts the lookup's outcome (a ``stale`` lookup's is its caller's)
    counted: bool
    trace: bool
    kind: str | None


class Flights:
    """The store's single flight after a miss: the lease taken or waited for, and every outcome counted and traced."""

    def __init__(
        self,
        store: Store,
        entries: Entries,
        *,
        read: Callable[..., Lookup],
        leases: SingleFlight,
        breakers: Breakers,
        stats: Stats,
        events: EventLog,
    ) -> None:
        """``read(key, trace=...)`` is the store's lookup that traces its hit or miss and counts nothing."""
        self._store = store
        self._entries = entries
        self._read = read
        self._leases = leases
        self._breakers = breakers
        self._stats = stats
        self._events = events

    def begin(
        self,
        key: str,
        *,
        timeout: float,
        stale: Buffer | None,
        stale_reason: Reason,
        trace: bool,
        kind: str | None,
        wait: bool,
    ) -> Flight:
        """Look ``key`` up; on a miss either wait up to ``timeout`` for the process compiling it or become its compiler.

        The lookup's outcome is counted once, when the flight's role is known: a hit, a
        follower's artifact (a hit that waited), or a miss for the first lookup's reason
        (leader, or a fallback, also counted as such); under ``kind`` too, which the flight
        keeps for its :meth:`Flight.publish`. A value the caller then cannot use is
        :meth:`Store.record_unused_hit`.

        ``stale`` is a value the caller already read under ``key`` and cannot use (none of
        the guard variants it holds fits, or it is malformed), for ``stale_reason`` (a miss in
        the event log). While the key holds exactly that value it counts as missing: the
        caller takes the lease and compiles what it needs, or waits for the lease holder to
        publish something else. The caller counted its own lookup, so this one counts no
        outcome: the caller settles it (:meth:`Store.record_unused_hit` once, if it uses none of
        the values). With ``stale`` the backend itself is read, never a node copy (the stale
        value may be that copy), and what it holds refreshes the node copy. ``trace=False`` keeps the
        flight (lookup, wait, compile start, publish) out of the event log, as for :meth:`Store.lookup`.
        ``wait=False``: when another process holds the lease, return at once with role ``busy``
        (no data, no lease) instead of waiting for its artifact: for callers that have
        something else to run meanwhile (no-stall) and look again later (:meth:`Store.compiling`).
        """
        if stale is not None:
            if trace:
                self._events.record("miss", key, reason=stale_reason)
            return self._lead_or_follow(
                key, stale_reason, stale=stale, timeout=timeout, wait=wait, trace=trace, kind=kind
            )
        first = self._read(key, trace=trace)
        if first.data is not None:
            self._stats.outcome(kind, None)
            return Flight(self._store, key, Role.HIT, data=first.data, trace=trace, kind=kind)
        assert first.reason is not None  # a miss names its reason
        if first.failed:  # the backend failed: no lease to take
            self._stats.outcome(kind, first.reason)
            return self._fallback(key, first.reason, miss_reason=first.reason, trace=trace, kind=kind)
        return self._lead_or_follow(key, first.reason, stale=None, timeout=timeout, wait=wait, trace=trace, kind=kind)

    def _lead_or_follow(
        self,
        key: str,
        miss: Reason,
        *,
        stale: Buffer | None,
        timeout: float,
        wait: bool,
        trace: bool,
        kind: str | None,
    ) -> Flight:
        """After a miss for ``miss``: wait up to ``timeout`` for the process compiling ``key``, or become its compiler
        (:meth:`begin` says what each argument means)."""
        trip = _Trip(key, miss, counted=stale is None, trace=trace, kind=kind)
        try:
            outcome = self._breakers.call(
                "lease",
                self._leases.run,
                storage_key(self._store.namespace, key),
                functools.partial(self._awaited, key, stale),
                timeout,
            )
        except BackendError as exc:
            self._count(trip, hit=False)
            return self._fallback(key, exc.reason, miss_reason=miss, trace=trace, kind=kind)
        if not wait and outcome.role is Role.TIMEOUT:
            self._count(trip, hit=False)
            self._stats.count("busy")
            return Flight(self._store, key, Role.BUSY, miss_reason=miss, trace=trace, kind=kind)
        if outcome.waited_s and wait:
            self._stats.count("waits")
            self._stats.add_seconds("wait_s", outcome.waited_s)
            if trace:
                self._events.record("wait", key, outcome.waited_s)
        self._count(trip, hit=outcome.role is Role.FOLLOWER)
        if outcome.role is Role.TIMEOUT:
            return self._fallback(
                key, Reason.WAIT_TIMEOUT, waited_s=outcome.waited_s, miss_reason=miss, trace=trace, kind=kind
            )
        if outcome.role is Role.FOLLOWER:
            self._stats.count("follower")
            return Flight(
                self._store,
                key,
                Role.FOLLOWER,
                data=outcome.value,
                waited_s=outcome.waited_s,
                miss_reason=miss,
                trace=trace,
                kind=kind,
            )
        return self._lead(trip, outcome, wait)

    def _awaited(self, key: str, stale: Buffer | None) -> memoryview | None:
        """What a waiter looks for under ``key``: any value, or with ``stale`` another one than that, from the backend."""
        return self._entries.read(key).data if stale is None else self._entries.fetch_fresh(key, stale)

    def _count(self, trip: _Trip, *, hit: bool) -> None:
        """Count the lookup's outcome once its flight's role is known (a stale lookup's is its caller's)."""
        if trip.counted:
            self._stats.outcome(trip.kind, None if hit else trip.miss)

    def _lead(self, trip: _Trip, outcome: Outcome[memoryview], wait: bool) -> Flight:
        self._stats.count("leader")
        if outcome.takeover:
            self._stats.count("takeovers")
            if trip.trace:
                self._events.record("takeover", trip.key)
        if trip.trace and wait:  # wait=False: the caller says where it compiles (no-stall: behind the steps)
            self._events.record("compile_start", trip.key)
        return Flight(
            self._store,
            trip.key,
            Role.LEADER,
            lease=outcome.lease,
            waited_s=outcome.waited_s,
            miss_reason=trip.miss,
            trace=trip.trace,
            kind=trip.kind,
        )

    def _fallback(
        self,
        key: str,
        reason: Reason,
        *,
        miss_reason: Reason | None,
        waited_s: float = 0.0,
        trace: bool = True,
        kind: str | None = None,
    ) -> Flight:
        """A flight that compiles without a lease, for ``reason`` (counted, and traced with ``trace``)."""
        self._stats.reason("fallback", reason)
        if trace:
            self._events.record("fallback", key, reason=reason)
        return Flight(
            self._store,
            key,
            Role.FALLBACK,
            reason=reason,
            waited_s=waited_s,
            miss_reason=miss_reason,
            trace=trace,
            kind=kind,
        )
