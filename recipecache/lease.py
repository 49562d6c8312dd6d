"""Single-flight over any backend: for one key, one process compiles while the others wait.

The algorithm lives here, apart from the backends (as in dogpile.cache); backends only
provide the lease primitive (atomic add-with-expiry, compare-and-renew,
compare-and-delete). For a key that missed:

1. Try to take the lease. Whoever gets it is the *leader*: it looks once more for a
   result (a previous leader may have published between our miss and our lease), and
   otherwise compiles, publishes and releases. A background thread renews the lease
   every ``ttl / 3`` while it works.
2. Everybody else is a *follower*: it polls for the result with exponential backoff
   and retries the lease on each round. A leader that died stops renewing, its lease
   expires, and the next follower to try takes it over (a *takeover*) and compiles.
3. A follower still waiting after ``timeout`` gives up and compiles locally.

The clock and sleep are injectable so tests can drive expiry without waiting.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from .backends.base import Backend
from .reasons import Role

log = logging.getLogger(__name__)

T = TypeVar("T")


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
    ) -> None:
        self.backend = backend
        self.ttl = ttl
        self._clock = clock
        self._sleep = sleep
        self._poll_initial = poll_initial
        self._poll_max = poll_max

    def run(self, name: str, fetch: Callable[[], T | None], timeout: float) -> Outcome[T]:
        """Become leader or wait for one; see the module docstring.

        Backend errors and errors of ``fetch`` propagate; a lease taken before ``fetch`` failed is released.
        """
        token = secrets.token_hex(16)
        start = self._clock()
        delay = self._poll_initial
        contended = False
        while True:
            if self.backend.lease_add(name, token, self.ttl):
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
            contended = True
            value = fetch()
            if value is not None:
                return Outcome(Role.FOLLOWER, value=value, waited_s=self._clock() - start)
            if self._clock() - start >= timeout:
                return Outcome(Role.TIMEOUT, waited_s=self._clock() - start)
            self._sleep(min(delay, max(0.0, timeout - (self._clock() - start))))
            delay = min(delay * 2, self._poll_max)
