"""The store over the in-memory and filesystem backends: envelopes, signing, stats, degradation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recipecache
from recipecache import envelope
from recipecache.backends.base import Backend
from recipecache.backends.memory import MemoryBackend
from recipecache.settings import StoreSettings
from recipecache.errors import BackendError, ConfigError
from recipecache.events import EventLog, read_events
from recipecache.keys import storage_key
from recipecache.store import Store


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
    assert make_store(backend, secret=b"the-wrong-secret").get("k") is None
    assert backend.get(storage_key(signed.namespace, "k")) is None, "a badly signed entry is deleted"

    make_store(backend).put("u", b"unsigned code")
    strict = make_store(backend, secret=b"the-right-secret")
    assert strict.get("u") is None
    assert strict.stats()["misses_by_reason"] == {"unsigned": 1}


def test_forged_signature_is_refused() -> None:
    backend = MemoryBackend()
    store = make_store(backend, secret=b"the-right-secret")
    store.put("k", b"code")
    skey = storage_key(store.namespace, "k")
    fields, offset = envelope.read_header(backend.get(skey) or b"")
    evil = b"import os; os.system('rm -rf /')"
    # the attacker recomputes the checksum but cannot recompute the HMAC
    forged = envelope.seal("k", evil, secret=b"the attacker's guess")
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

    def put(self, key: str, value: bytes) -> None:
        self._check()
        super().put(key, value)

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
    monkeypatch.setattr("recipecache.store.RETRY_AFTER_S", 0.0)
    backend = FailingBackend()
    store = make_store(backend)
    assert store.get("k") is None
    backend.down = False
    store.put("k", b"v")
    assert store.get("k") == b"v"


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
