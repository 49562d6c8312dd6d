"""Single-flight across real processes, on the filesystem backend, a real redis-server and a real
3-primary Redis Cluster."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from support.lease_spy import finds_lease_held
from support.processes import wait_until_ready

import recipecache
from recipecache.backends import open_backend
from recipecache.keys import storage_key
from recipecache.lease import SingleFlight
from harness.paths import WORKERS



@pytest.fixture(params=["filesystem", "redis", "redis-cluster"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "filesystem":
        return f"file://{tmp_path / 'cache'}"
    request.applymarker(pytest.mark.redis)
    if request.param == "redis-cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    return str(request.getfixturevalue("redis_url"))


def test_16_processes_race_on_50_keys(url: str, tmp_path: Path) -> None:
    namespace = "race" + secrets.token_hex(4)
    counts = tmp_path / "compiles.log"
    procs = [
        subprocess.Popen([sys.executable, str(WORKERS / "race_worker.py"), url, namespace, str(counts), "50",
                          str(tmp_path / f"out{i}.json")])
        for i in range(16)
    ]
    for p in procs:
        assert p.wait(timeout=240) == 0
    compiled = Counter(counts.read_text().split())
    assert len(compiled) == 50
    assert set(compiled.values()) == {1}, f"keys compiled more than once: {[k for k, n in compiled.items() if n > 1]}"
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(16)]
    assert all(o["results"] == outs[0]["results"] for o in outs), "every process got identical bytes"
    assert sum(o["stats"]["leader"] for o in outs) == 50
    assert sum(o["stats"]["fallback"] for o in outs) == 0


def test_leader_killed_mid_compile_is_taken_over(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader dies once the follower has found its lease held (issue 28: an event, not a time; killed first, a
    follower slower than the dead leader's 1 s lease took a free lease on a loaded machine: no takeover)."""
    monkeypatch.setenv("RECIPECACHE_LEASE_TTL", "1")
    namespace = "kill" + secrets.token_hex(4)
    ready = tmp_path / "ready"
    leader = subprocess.Popen([sys.executable, str(WORKERS / "stuck_leader.py"), url, namespace, "k", str(ready)])
    try:
        wait_until_ready(leader, ready, "the leader")
        store = recipecache.open_store(url, namespace=namespace)
        found_held = finds_lease_held(store.backend)
        got: list[bytes] = []
        follower = threading.Thread(target=lambda: got.append(
            store.get_or_compile("k", lambda: b"from the follower", wait_timeout=60)))
        follower.start()
        assert found_held.wait(120), "the follower never found the lease held"
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        follower.join(timeout=120)
        assert got == [b"from the follower"]
        stats = store.stats()
        assert stats["takeovers"] == 1 and stats["leader"] == 1 and stats["fallback"] == 0
        assert stats["waits"] == 1 and stats["wait_s"] > 0
    finally:
        leader.kill()


def test_follower_gives_up_after_its_deadline(url: str, tmp_path: Path) -> None:
    namespace = "slow" + secrets.token_hex(4)
    ready = tmp_path / "ready"
    leader = subprocess.Popen([sys.executable, str(WORKERS / "stuck_leader.py"), url, namespace, "k", str(ready)])
    try:
        while not ready.exists():
            assert leader.poll() is None
            time.sleep(0.05)
        store = recipecache.open_store(url, namespace=namespace)
        assert store.get_or_compile("k", lambda: b"local", wait_timeout=0.5) == b"local"
        assert store.stats()["fallback_by_reason"] == {"wait_timeout": 1}
    finally:
        leader.kill()
        leader.wait()


def test_a_fetch_that_raises_releases_the_lease(url: str) -> None:
    """The leader's look for a result published meanwhile fails: nobody compiles under its lease, so it is freed."""
    backend = open_backend(url)
    name = storage_key("raise" + secrets.token_hex(4), "graph")

    def broken_fetch() -> bytes | None:
        raise RuntimeError("unreadable entry")

    with pytest.raises(RuntimeError, match="unreadable entry"):
        SingleFlight(backend, ttl=30).run(name, broken_fetch, timeout=5)
    assert backend.lease_add(name, "next", 30), "the lease is free for the next process at once"
    backend.close()
