"""One conformance suite that every backend runs: memory, filesystem, a real redis-server, a real
3-primary Redis Cluster and a real primary behind a sentinel."""

from __future__ import annotations

import multiprocessing
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recipecache.backends.base import Backend
from recipecache.backends import open_backend
from recipecache.backends.memory import MemoryBackend
from recipecache.errors import ConfigError
from recipecache.store import Store, open_store
from harness.paths import WORKERS


@pytest.fixture(params=["memory", "filesystem", "redis", "redis-cluster", "redis-sentinel"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "memory":
        url = "memory://"
    elif request.param == "filesystem":
        url = f"file://{tmp_path / 'cache'}"
    else:
        request.applymarker(pytest.mark.redis)
        server = {"redis": "redis_url", "redis-cluster": "redis_cluster", "redis-sentinel": "redis_sentinel"}
        found = request.getfixturevalue(server[request.param])
        # a small chunk size so the suite exercises chunked values on Redis
        url = (found if isinstance(found, str) else found.url) + "?chunk_size=4KiB"
    b = open_backend(url)
    yield b
    b.close()


@pytest.fixture
def ns() -> str:
    """A fresh namespace per test keeps tests apart on the shared redis-server."""
    return "t" + secrets.token_hex(4)


def k(ns: str, n: int) -> str:
    return f"{ns}/{n:064x}"


def test_missing_key_is_none(backend: Backend, ns: str) -> None:
    assert backend.get(k(ns, 1)) is None


def test_put_get_overwrite_delete(backend: Backend, ns: str) -> None:
    backend.put(k(ns, 1), b"first")
    assert backend.get(k(ns, 1)) == b"first"
    backend.put(k(ns, 1), b"second")
    assert backend.get(k(ns, 1)) == b"second"
    backend.delete(k(ns, 1))
    assert backend.get(k(ns, 1)) is None
    backend.delete(k(ns, 1))  # deleting a missing key is fine


@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 100_000])
def test_sizes_round_trip(backend: Backend, ns: str, size: int) -> None:
    value = secrets.token_bytes(size)
    backend.put(k(ns, 2), value)
    assert backend.get(k(ns, 2)) == value


def test_large_overwritten_by_small_and_large(backend: Backend, ns: str) -> None:
    big1, big2 = secrets.token_bytes(50_000), secrets.token_bytes(30_000)
    backend.put(k(ns, 3), big1)
    backend.put(k(ns, 3), b"small")
    assert backend.get(k(ns, 3)) == b"small"
    backend.put(k(ns, 3), big1)
    backend.put(k(ns, 3), big2)
    assert backend.get(k(ns, 3)) == big2
    assert [e.size for e in backend.scan(ns)] == [len(big2)]


def test_scan_lists_one_namespace(backend: Backend, ns: str) -> None:
    other = ns + "x"
    backend.put(k(ns, 4), b"a" * 10)
    backend.put(k(ns, 5), b"b" * 20_000)
    backend.put(k(other, 6), b"c")
    assert sorted((e.key, e.size) for e in backend.scan(ns)) == [(k(ns, 4), 10), (k(ns, 5), 20_000)]
    assert {e.key for e in backend.scan(None)} >= {k(ns, 4), k(ns, 5), k(other, 6)}


@pytest.mark.parametrize("bad", ["../etc/passwd", "ns/../../x", "ns/ABC", "ns", "/abs/0000000000", "ns/00000000/x"])
def test_bad_keys_are_refused(backend: Backend, bad: str) -> None:
    with pytest.raises(ConfigError):
        backend.put(bad, b"x")
    with pytest.raises(ConfigError):
        backend.get(bad)


def test_lease_is_exclusive_until_released(backend: Backend, ns: str) -> None:
    name = k(ns, 7)
    assert backend.lease_add(name, "a", 30)
    assert not backend.lease_add(name, "b", 30)
    backend.lease_release(name, "b")  # not the holder: no effect
    assert not backend.lease_add(name, "b", 30)
    backend.lease_release(name, "a")
    assert backend.lease_add(name, "b", 30)


def test_lease_renew_needs_the_token(backend: Backend, ns: str) -> None:
    name = k(ns, 8)
    assert backend.lease_add(name, "a", 30)
    assert backend.lease_renew(name, "a", 30)
    assert not backend.lease_renew(name, "b", 30)
    assert not backend.lease_renew(k(ns, 9), "a", 30)


