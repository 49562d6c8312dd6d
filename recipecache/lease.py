"""Single-flight over any backend: for one key, one process compiles while the others wait.

The algorithm lives here, apart from the backends (as in dogpile.cache); backends only
provide the lease primitive (atomic add-with-expiry, compare-and-renew,
compare-and-delete, who holds it, and where they can, a wait that the holder's release
ends). For a key that missed:

1. Try to take the lease. Whoever gets it is the *leader*: it looks once more for a
   result (a previous leader may have published between our miss and our lease), and
   otherwise compiles, publishes and releases. A background thread renews the lease
   every ``ttl / 3`` while it works.
2. Everybody else is a *follower*. It looks for the result, reads who holds the lease,
   and waits for that holder: blocked in :meth:`Backend.lease_wait` until the holder's
   release wakes it (Redis), or polling with exponential backoff where the backend
   cannot wake anyone (filesystem). A wait never outlasts the holder's lease, so a
   leader that died (it stops renewing, its lease expires) is noticed and the next
   follower to try takes the lease over (a *takeover*) and compiles.
3. A follower still waiting after ``timeout`` gives up and compiles locally.

The lease's owner token names its holder (rank, pid, host), so a follower can say whom
it waits for: one log line when the wait starts and one every :data:`PROGRESS_EVERY_S`
seconds ("rank 3 waiting 30 s for graph 7f2c.. compiled by rank 1 on host h").

The clock and sleep are injectable so tests can drive expiry without waiting.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from .backends.base import Backend, LeaseState
from .env import process_rank
from .reasons import Role

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between a waiting process's progress lines.
PROGRESS_EVERY_S = 15.0
#: A waiter that nobody woke looks again this long after the holder's lease would expire.
EXPIRY_MARGIN_S = 0.05


def new_token() -> str:
    """A fresh lease owner token: random, then who holds it (``<hex>:<rank>:<pid>:<host>``)."""
    return f"{secrets.token_hex(16)}:{process_rank()}:{os.getpid()}:{socket.gethostname()}"


def describe_holder(token: str) -> str:
    """``rank 1 on host h`` for a token of :func:`new_token`, else ``another process``."""
    parts = token.split(":", 3)
    if len(parts) == 4 and parts[1].lstrip("-").isdigit():
        return f"rank {parts[1]} on host {parts[3]}"
    return "another process"


class HeldLease:
    """A lease this process holds; renewed in the background until :meth:`release`."""

    def __init__(self, backend: Backend, name: str, token: str, ttl: float) -> None:
        self.backend = backend
        self.name = name
        self.token = token
        self.ttl = ttl
        #: set when a renewal found the lease gone (we stalled past the TTL, or the backend failed)
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"recipecache-lease-{name[-8:]}", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                renewed = self.backend.lease_renew(self.name, self.token, self.ttl)
            except Exception as exc:  # noqa: BLE001 - a renewal must never kill the compile it protects
                log.warning("recipecache: could not renew lease %s: %s", self.name, exc)
                renewed = False
            if not renewed:
                self.lost = True
                log.warning("recipecache: lost lease %s; another process may compile the same key", self.name)
                return

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        try:
            self.backend.lease_release(self.name, self.token)
        except Exception as exc:  # noqa: BLE001 - it expires by itself
            log.warning("recipecache: could not release lease %s (it will expire): %s", self.name, exc)


@dataclass
class Outcome(Generic[T]):
    """How a single-flight attempt ended for this process."""

    role: Literal[Role.LEADER, Role.FOLLOWER, Role.TIMEOUT]
    #: the result another process published (follower), or None
    value: T | None = None
    #: the lease to release after compiling (leader only)
    lease: HeldLease | None = None
    #: seconds spent waiting for another process
    waited_s: float = 0.0
    #: the lease was taken over from a holder that stopped renewing it
    takeover: bool = False
    #: (``TIMEOUT`` only, with ``takeover_on_release=False``) the holder released the lease
    #: without a result, rather than the deadline passing
    released: bool = False


class _Progress:
    """The waiting process's log lines: one when the wait starts, then one every PROGRESS_EVERY_S."""

    def __init__(self, name: str, activity: str) -> None:
        self.what = f"graph {name.rpartition('/')[2][:4]}.. {activity}"
        self.rank = process_rank()
        self.next_s: float | None = None

    def update(self, held: LeaseState, waited: float) -> None:
        holder = describe_holder(held.token)
        if self.next_s is None:
            log.info("recipecache: rank %d waiting for %s by %s", self.rank, self.what, holder)
            self.next_s = waited + PROGRESS_EVERY_S
        elif waited >= self.next_s:
            log.info("recipecache: rank %d waiting %d s for %s by %s", self.rank, int(waited), self.what, holder)
            self.next_s = waited + PROGRESS_EVERY_S

    def due_in(self, waited: float) -> float:
        return math.inf if self.next_s is None else max(self.next_s - waited, 0.0)


