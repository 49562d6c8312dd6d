"""The store: envelopes, verification, stats and degradation on top of one backend.

The store is what training code talks to. Its promises:

* ``get`` returns the verified payload (a read-only ``memoryview`` of what the backend
  read, never a copy) or None. Nothing that failed verification ever reaches a caller
  that would load it. A *damaged* entry (its framing, header or digest does not match its
  own payload, or it names another key or namespace: anyone can check that, no secret
  needed) is counted as a ``corrupt`` miss and deleted with a compare-and-delete, so a
  good entry published meanwhile survives. An entry this reader merely cannot accept
  (``unsigned`` or ``bad_signature`` under its secret, ``old_format``) is refused and
  left in place: another job with another secret, or an older recipecache, may be using
  it, and one misconfigured reader must not wipe everyone's cache. The next ``put``
  replaces it.
* ``update`` is read-modify-write on a compare-and-set put, retried on conflict (a
  bounded number of times), for state several processes merge into (PGO decisions).
* ``get_or_compile`` runs the caller's compile at most once per key across processes
  and hosts (single-flight, :mod:`recipecache.lease`), except when the backend cannot
  help, in which case it compiles locally.
* With a node directory (``RECIPECACHE_NODE_DIR``, :mod:`recipecache.node_tier`) lookups
  go through it: one process per node reads each entry from the backend, the node's
  other processes read the verified copy it leaves there; puts go to both. Entries
  rewritten in place (``update``) are read from the backend where a copy could be stale:
  see :meth:`Store.update`.
* Nothing a backend does (down, slow, full, corrupt) raises into the caller. A failure
  opens a circuit breaker (:class:`Breaker`): for a while the backend is not asked at all
  (each skipped call still counts under the failure's reason), then one call probes it;
  each failed probe doubles the pause, so an outage costs a few timeouts in all, not one
  per lookup. There is one breaker per part of the backend that fails alone
  (:meth:`~recipecache.backends.base.Backend.failure_domain`: a Redis Cluster primary), so a
  dead node pauses its own keys only. A failure of one key
  (:class:`~recipecache.errors.BackendKeyError`) is that key's miss and leaves the breaker closed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import envelope
from .backends import open_backend
from .backends.base import Backend, EntryInfo
from .buffers import Buffer, byte_view
from .errors import BackendError, BackendKeyError, VerificationError, echo
from .eventlog import EventLog
from .health import HealthCheck
from .keys import storage_key
from .lease import HeldLease, SingleFlight
from .node_tier import NodeTier
from .reasons import ABSENT, FAILED, REFUSED, Reason, Role
from .settings import StoreSettings
from .stats import Stats

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a failed backend is left alone before the store tries it again; each failed try
#: doubles the pause, up to RETRY_AFTER_MAX_S.
RETRY_AFTER_S = 5.0
RETRY_AFTER_MAX_S = 120.0
#: Tries of one :meth:`Store.update` before it gives up as a ``conflict``, and its backoff.
UPDATE_ATTEMPTS = 16
_UPDATE_BACKOFF_S = 0.002
_UPDATE_BACKOFF_MAX_S = 0.2


@dataclass(frozen=True)
class Lookup:
    """One lookup's answer: the verified payload, or None and why (:mod:`recipecache.reasons`)."""

    #: a read-only view of the payload (compare with ``==``; ``bytes(data)`` for an owned copy)
    data: memoryview | None
    #: None for a hit
    reason: Reason | None = None

    @property
    def absent(self) -> bool:
        """The store answered: nothing under this key (a cold cache)."""
        return self.reason in ABSENT

    @property
    def refused(self) -> bool:
        """The store answered: an entry was there and failed verification."""
        return self.reason in REFUSED

    @property
    def failed(self) -> bool:
        """The backend did not answer usefully (down, slow, full, broken)."""
        return self.reason in FAILED


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


