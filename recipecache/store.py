"""The store: envelopes, verification, stats and degradation on top of one backend.

The store is what training code talks to. Its promises:

* ``get`` returns verified bytes or None. A damaged entry is deleted and counted as a
  ``corrupt`` miss; with a secret configured an unsigned or badly signed entry is
  refused (and deleted) the same way, so nothing that failed verification ever reaches a
  caller that would load it.
* ``get_or_compile`` runs the caller's compile at most once per key across processes
  and hosts (single-flight, :mod:`recipecache.lease`), except when the backend cannot
  help, in which case it compiles locally.
* With a node directory (``RECIPECACHE_NODE_DIR``, :mod:`recipecache.node_tier`) lookups
  go through it: one process per node reads each entry from the backend, the node's
  other processes read the verified copy it leaves there; puts go to both.
* Nothing a backend does (down, slow, full, corrupt) raises into the caller. A failure
  opens a short circuit breaker: for ``retry_after`` seconds the backend is not asked at
  all (each skipped call still counts under the failure's reason), so an outage costs
  one timeout, not one per lookup.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import envelope
from .backends.base import Backend, EntryInfo
from .backends import open_backend
from .settings import StoreSettings
from .errors import BackendError, VerificationError
from .events import EventLog
from .keys import storage_key
from .lease import HeldLease, SingleFlight
from .node_tier import NodeTier
from .reasons import ABSENT, FAILED, REFUSED, Reason, Role
from .stats import Stats

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a failed backend is left alone before the store tries it again.
RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class Lookup:
    """One lookup's answer: verified bytes, or None and why (:mod:`recipecache.reasons`)."""

    data: bytes | None
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
    data: bytes | None = None
    #: why a ``fallback`` compiles without a lease (a backend failure or ``wait_timeout``)
    reason: Reason | None = None
    waited_s: float = 0.0
    #: why the first lookup missed (``not_found``, a refusal such as ``bad_signature``, or a
    #: backend failure); None for a hit
    miss_reason: Reason | None = None
    lease: HeldLease | None = field(default=None, repr=False)

    def publish(self, data: bytes) -> bool:
        """Store ``data`` and release the lease; False if the backend did not take it."""
        stored = self.store.put(self.key, data)
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


