"""Redis Cluster specifics on real servers: a primary killed mid-race, and bad cluster URLs.

The backend conformance suite and the single-flight race also run on a cluster
(test_backend_conformance.py, test_singleflight.py); the ACL user on a cluster is in
test_deploy_cluster.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot
from harness.redis_cluster import RedisCluster
from harness.ports import free_port

import recipecache
from recipecache.reasons import Role
from recipecache.store import Flight
from recipecache.runs.events import read_events
from recipecache.keys import storage_key
from launcher.main import main as launcher_main
from harness.paths import WORKERS

PROCESSES, KEYS = 8, 40


def expected(key: str) -> str:
    """What race_worker.py's compile of ``key`` returns, hashed as it reports it."""
    return hashlib.sha256(hashlib.sha256(key.encode()).digest() * 1000).hexdigest()


def published(events: Path) -> set[str]:
    """The keys whose put the racing processes have logged so far."""
    return {e["key"] for e in read_events(events) if e["event"] == "put"}


#: the key the test holds the lease of while it kills the primary, so the race cannot end before that
GATE = "graph-0"


def take_gate(url: str, namespace: str) -> Flight:
    """The lease of :data:`GATE`, taken before any racer starts; tried again while a new cluster's first calls
    fail (a store that failed a call has no lease to give: its role is ``fallback``)."""
    deadline = time.monotonic() + 60
    while True:
        gate = recipecache.open_store(url, namespace=namespace).begin(GATE, trace=False)
        if gate.role is Role.LEADER:
            return gate
        assert time.monotonic() < deadline, f"the test never got the gate's lease: {gate.role} ({gate.reason})"
        time.sleep(0.1)


@pytest.mark.redis
def test_a_primary_killed_mid_race_raises_nothing_and_loses_no_entry(tmp_path: Path) -> None:
    """Every wait is for an event, none for a time (issue 28: this failed on a loaded machine):

    * mid-race by construction: the test takes the lease of one key first and holds it until the primary is
      dead, so no racer can finish before the kill (each waits for that key), however slow the machine; the
      primary killed is another than the key's, so no racer's wait for it fails (and compiles it) meanwhile;
    * killed once a put has landed (else the breaker keeps everything local and nothing is published);
    * every process's calls may take 30 s (the URL's ``timeout``): with 1 s a loaded machine made a racer's
      call late, its breaker opened and it compiled every key alone and exited before the kill: that is the
      store degrading as designed, not the race this test is about. A dead node's port refuses at once, and
      a write to the paused primary ends when it is killed, so no call waits that long here;
    * the victim is killed paused and with its replica caught up: Redis replicates asynchronously, so a
      primary killed at a random moment loses the writes it acknowledged last, and the test would blame the
      store for entries Redis dropped.
    """
    with RedisCluster(tmp_path / "cluster", replicas=1) as cluster:
        namespace = "fault" + secrets.token_hex(4)
        counts, events = tmp_path / "compiles.log", tmp_path / "events"
        url = cluster.url + "?timeout=30"
        gate = take_gate(url, namespace)
        env = {**os.environ, "RECIPECACHE_EVENT_LOG": str(events), "RECIPECACHE_LEASE_TTL": "2"}
        procs = [subprocess.Popen([sys.executable, str(WORKERS / "race_worker.py"), url,
                                   namespace, str(counts), str(KEYS), str(tmp_path / f"out{i}.json")], env=env)
                 for i in range(PROCESSES)]
        try:
            deadline = time.monotonic() + 120
            while not counts.exists() or len(counts.read_text().split()) < 5 or not published(events):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the race never started"
                time.sleep(0.01)
            gate_primary = cluster.primary_of(key_slot(f"rc:e:{{{storage_key(namespace, GATE)}}}".encode()))
            victim = next(node for node in cluster.primary_nodes() if node is not gate_primary)
            cluster.quiesce(victim)
            cluster.kill(victim)
            still_racing = sum(p.poll() is None for p in procs)
            cluster.wait_ok()  # a replica has taken the dead primary's slots
            gate.release()  # a racer takes the gate key over and compiles it
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            gate.release()
            for p in procs:
                p.kill()
        assert still_racing > 0, "the primary died mid-race"
        assert codes == [0] * PROCESSES, "no process raised"
        outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(PROCESSES)]
        want = {f"graph-{i}": expected(f"graph-{i}") for i in range(KEYS)}
        assert all(o["results"] == want for o in outs), "every process got every artifact, whole"

        keys = published(events)
        assert keys, "artifacts were published"
        store = recipecache.open_store(cluster.url, namespace=namespace)
        for key in keys:
            data = store.get(key)
            assert data is not None and hashlib.sha256(data).hexdigest() == want[key], f"{key} was lost"


def _bad_cluster_urls() -> dict[str, tuple[str, str]]:
    dead = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    return {
        "unknown scheme": ("redis+shard://127.0.0.1:7000", "unsupported cache URL"),
        "cluster db 1": ("redis+cluster://127.0.0.1:7000/1", "only database 0"),
        "bad seed port": ("redis+cluster://127.0.0.1:7000,127.0.0.1:x", "bad host"),
        "unreachable seeds": (f"redis+cluster://{dead}?timeout=0.5", "unreachable"),
        "sentinel without service": ("redis+sentinel://127.0.0.1:26379", "name the service"),
        "tls option without tls": ("redis+cluster://127.0.0.1:7000?ssl_ca_certs=/ca.pem", "rediss+cluster://"),
    }


