"""The Redis backend's calls: each bounded by ``timeout`` as a whole, each failure a :class:`BackendError`.

A server that accepts connections and never answers costs one timeout per call, whatever
redis-py does inside it (the connection handshake, its retry, asking each sentinel, each
seed node); calls that move chunks get more time in proportion to their bytes
(:data:`MIN_RATE`), and a blocking wait its block. Blocking calls go through a second
connection pool whose socket timeout exceeds the longest block (:data:`MAX_BLOCK_S`), so a
long wait is not a timeout.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import redis
import redis.exceptions

from ...errors import BackendError
from ...reasons import Reason
from .errors import redis_error

#: Bytes per second a call that moves chunks is given on top of ``timeout``: a backend
#: slower than this is a slow backend.
MIN_RATE = 1024 * 1024
#: The longest one ``lease_wait`` blocks in Redis; a caller waiting longer calls again.
MAX_BLOCK_S = 30.0


class CallThreads:
    """Daemon threads that run Redis calls, so a caller can stop waiting at its deadline.

    A socket timeout alone bounds each read, not a call: redis-py may connect, retry, and
    ask one sentinel or seed node after another within one call. So each call runs on one
    of these threads and the caller waits for it at most its bound; a call given up on is
    left to end by itself (redis-py's socket timeout ends it soon after). The threads are
    kept between calls (starting a thread per call cost several times a loopback round
    trip) and one more is started whenever none is idle; they are daemons, so a call left
    hanging never holds the interpreter's exit. A forked child starts with none
    (:func:`_fresh_threads_after_fork`): the parent's threads do not exist there.
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def call(self, seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, waited for at most ``seconds``; the builtin TimeoutError after that."""
        done = threading.Event()
        outcome: list[tuple[bool, Any]] = []

        def task() -> None:
            try:
                outcome.append((True, fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                outcome.append((False, exc))
            finally:
                done.set()

        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that idle thread takes this task
        if start:
            try:
                threading.Thread(target=self._work, name="recipecache-redis-call", daemon=True).start()
            except RuntimeError:
                # no new threads here (Python 3.12 in atexit handlers, which release the leases of
                # compiles cut short): the call runs bounded per read, as a release must still happen
                return fn(*args, **kwargs)
        self._tasks.put(task)
        if not done.wait(seconds):
            raise TimeoutError(f"no answer within {seconds:g} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _work(self) -> None:
        while True:
            self._tasks.get()()
            with self._lock:
                self._idle += 1


_call_threads = CallThreads()


def _fresh_threads_after_fork() -> None:
    global _call_threads
    _call_threads = CallThreads()


os.register_at_fork(after_in_child=_fresh_threads_after_fork)


def _bounded(seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, waited for at most ``seconds`` (see :class:`CallThreads`)."""
    return _call_threads.call(seconds, fn, *args, **kwargs)


class RedisCalls:
    """A backend's clients, and every call on them within its time (see :meth:`within`).

    ``connect(socket_timeout=S)`` makes a redis-py client: the plain one at once, the one
    for blocking calls on first use (most processes never wait).
    """

    def __init__(self, connect: Callable[..., Any], timeout: float) -> None:
        self.timeout = timeout
        self._connect = connect
        #: redis.Redis, or the cluster backend's lazy client
        self.client: Any = connect(socket_timeout=timeout)
        self._blocking_client: Any = None
        self._blocking_lock = threading.Lock()

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` within ``timeout``; every failure a BackendError (see :meth:`within`)."""
        return self.within(self.timeout, what, fn, *args, **kwargs)

    def transfer_s(self, nbytes: int) -> float:
        """The time a call that moves ``nbytes`` of chunks is given."""
        return self.timeout + nbytes / MIN_RATE

    def within(self, seconds: float, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, given ``seconds`` as a whole; a BackendError for any failure or a late answer.

        The whole call, not each read: a hung server (or sentinel, or seed node) costs the
        caller one timeout, and the store's circuit breaker takes over from there.
        """
        try:
            return _bounded(seconds, fn, *args, **kwargs)
        except redis.exceptions.RedisError as exc:
            raise redis_error(exc, what) from None
        except TimeoutError as exc:
            raise BackendError(Reason.BACKEND_SLOW, f"redis {what}: {exc}") from None

    def blocking(self) -> Any:
        """The client for blocking calls, made on first use: most processes never wait."""
        with self._blocking_lock:
            if self._blocking_client is None:
                self._blocking_client = self._connect(socket_timeout=MAX_BLOCK_S + self.timeout)
            return self._blocking_client

    def close(self) -> None:
        self.client.close()
        if self._blocking_client is not None:
            self._blocking_client.close()
