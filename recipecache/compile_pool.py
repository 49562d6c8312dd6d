"""The compile pool: compiles behind the steps that any idle process of the job may run for the one that met them.

A cold job's wall is set by the rank with the most compile work on its path, not by the job's total: the rank that
meets a graph first takes its lease and compiles it, and a rank that alone meets some graphs (an evaluation only
rank 0 runs) compiles them all, while the other ranks' compilers sit idle. Under no-stall every process keeps one
worker and runs its compiles behind the steps one after another; a process whose worker is busy *offers* the
graphs queued behind it here, and a process whose worker is idle *takes* one: its worker compiles it under the
offering process's key (the worker checks the key it computes, as for the process's own graphs) and publishes it
through the normal path, where the offering process and every other one load it.

In the store, under the job's namespace, sealed and (with a secret) signed like every artifact, since a taker's
worker runs what it reads:

* ``compile-pool/offers``: the index, which keys are offered and by whom, changed by compare-and-set;
* ``compile-pool/offer/<key>``: what a worker needs to compile the graph (opaque bytes here);
* ``compile-pool/result/<key>``: how a taker's compile ended, for the process that offered it;
* the lease ``compile-pool/claim/<key>``, the one coordination primitive: the offering process claims its own
  graph when its worker gets to it, a taker claims it before it compiles, and whoever holds the claim compiles.
  A taker that dies stops renewing it; the claim expires and the offering process claims the graph and compiles
  it itself: one takeover, never a hang.

Every call degrades: a backend that fails makes an offer that nobody sees (the offering process compiles it) or a
take that does not happen. Nothing here knows torch; :mod:`recipecache.torch_integration.no_stall.sharing` does.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from .backends.base import Buffer
from .env import process_rank
from .errors import BackendError
from .keys import storage_key
from .lease import HeldLease, new_token
from .store import Store

log = logging.getLogger(__name__)

INDEX_KEY = "compile-pool/offers"
#: tries of one change of the index before it gives up (another process changed it each time)
INDEX_ATTEMPTS = 8


def member_name() -> str:
    """This process as the pool names it: ``rank <r> pid <p> on <host>`` (an offer's owner, a result's author)."""
    return f"rank {process_rank()} pid {os.getpid()} on {socket.gethostname()}"


@dataclass(frozen=True)
class Result:
    """How a taker's compile of an offered graph ended."""

    #: the graph is published under the offering process's key
    compiled: bool
    #: the taker's seconds compiling it
    compile_s: float
    #: the taker (:func:`member_name`)
    by: str
    #: why not, when not ``compiled``
    error: str = ""