class Breaker:
    """The store's circuit breaker: a failed backend is left alone for a pause, then probed by one call.

    Every call of a backend that keeps failing would pay its timeout again; while the
    breaker is open calls fail at once with the failure's reason instead. After the pause
    the next call is the one probe (other threads still fail at once until it answers; the
    probing thread's own nested calls go through). A failed probe doubles the pause, up to
    :data:`RETRY_AFTER_MAX_S`: a job spread over minutes against a dead or hung backend pays
    a handful of timeouts in all. Any answer closes the breaker and resets the pause; a
    failure of one key (:class:`BackendKeyError`) is such an answer. The clock is
    injectable so tests can step through the pauses.
    """

    def __init__(self, url: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self._clock = clock
        self._lock = threading.Lock()
        #: why the backend is left alone; None while the breaker is closed
        self.reason: Reason | None = None
        self._until = 0.0
        self._pause = 0.0
        #: the thread whose call is the probe now
        self._prober: int | None = None

    def call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run a backend call; raise BackendError at once while the breaker is open."""
        me = threading.get_ident()
        probe = False
        with self._lock:
            if self.reason is not None and self._prober != me:
                if self._prober is not None or self._clock() < self._until:
                    raise BackendError(self.reason, "backend unavailable (retrying later)")
                self._prober, probe = me, True
                log.info("recipecache: retrying backend %s", self.url)
        try:
            result = fn(*args)
        except BackendKeyError:
            self._answered()
            raise
        except BackendError as exc:
            self._failed(what, exc, probe)
            raise
        finally:
            if probe:
                with self._lock:
                    if self._prober == me:
                        self._prober = None
        self._answered()
        return result

    def _failed(self, what: str, exc: BackendError, probe: bool) -> None:
        with self._lock:
            first = self.reason is None
            if first:
                self._pause = RETRY_AFTER_S
            elif probe:
                self._pause = min(self._pause * 2, RETRY_AFTER_MAX_S)
            self.reason = exc.reason
            self._until = self._clock() + self._pause
            pause = self._pause
        if first:
            log.warning(
                "recipecache: %s failed on %s (%s: %s); compiling locally, retrying the cache in %.0f s",
                what,
                self.url,
                exc.reason,
                exc,
                pause,
            )
        elif probe:
            log.info(
                "recipecache: backend %s still failing (%s: %s); next try in %.0f s", self.url, exc.reason, exc, pause
            )

    def _answered(self) -> None:
        """Close the breaker: the backend answered (the probe itself, or a call nested in it, such as a
        lookup inside a single-flight wait that would otherwise hold the probe for minutes)."""
        with self._lock:
            if self.reason is None:
                return
            self.reason = None
            self._pause = 0.0
            self._prober = None
        log.warning("recipecache: backend %s is back", self.url)


class Store:
    def __init__(
        self,
        backend: Backend,
        settings: StoreSettings,
        *,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` paces the circuit breaker (:class:`Breaker`)."""
        self.backend = backend
        self.settings = settings
        self.namespace = settings.namespace
        self.events = events if events is not None else EventLog.from_env()
        self._stats = Stats()
        self._flight = SingleFlight(backend, ttl=settings.lease_ttl)
        self._clock = clock
        #: a circuit breaker per failure domain of the backend (None: the whole backend)
        self._breakers: dict[str | None, Breaker] = {}
        self._breakers_lock = threading.Lock()
        self.node = (
            None
            if settings.node_dir is None
            else NodeTier(
                settings.node_dir,
                store=backend.identity,
                max_size=settings.node_max_size,
                lease_ttl=settings.lease_ttl,
                wait_timeout=settings.wait_timeout,
                stats=self._stats,
            )
        )

    @classmethod
    def open(cls, settings: StoreSettings, *, events: EventLog | None = None, **backend_defaults: object) -> Store:
        """A store on the backend ``settings.url`` names; ConfigError for a malformed URL or unusable directory.

        ``backend_defaults`` are backend options unless the URL sets them (doctor's short
        ``timeout``; see :func:`~recipecache.backends.open_backend`).
        """
        return cls(open_backend(settings.url, **backend_defaults), settings, events=events)

    @property
    def url(self) -> str:
        return self.backend.url

    # -- degradation ---------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., T], skey: str, *args: Any) -> T:
        """Run ``fn(skey, *args)``, a backend call on storage key ``skey``, through the breaker of the part of the
        backend that serves ``skey``."""
        domain = self.backend.failure_domain(skey)
        with self._breakers_lock:
            breaker = self._breakers.get(domain)
            if breaker is None:
                url = echo(self.backend.url, quote=False)  # the warnings of an open breaker name it
                where = url if domain is None else f"{url} (node {domain})"
                breaker = self._breakers[domain] = Breaker(where, clock=self._clock)
        return breaker.call(what, fn, skey, *args)

    def unavailable(self) -> dict[str, Reason]:
        """The parts of the backend the store leaves alone now (their breaker is open), and why: a cluster node as
        ``host:port``, the whole backend as its URL."""
        with self._breakers_lock:
            breakers = list(self._breakers.items())
        return {
            self.backend.url if domain is None else domain: breaker.reason
            for domain, breaker in breakers
            if breaker.reason is not None
        }

    # -- bytes ---------------------------------------------------------------------
    def _read(self, key: str, *, node: bool = True) -> Lookup:
        """The verified payload, or why not, through the node tier if there is one (and ``node``).

        Deletes entries that are damaged. Counts nothing but bytes.
        """
        if self.node is None or not node:
            return self._fetch(key)[0]
        return self.node.read(
            storage_key(self.namespace, key),
            functools.partial(self.open_entry, key),
            functools.partial(self._fetch_verified, key),
            self._node_hit,
        )

    def open_entry(self, key: str, blob: Buffer) -> memoryview:
        """The payload of ``blob`` filed under ``key``; VerificationError unless every check passes."""
        return envelope.open_envelope(blob, key=key, namespace=self.namespace, secret=self.settings.secret)[1]

    def _node_hit(self, payload: memoryview) -> Lookup:
        self._stats.count("bytes_read", len(payload))
        return Lookup(payload)

    def _fetch_verified(self, key: str) -> tuple[Lookup, Buffer | None]:
        """The backend's answer, and the envelope as stored only if it verified (what the node tier may copy)."""
        result, blob = self._fetch(key)
        return result, blob if result.data is not None else None

    def _fetch(self, key: str) -> tuple[Lookup, Buffer | None]:
        """The backend's answer (never the node tier's), and the envelope as stored (None when none is), for a
        compare-and-set."""
        skey = storage_key(self.namespace, key)
        try:
            blob = self._call("get", self.backend.get, skey)
        except BackendError as exc:
            return Lookup(None, exc.reason), None
        except VerificationError as exc:  # the backend's own framing of this entry: no bytes to compare
            log.warning("recipecache: refusing entry %s: %s", key, exc)
            return Lookup(None, exc.reason), None
        if blob is None:
            return Lookup(None, Reason.NOT_FOUND), None
        try:
            payload = self.open_entry(key, blob)
        except VerificationError as exc:
            log.warning("recipecache: refusing entry %s: %s", key, exc)
            if exc.reason is Reason.CORRUPT and self._delete_damaged(skey, blob):
                return Lookup(None, exc.reason), None
            return Lookup(None, exc.reason), blob
        self._stats.count("bytes_read", len(payload))
        return Lookup(payload), blob

    def _delete_damaged(self, skey: str, blob: Buffer) -> bool:
        """Delete an entry that is provably damaged, unless it changed since we read ``blob``."""
        try:
            deleted = self._call("delete", self.backend.delete_if, skey, blob)
        except BackendError:
            return False
        if deleted:
            self._stats.count("deleted_bad")
        return deleted

    def _fetch_fresh(self, key: str, stale: Buffer) -> memoryview | None:
        """The value under ``key`` unless it is ``stale``, from the backend itself (the node copy may be what is
        stale); a fresh value replaces the node copy, so the node's other processes see it too."""
        result, blob = self._fetch(key)
        if result.data is None or result.data == stale:
            return None
        if self.node is not None:
            assert blob is not None
            self.node.publish(storage_key(self.namespace, key), blob)
        return result.data

    def lookup(self, key: str, *, trace: bool = True, node: bool = True, kind: str | None = None) -> Lookup:
        """The verified artifact under ``key``, or None and the counted miss reason.

        ``trace=False`` keeps the lookup out of the event log (which the simulator replays
        as the job's compile keys); it is counted in :meth:`stats` all the same.
        ``node=False`` reads the backend even with a node tier: for entries rewritten under
        the same key (merged PGO state, an index), whose node copy would go stale.
        ``kind`` (what the caller looks up: ``fx``, ``aot``...) counts the outcome under it
        as well (``stats()["by_kind"]``); a hit the caller cannot use is
        :meth:`record_unused_hit`.
        """
        result = self._traced_read(key, trace=trace, node=node)
        self._stats.outcome(kind, result.reason)
        return result

    def _traced_read(self, key: str, *, trace: bool, node: bool = True) -> Lookup:
        """:meth:`_read`, and its hit or miss in the event log (when ``trace``); the caller counts the outcome."""
        start = time.perf_counter()
        result = self._read(key, node=node)
        if trace:
            if result.data is None:
                self.events.record("miss", key, time.perf_counter() - start, reason=result.reason)
            else:
                self.events.record("hit", key, time.perf_counter() - start, bytes=len(result.data))
        return result

    def get(self, key: str, *, trace: bool = True, node: bool = True) -> memoryview | None:
        """The verified artifact under ``key`` (a read-only view), or None (a miss, counted by reason)."""
        return self.lookup(key, trace=trace, node=node).data

    def _seal(self, key: str, data: Buffer, meta: dict[str, Any] | None = None) -> bytes:
        return envelope.seal_header(key, data, namespace=self.namespace, secret=self.settings.secret, meta=meta)

    def _published(self, key: str, data: Buffer, start: float, trace: bool, kind: str | None) -> None:
        self._stats.put(kind, len(data))
        if trace:
            self.events.record("put", key, time.perf_counter() - start, bytes=len(data))

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        trace: bool = True,
        meta: dict[str, Any] | None = None,
        node: bool = True,
        kind: str | None = None,
    ) -> bool:
        """Publish ``data`` under ``key``; False (logged and counted, never raised) if the backend failed.

        The envelope's header and ``data`` go to the backend as two buffers: ``data`` is
        never copied to join them. ``meta`` says what the entry is (kind, function, shapes,
        compile seconds) for ``recipecache ls``: a small map of scalars
        (:func:`recipecache.envelope.check_meta`). With a node tier the entry goes to the
        node directory too (first: the node's other processes read it there even if the
        backend fails), unless ``node=False``. ``kind`` counts the put under it as well
        (``stats()["by_kind"]``), as for :meth:`lookup`.
        """
        start = time.perf_counter()
        data = byte_view(data)
        skey = storage_key(self.namespace, key)
        header = self._seal(key, data, meta)
        if self.node is not None and node:
            self.node.publish(skey, header, data)
        try:
            self._call("put", self.backend.put, skey, header, data)
        except BackendError as exc:
            self._stats.reason("put_failures", exc.reason)
            return False
        self._published(key, data, start, trace, kind)
        return True

    def update(
        self,
        key: str,
        change: Callable[[memoryview | None], Buffer | None],
        *,
        attempts: int = UPDATE_ATTEMPTS,
        trace: bool = False,
        meta: dict[str, Any] | None = None,
        node: bool = False,
        kind: str | None = None,
    ) -> Lookup:
        """Replace the value under ``key`` with ``change(current)``, atomically against other updates.

        ``current`` is the verified payload, or None if there is none this store accepts
        (absent, refused, damaged: then the new value replaces it). ``change`` may be
        called several times (once per attempt) and must only compute; returning None
        writes nothing. The write is a compare-and-set on the envelope read: if another
        process wrote meanwhile, the update is retried on what it wrote, after a short
        random backoff, up to ``attempts`` times.

        ``meta`` describes the value written and ``kind`` counts it, as for :meth:`put`.

        The read is always the backend's, never a node copy (which may be stale). The value
        written goes to the node directory only with ``node=True``: for entries whose
        readers check what they get and read the backend when a copy does not fit (graph
        guard variants, :meth:`begin` with ``stale``); state read as it is (PGO decisions,
        an index) must be read with ``node=False`` and never copied to a node.

        Returns the value written (or, when ``change`` returned None, what is there), or
        None and the reason: the backend's failure, or ``conflict`` after ``attempts``
        lost races. Both are counted under ``put_failures``; nothing is raised but what
        ``change`` raises.
        """
        start = time.perf_counter()
        skey = storage_key(self.namespace, key)
        copy_to = self.node if node else None
        with copy_to.rewriting(skey) if copy_to is not None else contextlib.nullcontext():
            for attempt in range(attempts):
                current, stored = self._fetch(key)
                if current.failed:
                    assert current.reason is not None
                    self._stats.reason("put_failures", current.reason)
                    return current
                new = change(current.data)
                if new is None:
                    return current
                new = byte_view(new)
                header = self._seal(key, new, meta)
                try:
                    written = self._call("put", self.backend.put_if, skey, stored, header, new)
                except BackendError as exc:
                    self._stats.reason("put_failures", exc.reason)
                    return Lookup(None, exc.reason)
                if written:
                    if copy_to is not None:
                        copy_to.publish(skey, header, new)
                    self._published(key, new, start, trace, kind)
                    return Lookup(memoryview(new).toreadonly())
                self._stats.count("update_conflicts")
                time.sleep(random.uniform(0, min(_UPDATE_BACKOFF_MAX_S, _UPDATE_BACKOFF_S * 2**attempt)))
        self._stats.reason("put_failures", Reason.CONFLICT)
        return Lookup(None, Reason.CONFLICT)

    # -- single flight -------------------------------------------------------------
    def begin(
        self,
        key: str,
        *,
        wait_timeout: float | None = None,
        stale: Buffer | None = None,
        stale_reason: Reason = Reason.GUARD_REJECTED,
        trace: bool = True,
        kind: str | None = None,
        wait: bool = True,
    ) -> Flight:
        """Look ``key`` up; on a miss either wait for the process compiling it or become its compiler.

        The lookup's outcome is counted once, when the flight's role is known: a hit, a
        follower's artifact (a hit that waited), or a miss for the first lookup's reason
        (leader, or a fallback, also counted as such); under ``kind`` too, which the flight
        keeps for its :meth:`Flight.publish`. A value the caller then cannot use is
        :meth:`record_unused_hit`.

        ``stale`` is a value the caller already read under ``key`` and cannot use (none of
        the guard variants it holds fits, or it is malformed), for ``stale_reason`` (a miss in
        the event log). While the key holds exactly that value it counts as missing: the
        caller takes the lease and compiles what it needs, or waits for the lease holder to
        publish something else. The caller counted its own lookup, so this one counts no
        outcome: the caller settles it (:meth:`record_unused_hit` once, if it uses none of
        the values). With ``stale`` the backend itself is read, never a node copy (the stale
        value may be that copy), and what it holds refreshes the node copy. ``trace=False`` keeps the
        flight (lookup, wait, compile start, publish) out of the event log, as for :meth:`lookup`.
        ``wait=False``: when another process holds the lease, return at once with role ``busy``
        (no data, no lease) instead of waiting for its artifact: for callers that have
        something else to run meanwhile (no-stall) and look again later (:meth:`compiling`).
        """
        if stale is None:
            first = self._traced_read(key, trace=trace)
            if first.data is not None:
                self._stats.outcome(kind, None)
                return Flight(self, key, Role.HIT, data=first.data, trace=trace, kind=kind)
            miss = first.reason
            if first.failed:  # the backend failed: no lease to take
                assert first.reason is not None  # a failed lookup names its failure
                self._stats.outcome(kind, miss)
                return self._fallback(key, first.reason, miss_reason=miss, trace=trace, kind=kind)
        else:
            miss = stale_reason
            if trace:
                self.events.record("miss", key, reason=stale_reason)

        def settle(hit: bool) -> None:
            """Count the lookup's outcome (a stale lookup's is the caller's)."""
            if stale is None:
                self._stats.outcome(kind, None if hit else miss)

        timeout = 0.0 if not wait else self.settings.wait_timeout if wait_timeout is None else wait_timeout

        def fetch() -> memoryview | None:
            return self._read(key).data if stale is None else self._fetch_fresh(key, stale)

        try:
            outcome = self._call("lease", self._flight.run, storage_key(self.namespace, key), fetch, timeout)
        except BackendError as exc:
            settle(False)
            return self._fallback(key, exc.reason, miss_reason=miss, trace=trace, kind=kind)
        if not wait and outcome.role is Role.TIMEOUT:
            settle(False)
            self._stats.count("busy")
            return Flight(self, key, Role.BUSY, miss_reason=miss, trace=trace, kind=kind)
        if outcome.waited_s and wait:
            self._stats.count("waits")
            self._stats.add_seconds("wait_s", outcome.waited_s)
            if trace:
                self.events.record("wait", key, outcome.waited_s)
        settle(outcome.role is Role.FOLLOWER)
        if outcome.role is Role.TIMEOUT:
            return self._fallback(
                key, Reason.WAIT_TIMEOUT, waited_s=outcome.waited_s, miss_reason=miss, trace=trace, kind=kind
            )
        if outcome.role is Role.FOLLOWER:
            self._stats.count("follower")
            return Flight(
                self,
                key,
                Role.FOLLOWER,
                data=outcome.value,
                waited_s=outcome.waited_s,
                miss_reason=miss,
                trace=trace,
                kind=kind,
            )
        self._stats.count("leader")
        if outcome.takeover:
            self._stats.count("takeovers")
            if trace:
                self.events.record("takeover", key)
        if trace and wait:  # wait=False: the caller says where it compiles (no-stall: behind the steps)
            self.events.record("compile_start", key)
        return Flight(
            self,
            key,
            Role.LEADER,
            lease=outcome.lease,
            waited_s=outcome.waited_s,
            miss_reason=miss,
            trace=trace,
            kind=kind,
        )

    def compiling(self, key: str) -> bool:
        """Whether a live lease on ``key`` says another process is compiling it now (False if the backend failed).

        One lease read, nothing counted: cheap enough for a ``busy`` caller to ask every
        half second before it looks the key up again.
        """
        try:
            held = self._call("lease", self.backend.lease_holder, storage_key(self.namespace, key))
        except BackendError:
            return False
        return held is not None and held.remaining_s > 0

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
        self._stats.reason("fallback", reason)
        if trace:
            self.events.record("fallback", key, reason=reason)
        return Flight(
            self, key, Role.FALLBACK, reason=reason, waited_s=waited_s, miss_reason=miss_reason, trace=trace, kind=kind
        )

    def get_or_compile(
        self, key: str, compile_fn: Callable[[], Buffer], *, wait_timeout: float | None = None
    ) -> memoryview:
        """The artifact for ``key`` (a read-only view), compiled by exactly one process across the job when possible."""
        with self.begin(key, wait_timeout=wait_timeout) as flight:
            if flight.data is not None:
                return flight.data
            start = time.perf_counter()
            data = compile_fn()
            self.record_compile(key, time.perf_counter() - start)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"compile_fn must return bytes, not {type(data).__name__}")
            data = bytes(data)
            flight.publish(data)
            return memoryview(data)

    def record_compile(self, key: str | None, seconds: float) -> None:
        """Count a compile this process ran (integrations that compile outside get_or_compile call it).

        ``key`` None: a compile of something the store was never asked for (torch bypassed
        its cache for that graph); it is counted, but kept out of the trace, whose keys the
        simulator replays.
        """
        self._stats.count("compiles")
        self._stats.add_seconds("compile_s", seconds)
        if key is not None:
            self.events.record("compile", key, seconds)

    def record_unused_hit(self, key: str, reason: Reason, *, kind: str | None = None, trace: bool = True) -> None:
        """A hit served under ``key`` (:meth:`lookup`, :meth:`begin`) was not used after all: a miss for ``reason``.

        The one call for it (a malformed artifact, kernels that would not install, torch's
        guards rejecting it, a precompiled verdict meaning "run the normal path"): the hit
        counted for the lookup becomes a miss, under the lookup's ``kind``, once per lookup.
        ``trace`` records the miss in the event log (False: the lookup was not traced, or a
        ``begin(stale=...)`` recorded it already).
        """
        self._stats.unused_hit(kind, reason)
        if trace:
            self.events.record("miss", key, reason=reason)

    def record_redirected_hit(self, *, kind: str | None = None) -> None:
        """A hit served was for another version of what the caller needs, which it looks up under another key.

        That lookup's outcome is this one's, so the hit is withdrawn, not turned into a miss
        (the precompiled tier: an artifact of other code, and one under the key naming this
        process's code).
        """
        self._stats.unused_hit(kind, None)

    # -- admin: whole-store operations on raw entries (recipecache.tools.admin builds on these) --
    # They talk to the backend directly, outside the circuit breaker: an operator wants
    # the backend's error (BackendError), not a silent fallback. ``node=True`` does the same
    # on the node directory's copies of this store's entries (none without a node tier), each
    # named by the store's key of it: what a job of this store may be served on this node.
    def _raw(self, storage_key: str, node: bool) -> tuple[Backend, str]:
        """The backend an admin operation on ``storage_key`` goes to, and its key there."""
        if not node:
            return self.backend, storage_key
        assert self.node is not None, "node copies are listed by scan(node=True), which has none without a node tier"
        return self.node.backend, self.node.copy_key(storage_key)

    def scan(self, *, all_namespaces: bool = False, node: bool = False) -> list[EntryInfo]:
        """Entries of this store's namespace (or of every namespace) as the backend lists them (``node``: the node
        directory's copies of them)."""
        namespace = None if all_namespaces else self.namespace
        if node:
            return [] if self.node is None else list(self.node.copies(namespace))
        return list(self.backend.scan(namespace))

    def read_raw(self, storage_key: str, *, node: bool = False) -> Buffer | None:
        """The raw envelope filed under a backend key from :meth:`scan` (unverified: admin tools verify).

        Raises VerificationError where the backend's own framing of the entry is damaged.
        """
        backend, name = self._raw(storage_key, node)
        return backend.get(name)

    def write_raw(self, storage_key: str, blob: Buffer) -> None:
        """File a raw envelope under a backend key (import writes what it verified)."""
        self.backend.put(storage_key, blob)

    def delete_raw(self, storage_key: str, *, node: bool = False) -> None:
        backend, name = self._raw(storage_key, node)
        backend.delete(name)

    def delete_raw_if(self, storage_key: str, blob: Buffer | None, *, node: bool = False) -> bool:
        """Delete the entry under ``storage_key`` only if it still is ``blob`` (what the caller read and found
        damaged); False, nothing deleted, if it was rewritten or removed meanwhile.

        ``blob`` None: the backend's own framing of the entry was damaged, so there are no bytes
        to compare; it is deleted only if it reads as damaged still, just before.
        """
        backend, name = self._raw(storage_key, node)
        if blob is not None:
            return backend.delete_if(name, blob)
        try:
            backend.get(name)
        except VerificationError as exc:
            if exc.reason is Reason.CORRUPT:
                backend.delete(name)
                return True
        return False

    def storage_key(self, key: str) -> str:
        """The backend key of caller key ``key`` in this store's namespace (what :meth:`scan` lists)."""
        return storage_key(self.namespace, key)

    def write_sealed(self, key: str, data: Buffer) -> None:
        """Seal (and sign) ``data`` under ``key`` as :meth:`put` does and write it, raising BackendError.

        For operator checks (``recipecache doctor``'s round trip) that want the backend's own
        error, and no node copy, stats or event.
        """
        data = byte_view(data)
        self.backend.put(self.storage_key(key), self._seal(key, data), data)

    def lease_is_exclusive(self, key: str, ttl: float = 30.0) -> bool:
        """Take a lease on ``key``, try it again as another owner, release it: True when only the first got it.

        Single-flight rests on this (without it every rank compiles every graph); doctor
        asks it of the backend itself, BackendError raised.
        """
        name, token = self.storage_key(key), secrets.token_hex(8)
        taken = self.backend.lease_add(name, token, ttl)
        again = self.backend.lease_add(name, "someone-else", ttl)
        self.backend.lease_release(name, token)
        return taken and not again

    def health_checks(self, key: str) -> list[HealthCheck]:
        """The backend's own checks (:meth:`Backend.health_checks`), probing under ``key``."""
        return self.backend.health_checks(self.storage_key(key))

    def discover(self) -> None:
        """ConfigError when the URL names no usable service at all (a cluster none of whose seeds answers).

        The CLI asks before an operation, so that such a URL is bad input, not a run of failures.
        """
        self.backend.discover()

    def evict(self, max_bytes: int) -> int:
        """Delete least-recently-used entries (of every namespace) down to ``max_bytes``; returns bytes freed."""
        return self.backend.evict(max_bytes)

    def vacuum(self, *, all_namespaces: bool = False) -> int:
        """Remove coordination leftovers (stale temp files, expired leases, idle lease locks); returns how many."""
        return self.backend.vacuum(None if all_namespaces else self.namespace)

    def stats(self) -> dict[str, Any]:
        out = self._stats.snapshot()
        out.update(
            url=self.backend.url,
            namespace=self.namespace,
            signed=self.settings.secret is not None,
            node_dir=None if self.node is None else str(self.node.directory),
        )
        return out

    def close(self) -> None:
        self.events.close()
        self.backend.close()
        if self.node is not None:
            self.node.close()


def open_store(
    url: str | None = None,
    *,
    namespace: str | None = None,
    secret: str | bytes | None = None,
) -> Store:
    """Open the store ``url`` names (None: ``$RECIPECACHE_URL`` or the filesystem default).

    Raises :class:`~recipecache.errors.ConfigError` for a malformed URL or unusable
    directory; a backend that is merely unreachable is not an error here (the store
    degrades at use).
    """
    return Store.open(StoreSettings.resolve(url, namespace=namespace, secret=secret))
