"""The store's circuit breakers: a failed backend (or one failing part of it) is left alone for a pause, then probed.

There is one breaker per part of the backend that fails alone
(:meth:`~recipecache.backends.base.Backend.failure_domain`: a Redis Cluster primary), so a
dead node pauses its own keys only. A failure of one key
(:class:`~recipecache.errors.BackendKeyError`) is that key's miss and leaves the breaker closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .backends.base import Backend
from .errors import BackendError, BackendKeyError, echo
from .reasons import Reason

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a failed backend is left alone before the store tries it again; each failed try
#: doubles the pause, up to RETRY_AFTER_MAX_S.
RETRY_AFTER_S = 5.0
RETRY_AFTER_MAX_S = 120.0


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


class Breakers:
    """A circuit breaker per failure domain of one backend, made when its first call goes through."""

    def __init__(self, backend: Backend, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._backend = backend
        self._clock = clock
        #: None: the whole backend
        self._breakers: dict[str | None, Breaker] = {}
        self._lock = threading.Lock()

    def call(self, what: str, fn: Callable[..., T], skey: str, *args: Any) -> T:
        """Run ``fn(skey, *args)``, a backend call on storage key ``skey``, through the breaker of the part of the
        backend that serves ``skey``."""
        domain = self._backend.failure_domain(skey)
        with self._lock:
            breaker = self._breakers.get(domain)
            if breaker is None:
                url = echo(self._backend.url, quote=False)  # the warnings of an open breaker name it
                where = url if domain is None else f"{url} (node {domain})"
                breaker = self._breakers[domain] = Breaker(where, clock=self._clock)
        return breaker.call(what, fn, skey, *args)

    def unavailable(self) -> dict[str, Reason]:
        """The parts of the backend left alone now (their breaker is open), and why: a cluster node as
        ``host:port``, the whole backend as its URL."""
        with self._lock:
            breakers = list(self._breakers.items())
        return {
            self._backend.url if domain is None else domain: breaker.reason
            for domain, breaker in breakers
            if breaker.reason is not None
        }
