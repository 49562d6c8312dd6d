"""The store over the in-memory and filesystem backends: envelopes, signing, stats, degradation."""

from __future__ import annotations

import json
import secrets
import threading
from pathlib import Path

import pytest
from support.lease_spy import finds_lease_held

import recipecache
from recipecache import envelope
from recipecache.backends.base import Backend
from recipecache.backends.memory import MemoryBackend
from recipecache.settings import StoreSettings
from recipecache.errors import BackendError, BackendKeyError, ConfigError, VerificationError
from recipecache.eventlog import EventLog
from recipecache.runs.events import read_events
from recipecache.keys import storage_key
from recipecache.store import Store
from recipecache.store_admin import StoreAdmin
from harness.paths import WORKERS


def make_store(backend: Backend | None = None, *, secret: bytes | None = None, **kw: object) -> Store:
    return Store(backend or MemoryBackend(), StoreSettings(url="memory://", secret=secret, **kw), events=EventLog(None))


def test_round_trip_and_stats() -> None:
    store = make_store()
    assert store.get("k") is None
    store.put("k", b"payload")
    assert store.get("k") == b"payload"
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"]) == (1, 1, 1)
    assert stats["misses_by_reason"] == {"not_found": 1}
    assert stats["bytes_written"] == stats["bytes_read"] == 7
    json.dumps(stats)


def test_get_or_compile_compiles_once_per_key() -> None:
    store = make_store()
    calls: list[str] = []

    def compile_fn() -> bytes:
        calls.append("x")
        return b"artifact"

    assert store.get_or_compile("k", compile_fn) == b"artifact"
    assert store.get_or_compile("k", compile_fn) == b"artifact"
    assert calls == ["x"]
    stats = store.stats()
    assert (stats["compiles"], stats["leader"], stats["hits"]) == (1, 1, 1)


def test_compile_error_propagates_and_releases_the_lease() -> None:
    backend = MemoryBackend()
    store = make_store(backend)

    def broken() -> bytes:
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        store.get_or_compile("k", broken)
    # a second caller is not stuck behind the dead leader's lease
    assert store.get_or_compile("k", lambda: b"ok", wait_timeout=0.5) == b"ok"
    assert store.stats()["fallback"] == 0


def _corrupt(backend: MemoryBackend, namespace: str, key: str) -> None:
    skey = storage_key(namespace, key)
    blob = bytearray(backend.get(skey) or b"")
    blob[-1] ^= 0xFF
    backend.put(skey, bytes(blob))


def test_corrupt_entry_is_a_counted_miss_deleted_and_recompiled() -> None:
    backend = MemoryBackend()
    store = make_store(backend)
    store.put("k", b"good artifact")
    _corrupt(backend, store.namespace, "k")
    assert store.get("k") is None
    assert store.stats()["misses_by_reason"] == {"corrupt": 1}
    assert backend.get(storage_key(store.namespace, "k")) is None, "a bad entry is deleted"
    assert store.get_or_compile("k", lambda: b"good artifact") == b"good artifact"
    assert store.get("k") == b"good artifact"


@pytest.mark.parametrize("cut", [1, 5, 40])
def test_truncated_entry_is_corrupt(cut: int) -> None:
    backend = MemoryBackend()
    store = make_store(backend)
    store.put("k", b"x" * 100)
    skey = storage_key(store.namespace, "k")
    backend.put(skey, (backend.get(skey) or b"")[:-cut])
    assert store.get("k") is None
    assert store.stats()["misses_by_reason"] == {"corrupt": 1}


def test_entry_replayed_under_another_key_is_refused() -> None:
    backend = MemoryBackend()
    store = make_store(backend, secret=b"s3cret-of-16-bytes")
    store.put("a", b"artifact for a")
    backend.put(storage_key(store.namespace, "b"), backend.get(storage_key(store.namespace, "a")) or b"")
    assert store.get("b") is None
    assert store.stats()["misses_by_reason"] == {"corrupt": 1}


def test_signed_entries() -> None:
    backend = MemoryBackend()
    signed = make_store(backend, secret=b"the-right-secret")
    signed.put("k", b"code")
    assert signed.get("k") == b"code"
    wrong = make_store(backend, secret=b"the-wrong-secret")
    assert wrong.get("k") is None
    assert wrong.stats()["misses_by_reason"] == {"bad_signature": 1}
    # issue 15.3: a reader with another secret cannot prove the entry bad, so it leaves it
    assert backend.get(storage_key(signed.namespace, "k")) is not None, "a refused entry is not deleted"
    assert signed.get("k") == b"code", "the job with the right secret still hits"

    make_store(backend).put("u", b"unsigned code")
    strict = make_store(backend, secret=b"the-right-secret")
    assert strict.get("u") is None
    assert strict.stats()["misses_by_reason"] == {"unsigned": 1}
    assert make_store(backend).get("u") == b"unsigned code", "an unsigned entry is left for unsigned jobs"
    assert wrong.stats()["deleted_bad"] == strict.stats()["deleted_bad"] == 0


