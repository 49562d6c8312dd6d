"""A store's operator face: whole-store operations on entries as stored, for the operator tools.

:mod:`recipecache.tools.admin`, ``recipecache doctor`` and the CLI reach a store only through
this (never a bare backend). It talks to the backend directly, outside the circuit breaker:
an operator wants the backend's error (BackendError), not the silent fallback training gets
from :class:`~recipecache.store.Store`. ``node=True`` does the same on the node directory's
copies of the store's entries (none without a node tier), each named by the store's key of
it: what a job of this store may be served on this node.
"""

from __future__ import annotations

import secrets

from .backends.base import Backend, EntryInfo
from .buffers import Buffer, byte_view
from .errors import VerificationError
from .eventlog import EventLog
from .health import HealthCheck
from .keys import storage_key
from .reasons import Reason
from .settings import StoreSettings
from .store import Store


class StoreAdmin:
    """The operator's face of one store: raw envelopes under backend keys, and the checks of ``doctor``."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.settings = store.settings
        self.namespace = store.namespace

    @classmethod
    def open(cls, settings: StoreSettings, *, events: EventLog | None = None, **backend_defaults: object) -> StoreAdmin:
        """The operator face of :meth:`Store.open <recipecache.store.Store.open>`'s store (same arguments)."""
        return cls(Store.open(settings, events=events, **backend_defaults))

    @property
    def url(self) -> str:
        return self._store.url

    @property
    def _backend(self) -> Backend:
        return self._store.backend

    def _raw(self, storage_key: str, node: bool) -> tuple[Backend, str]:
        """The backend an operation on ``storage_key`` goes to, and its key there."""
        if not node:
            return self._backend, storage_key
        tier = self._store.node
        assert tier is not None, "node copies are listed by scan(node=True), which has none without a node tier"
        return tier.backend, tier.copy_key(storage_key)

    def scan(self, *, all_namespaces: bool = False, node: bool = False) -> list[EntryInfo]:
        """Entries of this store's namespace (or of every namespace) as the backend lists them (``node``: the node
        directory's copies of them)."""
        namespace = None if all_namespaces else self.namespace
        if node:
            return [] if self._store.node is None else list(self._store.node.copies(namespace))
        return list(self._backend.scan(namespace))

    def read_raw(self, storage_key: str, *, node: bool = False) -> Buffer | None:
        """The raw envelope filed under a backend key from :meth:`scan` (unverified: admin tools verify).

        Raises VerificationError where the backend's own framing of the entry is damaged.
        """
        backend, name = self._raw(storage_key, node)
        return backend.get(name)

    def write_raw(self, storage_key: str, blob: Buffer) -> None:
        """File a raw envelope under a backend key (import writes what it verified)."""
        self._backend.put(storage_key, blob)

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
        """Seal (and sign) ``data`` under ``key`` as :meth:`Store.put <recipecache.store.Store.put>` does and write
        it, raising BackendError.

        For operator checks (``recipecache doctor``'s round trip) that want the backend's own
        error, and no node copy, stats or event.
        """
        data = byte_view(data)
        self._backend.put(self.storage_key(key), self._store.entries.seal(key, data), data)

    def open_entry(self, key: str, blob: Buffer) -> memoryview:
        """The payload of ``blob`` filed under ``key``; VerificationError unless every check passes."""
        return self._store.entries.open(key, blob)

    def lease_is_exclusive(self, key: str, ttl: float = 30.0) -> bool:
        """Take a lease on ``key``, try it again as another owner, release it: True when only the first got it.

        Single-flight rests on this (without it every rank compiles every graph); doctor
        asks it of the backend itself, BackendError raised.
        """
        name, token = self.storage_key(key), secrets.token_hex(8)
        taken = self._backend.lease_add(name, token, ttl)
        again = self._backend.lease_add(name, "someone-else", ttl)
        self._backend.lease_release(name, token)
        return taken and not again

    def health_checks(self, key: str) -> list[HealthCheck]:
        """The backend's own checks (:meth:`Backend.health_checks`), probing under ``key``."""
        return self._backend.health_checks(self.storage_key(key))

    def discover(self) -> None:
        """ConfigError when the URL names no usable service at all (a cluster none of whose seeds answers).

        The CLI asks before an operation, so that such a URL is bad input, not a run of failures.
        """
        self._backend.discover()

    def evict(self, max_bytes: int) -> int:
        """Delete least-recently-used entries (of every namespace) down to ``max_bytes``; returns bytes freed."""
        return self._backend.evict(max_bytes)

    def vacuum(self, *, all_namespaces: bool = False) -> int:
        """Remove coordination leftovers (stale temp files, expired leases, idle lease locks); returns how many."""
        return self._backend.vacuum(None if all_namespaces else self.namespace)

    def close(self) -> None:
        self._store.close()
