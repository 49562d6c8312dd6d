"""The one small interface every backend implements: bytes under keys, plus a lease primitive.

Backends know nothing of envelopes, stats or torch. Keys are ``<namespace>/<hex>``
strings built by the store (:func:`recipecache.keys.storage_key`); lease names are keys
too. A backend must

* publish atomically: a reader sees the old value, the new value or nothing, never a
  partial value. A value is given as one or more buffers (:data:`~recipecache.buffers.Buffer`)
  and stored as their concatenation, so writers need not join them; ``get`` may return any
  buffer (``bytes``, or a ``memoryview`` of what it read) and callers must not assume ``bytes``;
* raise :class:`~recipecache.errors.BackendError` with a counted reason for any failure
  of the service itself (down, slow, full, I/O error), since the store answers a
  ``BackendError`` by leaving the backend alone for a while (its circuit breaker); a
  failure that concerns the keys of one call only (a Redis key of another type, a hash
  slot in migration) is a :class:`~recipecache.errors.BackendKeyError`, that key's miss,
  which leaves the breaker closed;
* raise :class:`~recipecache.errors.VerificationError` from ``get`` when the value under
  one key is damaged in the backend's own framing (a Redis chunk manifest that does not
  parse or does not fit its chunks, a key of the wrong Redis type): reason ``corrupt``,
  counted by the store like a damaged envelope; or ``old_format`` for the framing of an
  earlier version that this one recognises but does not read. Such a value is a miss for
  this key only; the store cannot compare it (it holds no bytes of it), so it leaves it to
  the next ``put``, which replaces it, or to an operator's ``verify --fix``. Backends that
  store values as they are given (memory, filesystem) never raise it;
* offer two conditional writes, each atomic against every other conditional write of the
  key: :meth:`~Backend.delete_if` (compare-and-delete) and :meth:`~Backend.put_if`
  (compare-and-set). They compare with the value ``get`` returns, byte for byte, so any
  caller can use them without knowing the backend; ``expected=None`` means "``get`` gives
  no bytes" (nothing stored, or a value it reports as damaged or old framing). A plain
  ``put`` racing with a conditional write is last-writer-wins, as two plain puts are (the
  filesystem cannot order a rename against another process's compare): keys that are
  read-modify-written go through ``put_if`` only, and ``delete_if`` keeps a value a plain
  ``put`` published meanwhile;
* implement leases as an atomic *add-with-expiry* (the one lock primitive, as in
  python-diskcache) plus compare-and-renew and compare-and-delete on the owner token.
  An expired lease counts as absent, so a dead holder's lease is taken over. Waiters
  read who holds a lease (:meth:`~Backend.lease_holder`) and, where the backend can,
  block until its holder releases it (:meth:`~Backend.lease_wait`) instead of polling.
"""

from __future__ import annotations

import re
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..buffers import Buffer
from ..errors import ConfigError
from ..health import HealthCheck

if TYPE_CHECKING:
    from .url import StoreURL

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}/[0-9a-f]{8,128}\Z")

Clock = Callable[[], float]


@dataclass(frozen=True)
class EntryInfo:
    """What a backend knows about one stored value without reading it."""

    key: str
    size: int
    #: last access (filesystem) or 0.0 where the backend does not track it
    atime: float


@dataclass(frozen=True)
class LeaseState:
    """Who holds a lease (its owner token) and for how much longer."""

    token: str
    #: seconds until the lease expires; <= 0 for an expired lease the backend still keeps
    remaining_s: float


def is_key(key: str) -> bool:
    """Whether ``key`` has the ``<namespace>/<hex>`` shape of every key the store writes."""
    return _KEY.match(key) is not None


def check_key(key: str) -> str:
    """Refuse keys that are not ``<namespace>/<hex>``: they could escape a directory."""
    if not is_key(key):
        raise ConfigError(f"bad backend key {key!r}")
    return key


def value_matches(stored: Buffer | None, expected: Buffer | None) -> bool:
    """The comparison of the conditional writes: both absent (None), or byte-for-byte equal.

    Compares slices as ``bytes`` (``memcmp``): ``memoryview == memoryview`` goes element
    by element, about seven times slower.
    """
    if stored is None or expected is None:
        return stored is None and expected is None
    a, b = memoryview(stored), memoryview(expected)
    if a.nbytes != b.nbytes:
        return False
    step = 1 << 20
    return all(a[i : i + step].tobytes() == b[i : i + step].tobytes() for i in range(0, a.nbytes, step))


