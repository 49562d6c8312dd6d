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
  opens a circuit breaker (:class:`~recipecache.breaker.Breaker`): for a while the backend is not asked at all
  (each skipped call still counts under the failure's reason), then one call probes it;
  each failed probe doubles the pause, so an outage costs a few timeouts in all, not one
  per lookup. There is one breaker per part of the backend that fails alone
  (:meth:`~recipecache.backends.base.Backend.failure_domain`: a Redis Cluster primary), so a
  dead node pauses its own keys only. A failure of one key
  (:class:`~recipecache.errors.BackendKeyError`) is that key's miss and leaves the breaker closed.

This is the training face. Its parts: :mod:`recipecache.entries` seals and verifies
envelopes, :mod:`recipecache.flight` single flight (:meth:`Store.begin`),
:mod:`recipecache.breaker` the circuit breakers. An operator's whole-store operations on
entries as stored are :class:`~recipecache.store_admin.StoreAdmin`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from .backends import open_backend
from .backends.base import Backend
from .breaker import Breakers
from .buffers import Buffer, byte_view
from .entries import UPDATE_ATTEMPTS, Entries, Lookup
from .errors import BackendError
from .eventlog import EventLog
from .flight import Flight, Flights
from .keys import storage_key
from .lease import SingleFlight
from .node_tier import NodeTier
from .reasons import Reason
from .settings import StoreSettings
from .stats import Stats

__all__ = ["Flight", "Lookup", "Store", "open_store"]


class Store:
    def __init__(
        self,
        backend: Backend,
        settings: StoreSettings,
        *,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` paces the circuit breakers (:class:`~recipecache.breaker.Breakers`)."""
        self.backend = backend
        self.settings = settings
        self.namespace = settings.namespace
        self.events = events if events is not None else EventLog.from_env()
        self._stats = Stats()
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
        self._breakers = Breakers(backend, clock=clock)
        #: this store's envelopes: sealed, verified, read through the node tier
        self.entries = Entries(
            backend, self.namespace, settings.secret, breakers=self._breakers, node=self.node, stats=self._stats
        )
        self._flights = Flights(
            self,
            self.entries,
            read=self._traced_read,
            leases=SingleFlight(backend, ttl=settings.lease_ttl),
            breakers=self._breakers,
            stats=self._stats,
            events=self.events,
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

    def unavailable(self) -> dict[str, Reason]:
        """The parts of the backend the store leaves alone now (their breaker is open), and why: a cluster node as
        ``host:port``, the whole backend as its URL."""
        return self._breakers.unavailable()

    # -- bytes ---------------------------------------------------------------------
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
        """A read of ``key`` (:meth:`Entries.read <recipecache.entries.Entries.read>`), and its hit or miss in the event
        log (when ``trace``); the caller counts the outcome."""
        start = time.perf_counter()
        result = self.entries.read(key, node=node)
        if trace:
            if result.data is None:
                self.events.record("miss", key, time.perf_counter() - start, reason=result.reason)
            else:
                self.events.record("hit", key, time.perf_counter() - start, bytes=len(result.data))
        return result

    def get(self, key: str, *, trace: bool = True, node: bool = True) -> memoryview | None:
        """The verified artifact under ``key`` (a read-only view), or None (a miss, counted by reason)."""
        return self.lookup(key, trace=trace, node=node).data

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
        header = self.entries.seal(key, data, meta)
        if self.node is not None and node:
            self.node.publish(skey, header, data)
        try:
            self._breakers.call("put", self.backend.put, skey, header, data)
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
            done = self.entries.update(key, change, meta=meta, attempts=attempts)
            if done.header is not None:
                assert done.value.data is not None
                if copy_to is not None:
                    copy_to.publish(skey, done.header, done.value.data)
                self._published(key, done.value.data, start, trace, kind)
        self._stats.count("update_conflicts", done.conflicts)
        if done.failed:
            assert done.value.reason is not None
            self._stats.reason("put_failures", done.value.reason)
        return done.value

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

        ``wait_timeout`` bounds the wait (default: the settings'; none with ``wait=False``);
        :meth:`Flights.begin <recipecache.flight.Flights.begin>` says what the others do.
        """
        timeout = 0.0 if not wait else self.settings.wait_timeout if wait_timeout is None else wait_timeout
        return self._flights.begin(
            key, timeout=timeout, stale=stale, stale_reason=stale_reason, trace=trace, kind=kind, wait=wait
        )

    def compiling(self, key: str) -> bool:
        """Whether a live lease on ``key`` says another process is compiling it now (False if the backend failed).

        One lease read, nothing counted: cheap enough for a ``busy`` caller to ask every
        half second before it looks the key up again.
        """
        try:
            held = self._breakers.call("lease", self.backend.lease_holder, storage_key(self.namespace, key))
        except BackendError:
            return False
        return held is not None and held.remaining_s > 0

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