class SingleFlight:
    def __init__(
        self,
        backend: Backend,
        *,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        poll_initial: float = 0.02,
        # a waiter's lag behind the publish is added to every rank's step (DDP waits for the
        # slowest rank), so it is kept small; a poll is one small read
        poll_max: float = 0.1,
        activity: str | None = "compiled",
        takeover_on_release: bool = True,
    ) -> None:
        """``activity`` names what the holder does in progress lines (None: no progress lines).

        ``takeover_on_release=False``: a follower whose holder released the lease without
        a result stops waiting (``TIMEOUT`` with ``released``) instead of taking the lease
        itself. For work whose "no result" is an answer everyone can get cheaply on their
        own (a fetch that found nothing), so the followers do not queue up behind the lease
        one by one; a holder that *died* (its lease expired) is still taken over.
        """
        self.backend = backend
        self.ttl = ttl
        self._clock = clock
        self._sleep = sleep
        self._poll_initial = poll_initial
        self._poll_max = poll_max
        self._activity = activity
        self._takeover_on_release = takeover_on_release

    def run(self, name: str, fetch: Callable[[], T | None], timeout: float) -> Outcome[T]:
        """Become leader or wait for one; see the module docstring.

        Backend errors and errors of ``fetch`` propagate; a lease taken before ``fetch`` failed is released.
        """
        token = new_token()
        start = self._clock()
        if self.backend.lease_add(name, token, self.ttl):
            return self._lead(name, token, fetch, start, contended=False)
        delay = self._poll_initial
        progress = _Progress(name, self._activity) if self._activity else None
        polls = False  # learnt from the first lease_wait: nothing wakes waiters on this backend
        while True:
            value = fetch()
            if value is not None:
                return Outcome(Role.FOLLOWER, value=value, waited_s=self._clock() - start)
            waited = self._clock() - start
            if waited >= timeout:
                return Outcome(Role.TIMEOUT, waited_s=waited)
            if polls and self._takeover_on_release:
                # a poll is one look and one try of the lease (which succeeds once the holder is
                # gone); the holder is read only when a progress line is due
                if self.backend.lease_add(name, token, self.ttl):
                    return self._lead(name, token, fetch, start, contended=True)
                if progress is not None and progress.due_in(waited) == 0:
                    held = self.backend.lease_holder(name)
                    if held is not None:
                        progress.update(held, waited)
                self._sleep(min(delay, timeout - waited))
                delay = min(delay * 2, self._poll_max)
                continue
            held = self.backend.lease_holder(name)
            if held is None and not self._takeover_on_release:
                value = fetch()  # the holder may have published just before it released
                waited = self._clock() - start
                if value is not None:
                    return Outcome(Role.FOLLOWER, value=value, waited_s=waited)
                return Outcome(Role.TIMEOUT, waited_s=waited, released=True)
            if held is None or held.remaining_s <= 0:  # released, or its holder died: ours to take
                if self.backend.lease_add(name, token, self.ttl):
                    return self._lead(name, token, fetch, start, contended=True)
                self._sleep(min(delay, timeout - waited))  # someone else took it first
                continue
            if progress is not None:
                progress.update(held, waited)
            wait = min(
                held.remaining_s + EXPIRY_MARGIN_S, timeout - waited, progress.due_in(waited) if progress else math.inf
            )
            if self.backend.lease_wait(name, held.token, wait) is None:
                polls = True
                self._sleep(min(delay, wait))
                delay = min(delay * 2, self._poll_max)

    def _lead(
        self, name: str, token: str, fetch: Callable[[], T | None], start: float, *, contended: bool
    ) -> Outcome[T]:
        lease = HeldLease(self.backend, name, token, self.ttl)
        try:
            value = fetch()
        except BaseException:
            lease.release()  # nobody will compile under it: free the key for the others now
            raise
        waited = self._clock() - start if contended else 0.0
        if value is not None:
            lease.release()
            return Outcome(Role.FOLLOWER, value=value, waited_s=waited)
        return Outcome(Role.LEADER, lease=lease, waited_s=waited, takeover=contended)