def test_forged_signature_is_refused() -> None:
    backend = MemoryBackend()
    store = make_store(backend, secret=b"the-right-secret")
    store.put("k", b"code")
    skey = storage_key(store.namespace, "k")
    fields, offset = envelope.read_header(backend.get(skey) or b"")
    evil = b"import os; os.system('rm -rf /')"
    # the attacker recomputes the checksum but cannot recompute the signature
    forged = envelope.seal("k", evil, namespace=store.namespace, secret=b"the attacker's guess")
    backend.put(skey, forged)
    assert store.get("k") is None
    assert store.stats()["misses_by_reason"] == {"bad_signature": 1}
    assert fields["size"] == 4 and offset > 0


class FailingBackend(MemoryBackend):
    """A backend whose service is down: every call raises like a dead Redis would."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise BackendError("backend_down", "connection refused")

    def get(self, key: str) -> bytes | None:
        self._check()
        return super().get(key)

    def put(self, key: str, value: bytes, *more: bytes) -> None:
        self._check()
        super().put(key, value, *more)

    def lease_add(self, name: str, token: str, ttl: float) -> bool:
        self._check()
        return super().lease_add(name, token, ttl)


def test_down_backend_degrades_to_local_compile(caplog: pytest.LogCaptureFixture) -> None:
    backend = FailingBackend()
    store = make_store(backend)
    for _ in range(5):
        assert store.get_or_compile("k", lambda: b"local") == b"local"
    stats = store.stats()
    assert stats["compiles"] == 5
    assert stats["misses_by_reason"] == {"backend_down": 5}
    assert stats["fallback_by_reason"] == {"backend_down": 5}
    assert stats["put_failures_by_reason"] == {"backend_down": 5}
    assert backend.calls == 1, "the circuit breaker spares the dead backend"
    assert sum("backend_down" in r.message for r in caplog.records) == 1, "one warning, not one per call"


def test_backend_recovers_after_retry_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("recipecache.breaker.RETRY_AFTER_S", 0.0)
    backend = FailingBackend()
    store = make_store(backend)
    assert store.get("k") is None
    backend.down = False
    store.put("k", b"v")
    assert store.get("k") == b"v"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_backs_off_while_the_backend_keeps_failing() -> None:
    """A backend down for a 10-minute job, looked up every second: a few calls reach it, not one per 5 s."""
    backend, clock = FailingBackend(), Clock()
    store = Store(backend, StoreSettings(url="memory://"), events=EventLog(None), clock=clock)
    tried_at = []
    for second in range(600):
        clock.now = 1000.0 + second
        before = backend.calls
        assert store.get(f"k{second}") is None
        if backend.calls > before:
            tried_at.append(second)
    pauses = [b - a for a, b in zip(tried_at, tried_at[1:])]
    assert pauses[:5] == [5, 10, 20, 40, 80], "each failed try doubles the pause"
    assert max(pauses) == 120 and len(tried_at) <= 10, tried_at
    assert store.stats()["misses_by_reason"] == {"backend_down": 600}, "every skipped call is counted"
    backend.down = False
    clock.now += 120
    assert store.put("k", b"v") and store.get("k") == b"v"
    backend.down = True
    assert store.get("k") is None
    clock.now += 5
    calls = backend.calls
    assert store.get("k") is None and backend.calls == calls + 1, "an answer resets the pause to the first one"


def test_breaker_lets_one_probe_through_at_a_time() -> None:
    class SlowDeadBackend(FailingBackend):
        """Down, and its probe hangs until the test lets it fail."""

        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def get(self, key: str) -> bytes | None:
            if self.calls:
                self.entered.set()
                self.release.wait(30)
            return super().get(key)

    backend, clock = SlowDeadBackend(), Clock()
    store = Store(backend, StoreSettings(url="memory://"), events=EventLog(None), clock=clock)
    assert store.get("k") is None and backend.calls == 1
    clock.now += 5
    probe = threading.Thread(target=store.get, args=("k",))
    probe.start()
    assert backend.entered.wait(30)
    assert [store.get(f"other{i}") for i in range(3)] == [None] * 3
    assert backend.calls == 1, "while one probe waits for the backend, the other calls do not"
    backend.release.set()
    probe.join(30)
    assert backend.calls == 2
    assert store.stats()["misses_by_reason"] == {"backend_down": 5}


def test_a_fault_of_one_key_leaves_the_breaker_closed() -> None:
    class OneBadKey(MemoryBackend):
        def get(self, key: str) -> bytes | None:
            if key.endswith(storage_key("default", "bad").rpartition("/")[2]):
                raise BackendKeyError("backend_error", "WRONGTYPE Operation against a key holding the wrong kind")
            return super().get(key)

    store = make_store(OneBadKey())
    store.put("good", b"v")
    for _ in range(3):
        assert store.get("bad") is None
        assert store.get("good") == b"v"
    assert store.begin("bad").reason == "backend_error"
    assert store.stats()["misses_by_reason"] == {"backend_error": 4}


def test_event_log_records_the_trace(tmp_path: Path) -> None:
    store = Store(MemoryBackend(), StoreSettings(url="memory://"), events=EventLog(tmp_path / "e.jsonl", rank=3))
    store.get_or_compile("k", lambda: b"v")
    store.get("k")
    store.close()
    events = list(read_events(tmp_path))
    assert [e["event"] for e in events] == ["miss", "compile_start", "compile", "put", "hit"]
    assert all(e["rank"] == 3 and e["key"] == "k" for e in events)
    assert {"time", "duration"} <= set(events[0])


def test_import_does_not_load_torch() -> None:
    import subprocess
    import sys

    code = "import sys, recipecache; recipecache.open_store('memory://'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_begin_with_a_stale_value_leads_or_waits_for_a_different_one() -> None:
    """A caller that cannot use what the key holds (no guard variant fits) compiles or waits for the next value."""
    store = make_store()
    store.put("k", b"variants A")
    with store.begin("k", stale=b"variants A") as flight:
        assert (flight.role, flight.data, flight.miss_reason) == ("leader", None, "guard_rejected")
        other = make_store(store.backend)
        waiting = finds_lease_held(other.backend)
        waited: list[object] = []
        waiter = threading.Thread(target=lambda: waited.append(other.begin("k", wait_timeout=30, stale=b"variants A")))
        waiter.start()
        assert waiting.wait(60), "the waiter never found the lease held"
        store.put("k", b"variants A+B")  # what the leader publishes
    waiter.join(timeout=30)
    follower = waited[0]
    assert (follower.role, follower.data) == ("follower", b"variants A+B")  # type: ignore[attr-defined]
    assert store.stats()["hits"] == 0 and store.stats()["misses"] == 0, "the caller counted its own lookup"


def test_each_lookup_and_put_is_counted_once_by_kind() -> None:
    """Issue 19, "count once": the store counts one outcome per lookup (a follower's is a hit, not a miss and a
    hit), by kind when the caller names one; a hit the caller cannot use becomes a miss once, and a stale
    begin, whose lookup the caller counted, adds none."""
    from recipecache.reasons import Reason

    store = make_store()
    follower = make_store(store.backend)  # another process on the same backend
    leader = store.begin("k", kind="fx")
    assert leader.role == "leader"
    waited: list[object] = []
    waiting = finds_lease_held(follower.backend)
    waiter = threading.Thread(target=lambda: waited.append(follower.begin("k", kind="fx", wait_timeout=30)))
    waiter.start()
    assert waiting.wait(60), "the waiter never found the lease held"
    leader.publish(b"artifact")
    waiter.join(timeout=30)
    assert waited[0].role == "follower"  # type: ignore[attr-defined]
    stats = follower.stats()
    assert (stats["hits"], stats["misses"], stats["misses_by_reason"]) == (1, 0, {}), "a follower's lookup is a hit"
    assert stats["by_kind"] == {"fx": {"hit": 1, "miss": 0, "put": 0}}

    assert store.lookup("k", kind="aot").data == b"artifact"
    store.record_unused_hit("k", Reason.INSTALL_FAILED, kind="aot", trace=False)
    store.begin("k", stale=b"artifact", kind="aot").release()  # the caller counted its own lookup
    store.put("copy", b"artifact")  # a put of no kind: in ``puts`` only
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"]) == (0, 2, 2)
    assert stats["misses_by_reason"] == {"not_found": 1, "install_failed": 1}
    assert stats["by_kind"] == {"fx": {"hit": 0, "miss": 1, "put": 1}, "aot": {"hit": 0, "miss": 1, "put": 0}}


# -- read-modify-write (Store.update, for the shared PGO state) -------------------------------
def test_update_is_read_modify_write() -> None:
    store = make_store()
    seen: list[bytes | None] = []

    def append(current: memoryview | None) -> bytes:
        seen.append(None if current is None else bytes(current))
        return (bytes(current) if current is not None else b"") + b"+"

    assert store.update("k", append).data == b"+"
    assert store.update("k", append).data == b"++"
    assert store.get("k") == b"++" and seen == [None, b"+"]
    assert store.update("k", lambda current: None).data == b"++", "None writes nothing"
    assert store.stats()["puts"] == 2


def test_update_describes_what_it_writes_with_meta() -> None:
    store = make_store()
    store.update("k", lambda current: b"merged", meta={"kind": "pgo"})
    blob = StoreAdmin(store).read_raw(storage_key(store.namespace, "k"))
    assert blob is not None
    assert envelope.open_envelope(blob, key="k", namespace=store.namespace)[0].meta == {"kind": "pgo"}


def test_update_retries_when_another_writer_wins_the_race() -> None:
    store = make_store()
    store.put("k", b"1")
    rival = make_store(store.backend)
    calls: list[bytes] = []

    def add_one(current: memoryview | None) -> bytes:
        assert current is not None
        calls.append(bytes(current))
        if len(calls) == 1:
            rival.put("k", b"10")  # another process writes between our read and our write
        return str(int(bytes(current)) + 1).encode()

    assert store.update("k", add_one).data == b"11"
    assert calls == [b"1", b"10"]
    assert store.stats()["update_conflicts"] == 1


def test_update_gives_up_after_its_attempts_as_a_counted_conflict() -> None:
    store = make_store()
    rival = make_store(store.backend)

    def always_raced(current: memoryview | None) -> bytes:
        rival.put("k", b"rival")
        return b"mine"

    result = store.update("k", always_raced, attempts=3)
    assert (result.data, result.reason) == (None, "conflict")
    assert store.stats()["update_conflicts"] == 3
    assert store.stats()["put_failures_by_reason"] == {"conflict": 1}


def test_update_replaces_what_it_refuses_and_survives_a_dead_backend() -> None:
    backend = MemoryBackend()
    make_store(backend, secret=b"another-jobs-secret").put("k", b"theirs")
    store = make_store(backend, secret=b"our-secret-0123456")
    got: list[memoryview | None] = []
    assert store.update("k", lambda current: got.append(current) or b"ours").data == b"ours"
    assert got == [None], "an entry it refuses is no input to the update"
    assert store.get("k") == b"ours"
    down = make_store(FailingBackend())
    result = down.update("k", lambda current: b"x")
    assert (result.data, result.reason) == (None, "backend_down")
    assert down.stats()["put_failures_by_reason"] == {"backend_down": 1}


@pytest.mark.parametrize("kind", ["filesystem", pytest.param("redis", marks=pytest.mark.redis)])
def test_update_from_racing_processes_loses_nothing(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    import subprocess
    import sys

    url = f"file://{tmp_path / 'c'}" if kind == "filesystem" else request.getfixturevalue("redis_url") + "?chunk_size=4KiB"
    worker = WORKERS / "cas_worker.py"
    namespace = "upd" + secrets.token_hex(4)
    procs = [subprocess.Popen([sys.executable, str(worker), url, "0", "update", namespace, "pgo", "20", "6000"],
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    conflicts = [int(p.communicate(timeout=240)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    value = recipecache.open_store(url, namespace=namespace).get("pgo")
    assert value is not None and int(bytes(value[:16])) == 80, f"lost updates ({sum(conflicts)} conflicts)"


def test_operator_probes_go_through_the_stores_own_sealing() -> None:
    """What doctor and the CLI need from a store: its backend keys, sealing, leases, checks and discovery."""
    secret = secrets.token_bytes(32)
    store = make_store(secret=secret, namespace="ops")
    ops = StoreAdmin(store)
    ops.discover()  # a memory store always names a usable service
    ops.write_sealed("probe", b"payload")
    skey = ops.storage_key("probe")
    assert skey == storage_key("ops", "probe")
    blob = ops.read_raw(skey)
    assert blob is not None and ops.open_entry("probe", blob) == b"payload"
    assert store.get("probe") == b"payload"  # sealed and signed as put does
    with pytest.raises(VerificationError):
        ops.open_entry("other", blob)
    assert ops.lease_is_exclusive("probe")
    assert ops.lease_is_exclusive("probe")  # released: free again
    assert ops.health_checks("probe") == []
    assert store.stats()["puts"] == 0  # probes are not the job's puts