def test_expired_lease_is_taken_over(backend: Backend, ns: str) -> None:
    """The lease is taken over once it expired, whenever that is seen: with a 0.2 s TTL and a 0.35 s sleep, the
    second try could come after the expiry on a loaded machine, or the take-over before it (issue 28)."""
    name = k(ns, 10)
    added = time.monotonic()
    assert backend.lease_add(name, "dead", 1.0)
    while not backend.lease_add(name, "b", 30):
        assert time.monotonic() - added < 60, "the expired lease was never taken over"  # a hang guard
        time.sleep(0.05)
    assert time.monotonic() - added >= 0.9, "not before it expired (less the file system's coarse clock)"
    assert not backend.lease_renew(name, "dead", 30), "the old holder must learn it lost the lease"
    assert backend.lease_renew(name, "b", 30)


def test_lease_holder_names_the_token_and_time_left(backend: Backend, ns: str) -> None:
    name = k(ns, 11)
    assert backend.lease_holder(name) is None
    assert backend.lease_add(name, "tok-a:1:99:host", 30)
    held = backend.lease_holder(name)
    assert held is not None and held.token == "tok-a:1:99:host" and 20 < held.remaining_s <= 30
    backend.lease_release(name, "tok-a:1:99:host")
    assert backend.lease_holder(name) is None


def test_lease_wait_ends_when_the_holder_releases(backend: Backend, ns: str) -> None:
    name = k(ns, 12)
    assert backend.lease_add(name, "tok-a", 30)
    woke = backend.lease_wait(name, "tok-a", 0.2)
    if woke is None:
        return  # a backend that cannot wake waiters says so at once; its waiters poll
    assert woke is False, "nobody released it: the wait times out"
    backend.lease_release(name, "tok-b")  # not the holder: wakes nobody
    assert backend.lease_wait(name, "tok-a", 0.2) is False
    release = threading.Timer(0.3, backend.lease_release, (name, "tok-a"))
    release.start()
    try:
        assert backend.lease_wait(name, "tok-a", 60) is True, "the release woke the waiter (not its timeout)"
    finally:
        release.join()
    assert backend.lease_wait(name, "tok-a", 60) is True, "a waiter arriving after the release is not stuck"
    assert backend.lease_holder(name) is None


def test_evict_keeps_the_cap(backend: Backend, ns: str) -> None:
    for i in range(6):
        backend.put(k(ns, 20 + i), bytes(1000))
    backend.evict(2500)
    # evict works across namespaces; this test's namespace is what we can see
    assert sum(e.size for e in backend.scan(ns)) <= 2500


# -- values as buffers --------------------------------------------------------------------
def test_put_stores_the_concatenation_of_its_buffers(backend: Backend, ns: str) -> None:
    head, body = b"head-", secrets.token_bytes(10_000)
    backend.put(k(ns, 30), head, memoryview(body), bytearray(b"-tail"))
    assert backend.get(k(ns, 30)) == head + body + b"-tail"
    backend.put(k(ns, 31), b"", b"")
    assert backend.get(k(ns, 31)) == b""


@pytest.mark.parametrize("size", [0, 60, 20_000])
def test_values_that_look_like_framing_round_trip(backend: Backend, ns: str, size: int) -> None:
    """A backend's own framing (Redis's chunk manifests start with RCM) never swallows a caller's value."""
    for value in (b"RCM2:" + bytes(size), b"RCM1" + bytes(size), b"RCE2" + bytes(size)):
        backend.put(k(ns, 32), value)
        assert backend.get(k(ns, 32)) == value


def test_a_value_read_stays_intact_after_its_key_is_overwritten_or_deleted(backend: Backend, ns: str) -> None:
    """``get`` may hand out a view (the filesystem maps files of a MiB and more): it is still a snapshot."""
    key = k(ns, 37)
    first, second = secrets.token_bytes(3 << 20), secrets.token_bytes(3 << 20)
    backend.put(key, first)
    held = backend.get(key)
    assert held is not None and len(held) == len(first)
    backend.put(key, second)
    assert backend.get(key) == second
    backend.delete(key)
    assert held == first


# -- conditional writes --------------------------------------------------------------------
@pytest.mark.parametrize("size", [10, 50_000])
def test_delete_if_removes_only_the_expected_value(backend: Backend, ns: str, size: int) -> None:
    key = k(ns, 33)
    bad, other = secrets.token_bytes(size), secrets.token_bytes(size)
    assert not backend.delete_if(key, bad), "nothing stored: nothing deleted"
    backend.put(key, bad)
    assert not backend.delete_if(key, other)
    assert not backend.delete_if(key, bad[:-1])
    assert backend.get(key) == bad
    assert backend.delete_if(key, bad)
    assert backend.get(key) is None
    assert [e.key for e in backend.scan(ns)] == []