class Store:
    def __init__(self, backend: Backend, settings: StoreSettings, *, events: EventLog | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.namespace = settings.namespace
        self.events = events if events is not None else EventLog.from_env()
        self._stats = Stats()
        self._flight = SingleFlight(backend, ttl=settings.lease_ttl)
        self._lock = threading.Lock()
        self._broken_until = 0.0
        self._broken_reason: Reason | None = None
        self.node = None if settings.node_dir is None else NodeTier(
            settings.node_dir, max_size=settings.node_max_size, lease_ttl=settings.lease_ttl,
            wait_timeout=settings.wait_timeout, stats=self._stats)

    @property
    def url(self) -> str:
        return self.backend.url

    # -- degradation ---------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run a backend call; raise BackendError at once while the breaker is open."""
        with self._lock:
            if self._broken_reason is not None:
                if time.monotonic() < self._broken_until:
                    raise BackendError(self._broken_reason, "backend unavailable (retrying later)")
                log.info("recipecache: retrying backend %s", self.backend.url)
        try:
            result = fn(*args)
        except BackendError as exc:
            with self._lock:
                first = self._broken_reason is None
                self._broken_reason = exc.reason
                self._broken_until = time.monotonic() + RETRY_AFTER_S
            if first:
                log.warning(
                    "recipecache: %s failed on %s (%s: %s); compiling locally, retrying the cache in %.0f s",
                    what, self.backend.url, exc.reason, exc, RETRY_AFTER_S,
                )
            raise
        with self._lock:
            if self._broken_reason is not None:
                log.warning("recipecache: backend %s is back", self.backend.url)
                self._broken_reason = None
        return result

    # -- bytes ---------------------------------------------------------------------
    def _read(self, key: str, *, node: bool = True) -> Lookup:
        """The verified payload, or why not, through the node tier if there is one (and ``node``). Counts nothing but bytes."""
        if self.node is None or not node:
            result = self._read_remote(key)[0]
        else:
            result = self.node.read(storage_key(self.namespace, key), functools.partial(self._open, key),
                                    functools.partial(self._read_remote, key), Lookup)
        if result.data is not None:
            self._stats.count("bytes_read", len(result.data))
        return result

    def _open(self, key: str, blob: bytes) -> bytes:
        """The payload of ``blob`` filed under ``key``; VerificationError unless every check passes."""
        return envelope.open_envelope(blob, key=key, secret=self.settings.secret)[1]

    def _read_remote(self, key: str) -> tuple[Lookup, bytes | None]:
        """The backend's answer, and for a hit the verified envelope as stored; deletes entries that fail verification."""
        skey = storage_key(self.namespace, key)
        try:
            blob = self._call("get", self.backend.get, skey)
        except BackendError as exc:
            return Lookup(None, exc.reason), None
        if blob is None:
            return Lookup(None, Reason.NOT_FOUND), None
        try:
            payload = self._open(key, blob)
        except VerificationError as exc:
            log.warning("recipecache: refusing entry %s: %s", key, exc)
            self._stats.count("deleted_bad")
            try:
                self._call("delete", self.backend.delete, skey)
            except BackendError:
                pass
            return Lookup(None, exc.reason), None
        return Lookup(payload), blob

    def lookup(self, key: str, *, trace: bool = True, node: bool = True) -> Lookup:
        """The verified artifact under ``key``, or None and the counted miss reason.

        ``trace=False`` keeps the lookup out of the event log (which the simulator replays
        as the job's compile keys); it is counted in :meth:`stats` all the same.
        ``node=False`` reads the backend even with a node tier: for entries rewritten under
        the same key (merged PGO state, an index), whose node copy would go stale.
        """
        start = time.perf_counter()
        result = self._read(key, node=node)
        if result.reason is not None:
            self._stats.reason("misses", result.reason)
            if trace:
                self.events.record("miss", key, time.perf_counter() - start, reason=result.reason)
        else:
            assert result.data is not None
            self._stats.count("hits")
            if trace:
                self.events.record("hit", key, time.perf_counter() - start, bytes=len(result.data))
        return result

    def get(self, key: str, *, trace: bool = True, node: bool = True) -> bytes | None:
        """The verified artifact under ``key``, or None (a miss, counted by reason)."""
        return self.lookup(key, trace=trace, node=node).data

    def put(self, key: str, data: bytes, *, trace: bool = True, node: bool = True) -> bool:
        """Publish ``data`` under ``key`` (and in the node directory, unless ``node=False``);
        False (logged and counted, never raised) if the backend failed."""
        start = time.perf_counter()
        blob = envelope.seal(key, data, secret=self.settings.secret)
        skey = storage_key(self.namespace, key)
        if self.node is not None and node:  # the node's other processes read it there (even if the backend fails)
            self.node.publish(skey, blob)
        try:
            self._call("put", self.backend.put, skey, blob)
        except BackendError as exc:
            self._stats.reason("put_failures", exc.reason)
            return False
        self._stats.count("puts")
        self._stats.count("bytes_written", len(data))
        if trace:
            self.events.record("put", key, time.perf_counter() - start, bytes=len(data))
        return True

    # -- single flight -------------------------------------------------------------
    def begin(self, key: str, *, wait_timeout: float | None = None) -> Flight:
        """Look ``key`` up; on a miss either wait for the process compiling it or become its compiler."""
        first = self.lookup(key)
        if first.data is not None:
            return Flight(self, key, Role.HIT, data=first.data)
        miss = first.reason
        if first.failed:
            return self._fallback(key, first.reason, miss_reason=miss)  # the backend failed: no lease to take
        timeout = self.settings.wait_timeout if wait_timeout is None else wait_timeout
        try:
            outcome = self._call(
                "lease", self._flight.run, storage_key(self.namespace, key), lambda: self._read(key).data, timeout
            )
        except BackendError as exc:
            return self._fallback(key, exc.reason, miss_reason=miss)
        if outcome.waited_s:
            self._stats.count("waits")
            self._stats.add_seconds("wait_s", outcome.waited_s)
            self.events.record("wait", key, outcome.waited_s)
        if outcome.role is Role.TIMEOUT:
            return self._fallback(key, Reason.WAIT_TIMEOUT, waited_s=outcome.waited_s, miss_reason=miss)
        if outcome.role is Role.FOLLOWER:
            self._stats.count("follower")
            self._stats.count("hits")
            return Flight(self, key, Role.FOLLOWER, data=outcome.value, waited_s=outcome.waited_s, miss_reason=miss)
        self._stats.count("leader")
        if outcome.takeover:
            self._stats.count("takeovers")
            self.events.record("takeover", key)
        return Flight(self, key, Role.LEADER, lease=outcome.lease, waited_s=outcome.waited_s, miss_reason=miss)

    def _fallback(self, key: str, reason: Reason, *, miss_reason: Reason | None, waited_s: float = 0.0) -> Flight:
        self._stats.reason("fallback", reason)
        self.events.record("fallback", key, reason=reason)
        return Flight(self, key, Role.FALLBACK, reason=reason, waited_s=waited_s, miss_reason=miss_reason)

    def get_or_compile(self, key: str, compile_fn: Callable[[], bytes], *, wait_timeout: float | None = None) -> bytes:
        """The artifact for ``key``, compiled by exactly one process across the job when possible."""
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
            return data

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

    def record_unused_hit(self, key: str, reason: Reason) -> None:
        """A hit served under ``key`` was not used after all (``reason``, e.g. torch's guards rejected it): a miss."""
        self._stats.count("hits", -1)
        self._stats.reason("misses", reason)
        self.events.record("miss", key, reason=reason)

    # -- admin: whole-store operations on raw entries (recipecache.admin builds on these) --
    # They talk to the backend directly, outside the circuit breaker: an operator wants
    # the backend's error (BackendError), not a silent fallback.
    def scan(self, *, all_namespaces: bool = False) -> list[EntryInfo]:
        """Entries of this store's namespace (or of every namespace) as the backend lists them."""
        return list(self.backend.scan(None if all_namespaces else self.namespace))

    def read_raw(self, storage_key: str) -> bytes | None:
        """The raw envelope filed under a backend key from :meth:`scan` (unverified: admin tools verify)."""
        return self.backend.get(storage_key)

    def write_raw(self, storage_key: str, blob: bytes) -> None:
        """File a raw envelope under a backend key (import writes what it verified)."""
        self.backend.put(storage_key, blob)

    def delete_raw(self, storage_key: str) -> None:
        self.backend.delete(storage_key)

    def evict(self, max_bytes: int) -> int:
        """Delete least-recently-used entries (of every namespace) down to ``max_bytes``; returns bytes freed."""
        return self.backend.evict(max_bytes)

    def vacuum(self, *, all_namespaces: bool = False) -> int:
        """Remove coordination leftovers (stale temp files, expired leases, idle lease locks); returns how many."""
        return self.backend.vacuum(None if all_namespaces else self.namespace)

    def stats(self) -> dict[str, Any]:
        out = self._stats.snapshot()
        out.update(url=self.backend.url, namespace=self.namespace, signed=self.settings.secret is not None,
                   node_dir=None if self.node is None else str(self.node.directory))
        return out

    def close(self) -> None:
        self.events.close()
        self.backend.close()


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
    settings = StoreSettings.resolve(url, namespace=namespace, secret=secret)
    return Store(open_backend(settings.url), settings)
