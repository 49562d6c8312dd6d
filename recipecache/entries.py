"""One namespace's entries as the store reads and writes them: sealed on the way in, verified on the way out.

A read goes through the node tier when there is one (one process per node reads the
backend, the others the verified copy it leaves), and every backend call through the
store's circuit breakers (:mod:`recipecache.breaker`). A *damaged* entry (its framing,
header or digest does not match its own payload, or it names another key or namespace) is
deleted with a compare-and-delete, so a good entry published meanwhile survives; an entry
this reader merely cannot accept (``unsigned``, ``bad_signature``, ``old_format``) is left
in place. Nothing here counts lookups or writes the event log: the store does
(:class:`~recipecache.store.Store`).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import envelope
from .backends.base import Backend
from .breaker import Breakers
from .buffers import Buffer, byte_view
from .errors import BackendError, VerificationError
from .keys import storage_key
from .node_tier import NodeTier
from .reasons import ABSENT, FAILED, REFUSED, Reason
from .stats import Stats

log = logging.getLogger(__name__)

#: Tries of one :meth:`Entries.update` before it gives up as a ``conflict``, and its backoff.
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


@dataclass(frozen=True)
class Update:
    """How one compare-and-set update ended (:meth:`Entries.update`)."""

    #: the value written, or (nothing written) what is there, or None and why: the backend's failure, ``conflict``
    value: Lookup
    #: the header of the envelope written; None when nothing was
    header: bytes | None
    #: the races lost on the way (each retried)
    conflicts: int

    @property
    def failed(self) -> bool:
        """Nothing was written, and not because nothing needed to be: the backend failed, or every race was lost."""
        return self.header is None and (self.value.failed or self.value.reason is Reason.CONFLICT)


class Entries:
    """The envelopes of one namespace on one backend (and its node tier), signed with one secret."""

    def __init__(
        self,
        backend: Backend,
        namespace: str,
        secret: bytes | None,
        *,
        breakers: Breakers,
        node: NodeTier | None,
        stats: Stats,
    ) -> None:
        self._backend = backend
        self._namespace = namespace
        self._secret = secret
        self._breakers = breakers
        self._node = node
        self._stats = stats

    def seal(self, key: str, data: Buffer, meta: dict[str, Any] | None = None) -> bytes:
        """The envelope header of ``data`` filed under ``key`` (it and ``data`` are the entry)."""
        return envelope.seal_header(key, data, namespace=self._namespace, secret=self._secret, meta=meta)

    def open(self, key: str, blob: Buffer) -> memoryview:
        """The payload of ``blob`` filed under ``key``; VerificationError unless every check passes."""
        return envelope.open_envelope(blob, key=key, namespace=self._namespace, secret=self._secret)[1]

    def read(self, key: str, *, node: bool = True) -> Lookup:
        """The verified payload, or why not, through the node tier if there is one (and ``node``).

        Deletes entries that are damaged. Counts nothing but bytes.
        """
        if self._node is None or not node:
            return self.fetch(key)[0]
        return self._node.read(
            storage_key(self._namespace, key),
            functools.partial(self.open, key),
            functools.partial(self._fetch_verified, key),
            self._node_hit,
        )

    def _node_hit(self, payload: memoryview) -> Lookup:
        self._stats.count("bytes_read", len(payload))
        return Lookup(payload)

    def _fetch_verified(self, key: str) -> tuple[Lookup, Buffer | None]:
        """The backend's answer, and the envelope as stored only if it verified (what the node tier may copy)."""
        result, blob = self.fetch(key)
        return result, blob if result.data is not None else None

    def fetch(self, key: str) -> tuple[Lookup, Buffer | None]:
        """The backend's answer (never the node tier's), and the envelope as stored (None when none is), for a
        compare-and-set."""
        skey = storage_key(self._namespace, key)
        try:
            blob = self._breakers.call("get", self._backend.get, skey)
        except BackendError as exc:
            return Lookup(None, exc.reason), None
        except VerificationError as exc:  # the backend's own framing of this entry: no bytes to compare
            log.warning("recipecache: refusing entry %s: %s", key, exc)
            return Lookup(None, exc.reason), None
        if blob is None:
            return Lookup(None, Reason.NOT_FOUND), None
        try:
            payload = self.open(key, blob)
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
            deleted = self._breakers.call("delete", self._backend.delete_if, skey, blob)
        except BackendError:
            return False
        if deleted:
            self._stats.count("deleted_bad")
        return deleted

    def fetch_fresh(self, key: str, stale: Buffer) -> memoryview | None:
        """The value under ``key`` unless it is ``stale``, from the backend itself (the node copy may be what is
        stale); a fresh value replaces the node copy, so the node's other processes see it too."""
        result, blob = self.fetch(key)
        if result.data is None or result.data == stale:
            return None
        if self._node is not None:
            assert blob is not None
            self._node.publish(storage_key(self._namespace, key), blob)
        return result.data

    def update(
        self,
        key: str,
        change: Callable[[memoryview | None], Buffer | None],
        *,
        meta: dict[str, Any] | None = None,
        attempts: int = UPDATE_ATTEMPTS,
    ) -> Update:
        """Replace the value under ``key`` with ``change(current)`` by compare-and-set on the envelope read from the
        backend; on a lost race, retry on what the other process wrote after a short random backoff, up to
        ``attempts`` times. ``current`` is the verified payload, or None where none is accepted (absent, refused,
        damaged: the new value replaces it); ``change`` may run once per attempt, must only compute, and returns None
        to write nothing. Counts nothing but bytes read: the caller counts what the update means to it."""
        skey = storage_key(self._namespace, key)
        for attempt in range(attempts):
            current, stored = self.fetch(key)
            if current.failed:
                return Update(current, None, attempt)
            new = change(current.data)
            if new is None:
                return Update(current, None, attempt)
            new = byte_view(new)
            header = self.seal(key, new, meta)
            try:
                written = self._breakers.call("put", self._backend.put_if, skey, stored, header, new)
            except BackendError as exc:
                return Update(Lookup(None, exc.reason), None, attempt)
            if written:
                return Update(Lookup(memoryview(new).toreadonly()), header, attempt)
            if attempt + 1 < attempts:  # a backoff only before another try, never before giving up
                time.sleep(random.uniform(0, min(_UPDATE_BACKOFF_MAX_S, _UPDATE_BACKOFF_S * 2**attempt)))
        return Update(Lookup(None, Reason.CONFLICT), None, attempts)