@pytest.mark.parametrize("case", list(_bad_cluster_urls()))
def test_bad_cluster_urls_are_one_line_and_exit_2(case: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url, message = _bad_cluster_urls()[case]
    cli = subprocess.run([sys.executable, "-m", "recipecache.tools.cli", "stats", "--url", url], capture_output=True,
                         text=True, check=False, timeout=60)
    assert cli.returncode == 2, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and message in cli.stderr and "Traceback" not in cli.stderr

    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    assert launcher_main(["--url", url, "--run-dir", str(tmp_path / "run"), str(script)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("recipecache-run: error: ") and message in err
    assert not (tmp_path / "run").exists()


@pytest.mark.redis
def test_a_put_out_of_memory_half_way_on_a_cluster_leaves_no_chunk_behind(redis_cluster: RedisCluster) -> None:
    """As on one server (test_redis_backend.py): the primary of the entry's slot refuses a chunk half-way, and
    no chunk of the failed put is left without an expiry (issue 18, item 9)."""
    from recipecache.backends import open_backend

    backend = open_backend(redis_cluster.url + "?chunk_size=64KiB")
    key = f"full{secrets.token_hex(3)}/{secrets.token_hex(16)}"
    primaries = [redis_cluster.client(node) for node in redis_cluster.primary_nodes()]
    for client in primaries:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 256 * 1024)
    try:
        with pytest.raises(recipecache.BackendError) as info:
            backend.put(key, secrets.token_bytes(2 * 1024 * 1024))
    finally:
        for client in primaries:
            client.config_set("maxmemory", 0)
    left = [(c, client.pttl(c)) for client in primaries for c in client.keys(f"rc:c:{{{key}}}:*")]
    assert all(0 < pttl for _c, pttl in left), left
    assert left == [], "the chunks written before the refusal went at once"
    assert info.value.reason == "backend_full", info.value
    backend.put(key, b"fits again" * 10_000)
    assert backend.get(key) == b"fits again" * 10_000


def test_a_slot_in_migration_is_its_keys_miss_not_a_failed_cluster(redis_cluster: RedisCluster) -> None:
    """One hash slot MIGRATING/IMPORTING between two primaries answers TRYAGAIN/ASK for its keys only.

    Before: redis-py's "TTL exhausted" after the TRYAGAIN replies opened the circuit breaker, so an
    unrelated key's lookup right after was a ``backend_error``.
    """
    namespace = "mig" + secrets.token_hex(4)
    store = recipecache.open_store(redis_cluster.url, namespace=namespace)
    assert store.put("k", b"before")
    assert store.put("other", b"fine")
    slot, other_slot = (key_slot(f"rc:e:{{{storage_key(namespace, k)}}}".encode()) for k in ("k", "other"))
    assert slot != other_slot
    nodes = {node.port: redis.Redis(port=node.port) for node in redis_cluster.nodes}
    source = next(int(port) for start, end, (_host, port, *_), *_ in next(iter(nodes.values())).execute_command(
        "CLUSTER", "SLOTS") if start <= slot <= end)
    target = next(port for port in nodes if port != source)
    ids = {port: client.execute_command("CLUSTER", "MYID").decode() for port, client in nodes.items()}
    nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    try:
        assert not store.put("k", b"during"), "a script on the migrating slot's keys gets TRYAGAIN"
        assert store.get("other") == b"fine", "the circuit breaker stays closed for every other key"
        assert store.put("other", b"still fine") and store.get("other") == b"still fine"
        assert store.get("k") == b"before", "single-key reads of the migrating slot still work"
        stats = store.stats()
        assert stats["put_failures_by_reason"] == {"backend_error": 1}
        assert stats["misses_by_reason"] == {}
    finally:
        for port in (source, target):
            nodes[port].execute_command("CLUSTER", "SETSLOT", slot, "STABLE")


@pytest.mark.redis
def test_a_dead_primary_leaves_only_its_own_keys_alone(tmp_path: Path) -> None:
    """A breaker per cluster node (issue 28): one primary SIGKILLed, no replica to take over its slots.

    Before: the store had one breaker for the whole backend, so the dead primary's first failed lookup
    opened it and every key of the two live primaries missed too (``backend_down``) for the pause. The
    store's clock is frozen, so a pause never ends here, whatever the machine's speed: every lookup after
    the first failure is asked of an open breaker, and only the dead node's may be.
    """
    from recipecache.backends import open_backend
    from recipecache.eventlog import EventLog
    from recipecache.settings import StoreSettings
    from recipecache.store import Store

    with RedisCluster(tmp_path / "cluster") as cluster:
        namespace = "node" + secrets.token_hex(4)
        backend = open_backend(cluster.url + "?timeout=30")
        store = Store(backend, StoreSettings(url=cluster.url, namespace=namespace), events=EventLog(None),
                      clock=lambda: 1000.0)
        keys = [f"k{i}" for i in range(30)]
        for key in keys:
            assert store.put(key, key.encode())
        owner = {key: cluster.primary_of(key_slot(f"rc:e:{{{storage_key(namespace, key)}}}".encode())).port
                 for key in keys}
        victim = next(node for node in cluster.primary_nodes() if node.port == owner[keys[0]])
        dead = [key for key in keys if owner[key] == victim.port]
        live = [key for key in keys if owner[key] != victim.port]
        assert dead and live
        cluster.kill(victim)

        for _round in range(3):
            for key in dead:
                assert store.get(key) is None, "the dead primary's keys degrade to a miss"
                for other in live:
                    assert store.get(other) == other.encode(), f"{other} (a live primary's) was paused too"
        assert store.put(live[0], b"new") and store.get(live[0]) == b"new", "puts to live primaries go on"
        assert not store.put(dead[0], b"new")
        stats = store.stats()
        assert stats["misses_by_reason"] == {"backend_down": 3 * len(dead)}, stats
        assert stats["put_failures_by_reason"] == {"backend_down": 1}, stats
        assert store.unavailable() == {f"127.0.0.1:{victim.port}": "backend_down"}, "one node's breaker is open"