class Backend(ABC):
    """Bytes under keys, and leases. See the module docstring for the contract."""

    #: the store URL with any password replaced by ``***``
    url: str
    #: the query options ``from_url`` understands (``?name=value``)
    URL_OPTIONS: ClassVar[frozenset[str]] = frozenset()
    #: whether other processes can reach what this backend stores (False: in-process only)
    SHARED: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def from_url(cls, url: StoreURL) -> Backend:
        """Build the backend a URL of its scheme names; ConfigError (one line) for anything malformed."""

    @abstractmethod
    def get(self, key: str) -> Buffer | None:
        """The value stored under ``key``, or None; VerificationError if the backend's framing of it is damaged."""

    @abstractmethod
    def put(self, key: str, value: Buffer, *more: Buffer) -> None:
        """Publish ``value`` followed by ``more`` under ``key`` atomically; the last writer wins."""

    @abstractmethod
    def put_if(self, key: str, expected: Buffer | None, value: Buffer, *more: Buffer) -> bool:
        """Publish like :meth:`put` only if ``get`` would still return ``expected`` (None: no bytes); False if not."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (and whatever the backend stores for it) if present."""

    @abstractmethod
    def delete_if(self, key: str, expected: Buffer) -> bool:
        """Remove ``key`` only if ``get`` would still return ``expected``; False (nothing removed) if not."""

    @abstractmethod
    def scan(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        """Every stored entry, optionally of one namespace."""

    @abstractmethod
    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        """Take the lease ``name`` for ``ttl`` seconds if it is free or expired."""

    @abstractmethod
    def lease_renew(self, name: str, token: str, ttl: float) -> bool:
        """Extend the lease if ``token`` still holds it; False if it was lost."""

    @abstractmethod
    def lease_release(self, name: str, token: str) -> None:
        """Drop the lease if ``token`` still holds it, and wake the processes waiting on it (:meth:`lease_wait`)."""

    @abstractmethod
    def lease_holder(self, name: str) -> LeaseState | None:
        """The lease's holder and time left, or None when nobody holds it.

        Backends that keep an expired lease until it is taken over (filesystem, memory)
        report it with ``remaining_s <= 0``, so a waiter can tell a holder that released
        the lease (None) from one that died (expired); Redis drops expired keys, so there
        a dead holder looks like one that released.
        """

    def lease_wait(self, name: str, token: str, timeout: float) -> bool | None:
        """Block until holder ``token`` releases lease ``name``, at most ``timeout`` seconds.

        True: woken (the holder released it, or it changed hands); False: the timeout
        passed, or the backend ended the wait early (the caller looks again either way).
        None: this backend cannot wake waiters and returned at once; the caller polls.
        """
        return None

    def evict(self, max_bytes: int) -> int:
        """Delete least-recently-used entries until at most ``max_bytes`` remain; returns bytes freed.

        The default works from :meth:`scan`; backends with their own eviction (Redis's
        ``maxmemory-policy``) still honour an explicit prune.
        """
        entries = sorted(self.scan(), key=lambda e: e.atime)
        total = sum(e.size for e in entries)
        freed = 0
        for entry in entries:
            if total - freed <= max_bytes:
                break
            self.delete(entry.key)
            freed += entry.size
        return freed

    def vacuum(self, namespace: str | None = None) -> int:
        """Remove coordination leftovers (stale temp files, expired leases and their locks); returns how many.

        Backends whose leftovers all expire by themselves have none (Redis sweeps only what
        earlier versions left without an expiry).
        """
        return 0

    def discover(self) -> None:  # noqa: B027 - optional: a backend with one server has nothing to discover
        """Raise ConfigError if the URL names no usable service at all: a cluster none of whose seed
        nodes answers, sentinels that know no primary for the service. A URL that names one
        server does nothing here: that server being down is a backend failure, not bad input."""

    @property
    def identity(self) -> str:
        """Where this backend's entries live: the same for every URL that names the same data, another for other data.

        The node tier files its copies under it: one node directory serves every job of a
        user on the node, and a job must never be served what only another store holds. The
        URL without its credentials (users of one service share its data) and options (they
        say how to talk to it, not what it holds); a backend that knows its data better
        (a directory's real path) says so.
        """
        parts = urllib.parse.urlsplit(self.url)
        return f"{parts.scheme.lower()}://{parts.netloc.rpartition('@')[2].lower()}{parts.path}"

    def ping(self) -> None:  # noqa: B027 - optional: a local backend always answers
        """Raise BackendError unless the service answers; a local backend always does."""

    def failure_domain(self, key: str) -> str | None:
        """The part of the service that serves ``key`` and can fail alone (a cluster node, ``host:port``);
        None: the whole backend.

        The store keeps a circuit breaker per part, so one dead cluster primary leaves the
        keys of the others served. Answered from what the backend already knows, without
        asking the service: it is asked before every call.
        """
        return None

    def health_checks(self, probe_key: str) -> list[HealthCheck]:
        """What ``recipecache doctor`` checks beyond a round trip: space, permissions, clock, rights.

        ``probe_key`` is a backend key (``<namespace>/<hex>``) the checks may write and
        must delete. A backend with nothing more to check returns no checks.
        """
        return []

    def close(self) -> None:  # noqa: B027 - optional: a backend holding nothing open closes nothing
        """Release connections or handles; the backend is not used afterwards."""