@pytest.mark.parametrize("size", [10, 50_000])
def test_delete_if_keeps_a_value_published_after_the_read(backend: Backend, ns: str, size: int) -> None:
    key = k(ns, 34)
    backend.put(key, secrets.token_bytes(size))
    read = backend.get(key)
    assert read is not None
    good = secrets.token_bytes(size)
    backend.put(key, good)  # someone publishes a good entry between our read and our delete
    assert not backend.delete_if(key, read)
    assert backend.get(key) == good


@pytest.mark.parametrize("size", [10, 50_000])
def test_put_if_is_compare_and_set(backend: Backend, ns: str, size: int) -> None:
    key = k(ns, 35)
    v1, v2, v3 = (secrets.token_bytes(size) for _ in range(3))
    assert backend.put_if(key, None, v1), "None expects nothing stored"
    assert not backend.put_if(key, None, v2)
    assert backend.get(key) == v1
    assert not backend.put_if(key, v2, v3), "a stale expectation does not write"
    assert backend.get(key) == v1
    assert backend.put_if(key, memoryview(v1), v2[:5], memoryview(v2)[5:])
    assert backend.get(key) == v2
    assert backend.put_if(key, v2, b"small")
    assert backend.put_if(key, b"small", v3)
    assert backend.get(key) == v3
    assert [(e.key, e.size) for e in backend.scan(ns)] == [(key, size)]
    backend.delete(key)
    assert backend.put_if(key, None, v1), "a deleted key is absent again"


sys.path.insert(0, str(WORKERS))
import cas_worker  # noqa: E402


def race(backend: Backend, roles: list[list[str]]) -> list[int]:
    """Run the roles of ``cas_worker`` at once: processes on a real backend, threads on the in-process one."""
    start = str(time.time() + 2.0)  # every racer has started (imports take a while) and waits for this moment
    if isinstance(backend, MemoryBackend):
        results = [0] * len(roles)

        def run(i: int) -> None:
            results[i] = cas_worker.main([backend.url, start, *roles[i]], backend=backend)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(roles))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "cas_worker.py"), backend.url, start, *role],
                              stdout=subprocess.PIPE, text=True) for role in roles]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs)
    return [int(out) for out in outputs]


@pytest.mark.parametrize("pad", [0, 10_000])
def test_racing_processes_lose_no_compare_and_set_update(backend: Backend, ns: str, pad: int) -> None:
    key = k(ns, 36)
    conflicts = race(backend, [["increment", key, "25", str(pad)] for _ in range(4)])
    value = backend.get(key)
    assert value is not None and cas_worker.count_of(value) == 100, f"lost updates ({sum(conflicts)} conflicts)"
    assert len(value) == 16 + pad


def test_a_reader_deleting_a_bad_value_never_deletes_a_good_one_published_meanwhile(backend: Backend, ns: str) -> None:
    keys = [k(ns, 100 + i) for i in range(150)]
    for key in keys:
        backend.put(key, b"bad")
    race(backend, [["delete-bad", "bad", *keys], ["publish", "good", *keys]])
    assert [backend.get(key) for key in keys] == [b"good"] * len(keys)


# -- stores across fork ------------------------------------------------------------------------
#: 4 MiB that a forked child and its parent both know without passing them on
_CHILD_DATA = bytes(range(256)) * (4 << 12)


def _forked_child(store: Store, parent_data: bytes) -> None:
    """A DataLoader worker's life: it inherits the parent's store and reads and writes large entries."""
    if store.get("parent") != parent_data:
        raise SystemExit("the child read other bytes than the parent put")
    if not store.put("child", _CHILD_DATA) or store.get("child") != _CHILD_DATA:
        raise SystemExit("the child's own entry did not round-trip")


def test_a_forked_child_reads_and_writes_large_entries(store_url: str) -> None:
    """Issue 18.1: a process that hashed 1 MiB or more (BLAKE3 on every core) and then forks must not
    hang its child at the child's next large digest (the hashing thread pool does not survive fork)."""
    store = open_store(store_url, namespace="fork" + secrets.token_hex(4))
    parent_data = secrets.token_bytes(4 << 20)
    assert store.put("parent", parent_data) and store.get("parent") == parent_data  # the pool runs now
    child = multiprocessing.get_context("fork").Process(target=_forked_child, args=(store, parent_data))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child hung on a large digest")
    assert child.exitcode == 0
    assert store.get("child") == _CHILD_DATA, "and what the child put is there, whole"
