"""An in-process backend: for unit tests of the logic above backends, and ``memory://``.

It obeys the full backend contract (including lease expiry against an injectable
clock, and waking the waiters of a released lease), so the conformance suite runs on it
like on the real backends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..buffers import Buffer
from .base import Backend, Clock, EntryInfo, LeaseState, check_key, value_matches
from .url import StoreURL


class MemoryBackend(Backend):
    SHARED = False

    @property
    def identity(self) -> str:
        """This instance: every memory store holds data of its own."""
        return f"memory://{id(self):x}"

    @classmethod
    def from_url(cls, url: StoreURL) -> MemoryBackend:
        """``memory://``: nothing to configure."""
        url.check_options(cls.URL_OPTIONS)
        if url.parts.netloc or url.parts.path.strip("/"):
            raise url.error("use memory:// (it has no location)")
        return cls()

    def __init__(self, *, clock: Clock = time.time) -> None:
        self.url = "memory://"
        self._clock = clock
        self._lock = threading.Lock()
        #: notified whenever a lease is released or changes hands
        self._lease_changed = threading.Condition(self._lock)
        self._values: dict[str, bytes] = {}
        self._atimes: dict[str, float] = {}
        self._leases: dict[str, tuple[str, float]] = {}

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(check_key(key))
            if value is not None:
                self._atimes[key] = self._clock()
            return value

    def _store(self, key: str, parts: tuple[Buffer, ...]) -> None:
        """Keep a copy: the caller may reuse its buffers."""
        self._values[key] = b"".join(parts)
        self._atimes[key] = self._clock()

    def put(self, key: str, value: Buffer, *more: Buffer) -> None:
        check_key(key)
        with self._lock:
            self._store(key, (value, *more))

    def put_if(self, key: str, expected: Buffer | None, value: Buffer, *more: Buffer) -> bool:
        check_key(key)
        with self._lock:
            if not value_matches(self._values.get(key), expected):
                return False
            self._store(key, (value, *more))
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._values.pop(check_key(key), None)
            self._atimes.pop(key, None)

    def delete_if(self, key: str, expected: Buffer) -> bool:
        with self._lock:
            if not value_matches(self._values.get(check_key(key)), expected):
                return False
            del self._values[key]
            self._atimes.pop(key, None)
            return True

    def scan(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        with self._lock:
            items = [(k, len(v), self._atimes.get(k, 0.0)) for k, v in self._values.items()]
        for key, size, atime in items:
            if namespace is None or key.startswith(namespace + "/"):
                yield EntryInfo(key, size, atime)

    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        with self._lock:
            now = self._clock()
            held = self._leases.get(check_key(name))
            if held is not None and held[1] > now:
                return False
            self._leases[name] = (token, now + ttl)
            self._lease_changed.notify_all()
            return True

    def lease_renew(self, name: str, token: str, ttl: float) -> bool:
        with self._lock:
            now = self._clock()
            held = self._leases.get(name)
            if held is None or held[0] != token or held[1] <= now:
                return False
            self._leases[name] = (token, now + ttl)
            return True

    def lease_release(self, name: str, token: str) -> None:
        with self._lock:
            held = self._leases.get(name)
            if held is not None and held[0] == token:
                del self._leases[name]
                self._lease_changed.notify_all()

    def lease_holder(self, name: str) -> LeaseState | None:
        with self._lock:
            held = self._leases.get(check_key(name))
            return None if held is None else LeaseState(held[0], held[1] - self._clock())

    def lease_wait(self, name: str, token: str, timeout: float) -> bool:
        with self._lock:
            return self._lease_changed.wait_for(
                lambda: self._leases.get(name, ("", 0.0))[0] != token, timeout=max(timeout, 0.0)
            )
