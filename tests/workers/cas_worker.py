"""Racing writers for the conditional-write tests: run as processes, or imported and run as threads.

argv: URL START ROLE ARGS...: at unix time START (so that racers start together) run ROLE:

* ``increment KEY N PAD``: add 1 to the counter under backend key KEY, N times, each a
  read and a ``put_if`` retried until it wins (the value is the count in 16 digits, padded
  with PAD bytes so that Redis chunks it);
* ``update NAMESPACE KEY N PAD``: the same through ``Store.update``;
* ``publish VALUE KEY...``: a plain ``put`` of VALUE under each key, in order, one a millisecond;
* ``delete-bad VALUE KEY...``: for each key, in order, read it and, a millisecond later (the
  store verifies what it read in between), ``delete_if`` it if it held VALUE: a reader
  removing a damaged entry while a writer publishes good ones at the same pace.

Prints the number of lost races (conflicts) on stdout.
"""

from __future__ import annotations

import sys
import time

from recipecache.backends.base import Backend
from recipecache.buffers import Buffer
from recipecache.eventlog import EventLog
from recipecache.backends import open_backend
from recipecache.settings import StoreSettings
from recipecache.store import Store


def counter_value(count: int, pad: int) -> bytes:
    return b"%016d" % count + b"x" * pad


def count_of(value: Buffer | None) -> int:
    return 0 if value is None else int(bytes(value[:16]))


def increment(backend: Backend, key: str, n: int, pad: int) -> int:
    conflicts = 0
    for _ in range(n):
        while True:
            current = backend.get(key)
            if backend.put_if(key, current, counter_value(count_of(current) + 1, pad)):
                break
            conflicts += 1
    return conflicts


def update(store: Store, key: str, n: int, pad: int) -> int:
    for _ in range(n):
        result = store.update(key, lambda current: counter_value(count_of(current) + 1, pad))
        assert result.data is not None, result.reason
    return int(store.stats()["update_conflicts"])


def publish(backend: Backend, value: bytes, keys: list[str]) -> int:
    for key in keys:
        time.sleep(0.001)
        backend.put(key, value)
    return 0


def delete_bad(backend: Backend, value: bytes, keys: list[str]) -> int:
    for key in keys:
        current = backend.get(key)
        time.sleep(0.001)
        if current is not None and current == value:
            backend.delete_if(key, current)
    return 0


def main(argv: list[str], backend: Backend | None = None) -> int:
    """Run one role; ``backend`` (threads sharing an in-process backend) instead of opening the URL."""
    url, start, role, *args = argv
    b = backend if backend is not None else open_backend(url)
    time.sleep(max(0.0, float(start) - time.time()))
    if role == "increment":
        return increment(b, args[0], int(args[1]), int(args[2]))
    if role == "update":
        store = Store(b, StoreSettings(url=url, namespace=args[0]), events=EventLog(None))
        return update(store, args[1], int(args[2]), int(args[3]))
    if role == "publish":
        return publish(b, args[0].encode(), args[1:])
    if role == "delete-bad":
        return delete_bad(b, args[0].encode(), args[1:])
    raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    print(main(sys.argv[1:]))