class CompilePool:
    """The offers of one store's namespace, and the claims and results that go with them."""

    def __init__(self, store: Store, *, member: str | None = None, ttl: float | None = None) -> None:
        self._entries = store.entries
        self._backend = store.backend
        self._namespace = store.namespace
        self.member = member_name() if member is None else member
        #: seconds a claim lives without renewal: how long a dead taker holds its graph
        self.ttl = store.settings.lease_ttl if ttl is None else ttl

    # -- the offering process ---------------------------------------------------------
    def offer(self, key: str, payload: Buffer) -> bool:
        """Offer graph ``key``'s compile (``payload``: what a taker's worker needs); False if the store failed."""
        if not self._write(f"compile-pool/offer/{key}", payload):
            return False
        return self._change_index(lambda offers: None if key in offers else {**offers, key: self.member})

    def withdraw(self, key: str) -> None:
        """The graph's compile ended, here or at a taker: nobody may take it any more."""
        self._unlist(key)
        for name in (f"compile-pool/offer/{key}", f"compile-pool/result/{key}"):
            try:
                self._backend.delete(storage_key(self._namespace, name))
            except BackendError as exc:
                log.debug("recipecache: could not delete %s: %s", name, exc)

    def result(self, key: str) -> Result | None:
        """How a taker's compile of ``key`` ended, or None (none ended, or the record does not verify)."""
        data = self._read(f"compile-pool/result/{key}")
        if data is None:
            return None
        try:
            fields = msgpack.unpackb(data)
            return Result(bool(fields["compiled"]), float(fields["compile_s"]), str(fields["by"]), str(fields["error"]))
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            log.warning("recipecache: a compile pool result for %s does not parse: %s", key, exc)
            return None

    # -- both -----------------------------------------------------------------------
    def claim(self, key: str) -> HeldLease | None:
        """The claim on graph ``key``'s compile (renewed until released), or None: another process holds it, or the
        store failed (:meth:`claimed` tells which)."""
        name, token = self._claim_name(key), new_token()
        try:
            if self._backend.lease_add(name, token, self.ttl):
                return HeldLease(self._backend, name, token, self.ttl)
        except BackendError as exc:
            log.debug("recipecache: could not claim %s: %s", key, exc)
        return None

    def claimed(self, key: str) -> bool:
        """Whether a live claim says a process is compiling ``key`` now (False if the store failed)."""
        try:
            held = self._backend.lease_holder(self._claim_name(key))
        except BackendError:
            return False
        return held is not None and held.remaining_s > 0

    def wait_claimed(self, key: str, timeout: float) -> None:
        """Return when the claim on ``key`` is released (woken by the release where the backend can: Redis) or
        ``timeout`` seconds passed; the caller looks at :meth:`claimed` again either way."""
        name = self._claim_name(key)
        try:
            held = self._backend.lease_holder(name)
            if held is None or held.remaining_s <= 0 or self._backend.lease_wait(name, held.token, timeout) is not None:
                return
        except BackendError as exc:
            log.debug("recipecache: could not wait for the claim on %s: %s", key, exc)
        time.sleep(timeout)  # a backend that cannot wake waiters (filesystem), or one that failed: poll

    # -- the taker ------------------------------------------------------------------
    def offers(self) -> dict[str, str]:
        """The graphs offered now: key -> the offering process (:func:`member_name`); empty if the store failed."""
        data = self._read(INDEX_KEY)
        return {} if data is None else _index(data)

    def payload(self, key: str) -> memoryview | None:
        """The verified offer of ``key`` (what its worker needs), or None (withdrawn, refused, the store failed)."""
        return self._read(f"compile-pool/offer/{key}")

    def report(self, key: str, result: Result) -> None:
        """Say how this taker's compile of ``key`` ended (before releasing the claim: the offering process reads it
        once the claim is gone)."""
        fields = {"compiled": result.compiled, "compile_s": result.compile_s, "by": result.by, "error": result.error}
        self._write(f"compile-pool/result/{key}", msgpack.packb(fields))
        if result.compiled:  # published: no process may take it again (it would compile it again, a cache hit, until
            self._unlist(key)  # its offering process's worker gets to it and withdraws the rest)

    # -- the store ------------------------------------------------------------------
    def _unlist(self, key: str) -> None:
        """Take ``key`` off the index of offers."""
        self._change_index(lambda offers: {k: m for k, m in offers.items() if k != key} if key in offers else None)

    def _claim_name(self, key: str) -> str:
        return storage_key(self._namespace, f"compile-pool/claim/{key}")

    def _read(self, key: str) -> memoryview | None:
        """The verified payload under ``key``, from the backend (never a node copy: these entries change)."""
        return self._entries.fetch(key)[0].data

    def _write(self, key: str, data: Buffer) -> bool:
        try:
            self._backend.put(storage_key(self._namespace, key), self._entries.seal(key, data), data)
        except BackendError as exc:
            log.warning("recipecache: the compile pool could not write %s: %s", key, exc)
            return False
        return True

    def _change_index(self, change: Callable[[dict[str, str]], dict[str, str] | None]) -> bool:
        """Apply ``change`` to the index by compare-and-set (None: nothing to write); False if it could not. Not
        counted in the store's figures, which are the graphs'."""

        def changed(data: memoryview | None) -> bytes | None:
            new = change({} if data is None else _index(data))
            return None if new is None else msgpack.packb(new)

        done = self._entries.update(INDEX_KEY, changed, attempts=INDEX_ATTEMPTS)
        if done.failed:
            log.warning("recipecache: the compile pool could not change its index: %s", done.value.reason)
        return not done.failed


def _index(data: Buffer) -> dict[str, str]:
    """The index's offers from its verified payload; empty if it does not parse (the next change rewrites it)."""
    try:
        offers = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException):
        return {}
    if not isinstance(offers, dict):
        return {}
    return {str(k): str(v) for k, v in offers.items()}
