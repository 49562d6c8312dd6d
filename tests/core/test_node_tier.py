"""The node tier: processes with one node directory read each artifact from the remote store once.

In-process stores over a shared in-memory "remote" check the logic (node hits, refused
copies, failures); real processes on a real redis-server check what the server sends.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from support.processes import kill_once_ready, wait_until_ready

import recipecache
from recipecache import envelope
from recipecache.backends.memory import MemoryBackend
from recipecache.errors import ConfigError
from recipecache.eventlog import EventLog
from recipecache.keys import storage_key
from recipecache.reasons import Role
from recipecache.settings import StoreSettings
from recipecache.store import Store
from recipecache.store_admin import StoreAdmin
from harness.paths import WORKERS



class CountingMemory(MemoryBackend):
    """The remote store: counts the reads that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        return super().get(key)


def node_store(remote: MemoryBackend, node_dir: Path, *, secret: bytes | None = None) -> Store:
    """A store as one process of the node that uses ``node_dir`` would open it."""
    settings = StoreSettings(url="memory://", secret=secret, node_dir=str(node_dir))
    return Store(remote, settings, events=EventLog(None))


def node_copy(node_dir: Path, store: Store, key: str) -> Path:
    """Where ``store``'s node tier keeps its copy of ``key`` in ``node_dir`` (filed under the store's identity too)."""
    assert store.node is not None
    digest = store.node.copy_key(storage_key(store.namespace, key)).split("/")[1]
    return node_dir / "objects" / store.namespace / digest[:2] / digest


def test_a_nodes_other_processes_read_the_node_directory(tmp_path: Path) -> None:
    remote = CountingMemory()
    compiler = node_store(remote, tmp_path / "node-a")
    compiler.put("k", b"artifact")  # to the remote store and to its node's directory
    sibling = node_store(remote, tmp_path / "node-a")
    assert sibling.get("k") == b"artifact" and remote.gets == 0
    assert (sibling.stats()["node_hits"], sibling.stats()["hits"]) == (1, 1)

    elsewhere = node_store(remote, tmp_path / "node-b")
    assert elsewhere.get("k") == b"artifact" and remote.gets == 1
    assert node_store(remote, tmp_path / "node-b").get("k") == b"artifact" and remote.gets == 1
    assert elsewhere.stats()["node_fetches"] == 1
    assert elsewhere.stats()["node_dir"] == str(tmp_path / "node-b")


def test_entries_rewritten_in_place_never_come_from_a_stale_node_copy(tmp_path: Path) -> None:
    """update() reads the remote store; state read as it is (node=False) is never copied to a node;
    a graph's variants (update(node=True)) are, and begin(stale=...) reads past a stale copy and refreshes it."""
    remote = CountingMemory()
    node_a, node_b = node_store(remote, tmp_path / "a"), node_store(remote, tmp_path / "b")
    node_a.update("state", lambda current: b"one")
    assert not node_copy(tmp_path / "a", node_a, "state").exists(), "node=False: no node copy"
    node_b.update("state", lambda current: bytes(current or b"") + b"+two")
    assert node_a.get("state", node=False) == b"one+two"

    node_a.update("graph", lambda current: b"variant1", node=True)
    assert node_b.get("graph") == b"variant1"  # node b now holds a copy
    node_a.update("graph", lambda current: bytes(current or b"") + b"+variant2", node=True)
    assert node_a.get("graph") == b"variant1+variant2", "the writer's node copy is the value it wrote"
    stale = node_b.get("graph")
    assert stale == b"variant1", "node b's copy predates the merge (a graph's readers check their guards)"
    with node_b.begin("graph", stale=stale, wait_timeout=5.0) as flight:
        assert flight.role is Role.FOLLOWER and flight.data == b"variant1+variant2", "read past the stale copy"
    gets = remote.gets
    assert node_store(remote, tmp_path / "b").get("graph") == b"variant1+variant2" and remote.gets == gets, "refreshed"


def test_a_miss_everywhere_is_a_plain_miss(tmp_path: Path) -> None:
    store = node_store(CountingMemory(), tmp_path / "node")
    assert store.get("absent") is None
    stats = store.stats()
    assert stats["misses_by_reason"] == {"not_found": 1} and stats["node_fetches"] == 1
    assert store.get_or_compile("absent", lambda: b"compiled") == b"compiled"


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _other_keys_entry(path: Path) -> None:
    path.write_bytes(envelope.seal("another key", b"x" * 800, namespace=path.parent.parent.name))


@pytest.mark.parametrize("damage", [_flip_last_byte, _truncate, _other_keys_entry])
def test_a_bad_copy_in_the_node_directory_is_a_miss_and_is_fetched_again(tmp_path: Path, damage) -> None:
    remote = CountingMemory()
    secret = b"the-jobs-secret-16b"
    node = tmp_path / "node"
    first = node_store(remote, node, secret=secret)
    first.put("k", b"artifact" * 100)
    damage(node_copy(node, first, "k"))

    reader = node_store(remote, node, secret=secret)
    assert reader.get("k") == b"artifact" * 100, "refetched from the remote store"
    stats = reader.stats()
    assert (stats["node_deleted_bad"], stats["node_fetches"], stats["hits"], stats["misses"]) == (1, 1, 1, 0)
    assert remote.gets == 1
    assert node_store(remote, node, secret=secret).get("k") == b"artifact" * 100
    assert remote.gets == 1, "the copy is whole again: the next process reads it there"


def _signed_with_another_secret(path: Path) -> None:
    path.write_bytes(envelope.seal("k", b"x" * 800, namespace=path.parent.parent.name, secret=b"not-the-jobs-secret!"))


def _unsigned(path: Path) -> None:
    path.write_bytes(envelope.seal("k", b"x" * 800, namespace=path.parent.parent.name))


def _older_format(path: Path) -> None:
    path.write_bytes(b"RCE1" + bytes(800))


@pytest.mark.parametrize("other_jobs_copy", [_signed_with_another_secret, _unsigned, _older_format])
def test_a_copy_this_job_cannot_accept_is_left_for_the_jobs_that_can(tmp_path: Path, other_jobs_copy) -> None:
    """Issue 18.7: jobs with different secrets (or recipecache versions) share the default node directory;
    a copy one of them refuses is not damaged, so it stays for the job it belongs to."""
    node = tmp_path / "node"
    reader = node_store(CountingMemory(), node, secret=b"the-jobs-secret-16b")
    copy = node_copy(node, reader, "k")
    copy.parent.mkdir(parents=True)
    other_jobs_copy(copy)
    kept = copy.read_bytes()
    assert reader.get("k") is None, "refused here, and the remote store has none"
    assert copy.read_bytes() == kept
    assert reader.stats().get("node_deleted_bad", 0) == 0


def test_a_damaged_copy_replaced_meanwhile_is_not_deleted(tmp_path: Path) -> None:
    """The node tier deletes a damaged copy by compare-and-delete: a good copy another process of the
    node published between the read and the delete stays."""
    remote = CountingMemory()
    node = tmp_path / "node"
    store = node_store(remote, node)
    assert store.put("k", b"artifact")
    copy = node_copy(node, store, "k")
    good = copy.read_bytes()
    _flip_last_byte(copy)
    assert store.node is not None
    tier, name = store.node, storage_key(store.namespace, "k")

    def verify(blob: bytes) -> memoryview:
        tier.publish(name, good)  # meanwhile another process of the node leaves a good copy
        return envelope.open_envelope(blob, key="k", namespace=store.namespace)[1]

    assert tier.read(name, verify, lambda: (None, None), lambda payload: payload) == b"artifact"
    assert copy.read_bytes() == good and remote.gets == 0


def test_a_node_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir(mode=0o777)
    node.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        node_store(MemoryBackend(), node)


@pytest.mark.parametrize("owner, mode", [(65534, 0o755), (os.getuid(), 0o777)], ids=["another-user", "world-writable"])
def test_a_node_directory_replaced_mid_job_is_not_served(tmp_path: Path, owner: int, mode: int) -> None:
    """Issue 18.6: the node directory vanishes mid-job (a tmp cleaner) and comes back as another user's, or as
    one anybody may write, with an entry planted in it: the store (no secret) must not serve the planted bytes."""
    remote = CountingMemory()
    node = tmp_path / "node"
    store = node_store(remote, node)
    assert store.put("k", b"genuine artifact")
    shutil.rmtree(node)
    planted = node_copy(node, store, "k")
    planted.parent.mkdir(parents=True)
    planted.write_bytes(envelope.seal("k", b"planted code", namespace=store.namespace))
    for path in (node, *node.rglob("*")):
        os.chown(path, owner, owner)
    node.chmod(mode)
    assert store.get("k") == b"genuine artifact", "read from the remote store, not the planted node copy"
    assert store.stats()["node_errors"] >= 1
    assert store.put("k2", b"another artifact") and not node_copy(node, store, "k2").exists(), \
        "nothing is written there either"
    assert planted.read_bytes().endswith(b"planted code")


def test_a_node_directory_removed_mid_job_is_made_again(tmp_path: Path) -> None:
    remote = CountingMemory()
    node = tmp_path / "node"
    store = node_store(remote, node)
    assert store.put("k", b"artifact")
    shutil.rmtree(node)  # a tmp cleaner
    assert store.get("k") == b"artifact" and remote.gets == 1
    assert (node.stat().st_mode & 0o777, store.stats()["node_errors"]) == (0o700, 0)
    assert node_store(remote, node).get("k") == b"artifact" and remote.gets == 1, "the copy is back"


def test_a_failing_node_directory_falls_back_to_the_remote_store(tmp_path: Path) -> None:
    remote = CountingMemory()
    node = tmp_path / "node"
    store = node_store(remote, node)
    (node / "objects").write_text("not a directory")  # every write and lease in it now fails
    (node / "leases").write_text("not a directory")
    assert store.put("k", b"artifact")
    assert store.get("k") == b"artifact" and remote.gets == 1
    assert store.stats()["node_errors"] >= 1


def test_environment_sets_the_node_directory_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECIPECACHE_NODE_DIR", str(tmp_path / "rank{rank}" / "node"))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("RECIPECACHE_NODE_MAX_SIZE", "1MiB")
    store = recipecache.open_store("memory://")
    assert store.node is not None and store.node.directory == tmp_path / "rank3" / "node"
    assert store.node.backend.max_size == 1024**2
    monkeypatch.setenv("RECIPECACHE_NODE_MAX_SIZE", "lots")
    with pytest.raises(ConfigError, match="RECIPECACHE_NODE_MAX_SIZE"):
        recipecache.open_store("memory://")
    monkeypatch.delenv("RECIPECACHE_NODE_DIR")
    monkeypatch.delenv("RECIPECACHE_NODE_MAX_SIZE")
    assert recipecache.open_store("memory://").node is None


# -- real processes, a real redis-server --------------------------------------------------
NODES, PER_NODE, ARTIFACTS, SIZE = 2, 3, 3, 1024 * 1024


@pytest.mark.redis
def test_each_node_fetches_each_artifact_once(redis_url: str, tmp_path: Path) -> None:
    """2 simulated nodes x 3 processes read 3 artifacts of 1 MiB at once: Redis sends each artifact twice."""
    namespace = "node" + secrets.token_hex(4)
    seeder = recipecache.open_store(redis_url, namespace=namespace)
    payloads = {f"artifact-{i}": secrets.token_bytes(SIZE) for i in range(ARTIFACTS)}
    for key, data in payloads.items():
        assert seeder.put(key, data)
    client = redis.Redis.from_url(redis_url)
    start = tmp_path / "start"
    outs = {(n, p): tmp_path / f"node{n}-proc{p}.json" for n in range(NODES) for p in range(PER_NODE)}
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "node_reader.py"), redis_url, namespace,
                               str(tmp_path / f"node{n}"), str(start), str(out), *payloads])
             for (n, _), out in outs.items()]
    try:
        for proc, out in zip(procs, outs.values(), strict=True):  # each has imported and opened its store: they start together
            wait_until_ready(proc, Path(f"{out}.ready"), out.stem, timeout=300)
        sent_before = client.info("stats")["total_net_output_bytes"]
        start.touch()
        assert [p.wait(timeout=120) for p in procs] == [0] * len(procs)
        sent = client.info("stats")["total_net_output_bytes"] - sent_before
    finally:
        for p in procs:
            p.kill()
    expected = {k: hashlib.sha256(v).hexdigest() for k, v in payloads.items()}
    results = {where: json.loads(out.read_text()) for where, out in outs.items()}
    assert all(r["digests"] == expected for r in results.values())
    for n in range(NODES):
        assert sum(results[(n, p)]["stats"]["node_fetches"] for p in range(PER_NODE)) == ARTIFACTS, f"node {n}"
    total = ARTIFACTS * SIZE
    assert NODES * total <= sent < (NODES + 0.5) * total, f"Redis sent {sent / total:.2f}x the artifacts"


@pytest.mark.redis
def test_a_fetcher_killed_mid_fetch_is_taken_over(redis_url: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECIPECACHE_LEASE_TTL", "1")
    namespace = "nodekill" + secrets.token_hex(4)
    data = secrets.token_bytes(SIZE)
    assert recipecache.open_store(redis_url, namespace=namespace).put("k", data)
    node, ready = tmp_path / "node", tmp_path / "ready"
    fetcher = subprocess.Popen([sys.executable, str(WORKERS / "stuck_fetcher.py"), redis_url, namespace, str(node),
                                "k", str(ready)])
    try:
        kill_once_ready(fetcher, ready, "the fetcher")
    finally:
        fetcher.kill()
    monkeypatch.setenv("RECIPECACHE_NODE_DIR", str(node))
    sibling = recipecache.open_store(redis_url, namespace=namespace)
    assert sibling.get("k") == data
    stats = sibling.stats()
    assert (stats["node_takeovers"], stats["node_fetches"], stats["node_waits"]) == (1, 1, 0)
    assert not os.listdir(node / "leases" / namespace) or all(
        not name.endswith(".lease") for name in os.listdir(node / "leases" / namespace)), "no lease left behind"
    later = recipecache.open_store(redis_url, namespace=namespace)
    assert later.get("k") == data and later.stats()["node_hits"] == 1


@pytest.mark.parametrize("swap", ["symlink", "rename"])
def test_a_node_directory_swapped_between_its_check_and_its_use_is_never_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str) -> None:
    """Issue 28: the directory is checked, then swapped (renamed away and another put at its name, a real one or a
    symlink to one) before the store opens a file in it. Every read, write and lease goes through the directory
    that was checked (a held fd), so nothing planted in the swapped-in one is served, nothing lands in it. The
    swapped-in directory is one anybody may write (as another user's would be, it fails the check), so the
    uses after the swap, which check again, go to the remote store.

    Before: the check was an ``lstat`` of the path and each use opened ``<path>/objects/...`` again, through
    whatever was at the path by then."""
    from recipecache.fsutil import PrivateDirectory

    remote = CountingMemory()
    node, other = tmp_path / "node", tmp_path / "other"
    store = node_store(remote, node)
    assert store.put("k", b"genuine artifact")
    planted = node_copy(other, store, "k")
    planted.parent.mkdir(parents=True)
    other.chmod(0o777)
    planted.write_bytes(envelope.seal("k", b"planted code", namespace=store.namespace))

    checked = PrivateDirectory.path
    swaps = []

    def check_then_swap(self: PrivateDirectory) -> Path:
        """The check, then the swap, once: the window the store's use must not depend on."""
        path = checked(self)
        if not swaps:
            swaps.append(path)
            node.rename(tmp_path / "moved-away")
            if swap == "symlink":
                node.symlink_to(other)
            else:
                other.rename(node)
        return path

    monkeypatch.setattr(PrivateDirectory, "path", check_then_swap)
    swapped_in = other if swap == "symlink" else node
    assert store.get("k") == b"genuine artifact", "the checked directory's copy, not the planted one"
    assert swaps and remote.gets == 0
    assert store.put("k2", b"another artifact")
    assert store.get("k2") == b"another artifact" and remote.gets == 1
    assert store.stats()["node_errors"] >= 1
    files = sorted(p.relative_to(swapped_in) for p in swapped_in.rglob("*") if p.is_file())
    assert files == [planted.relative_to(other)], "nothing was written into the swapped-in directory"
    assert (swapped_in / planted.relative_to(other)).read_bytes().endswith(b"planted code")


# -- one node directory, several stores (issue 44 item 2) ---------------------------------------------------------
def two_stores(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, str]:
    """URLs of two stores holding different data: two directories, or two databases of a real redis-server."""
    if kind == "filesystem":
        return f"file://{tmp_path / 'store-a'}", f"file://{tmp_path / 'store-b'}"
    url = str(request.getfixturevalue("redis_url"))
    return url, url.rpartition("/")[0] + "/1"


@pytest.mark.parametrize("kind", ["filesystem", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_store_is_never_served_what_only_another_store_holds(kind: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               request: pytest.FixtureRequest) -> None:
    """Every job of a user on a node shares the default node directory: before, an entry put into store A was the
    answer of a lookup on store B (the directory was keyed by namespace and key only)."""
    url_a, url_b = two_stores(kind, tmp_path, request)
    namespace = "ns" + secrets.token_hex(4)
    monkeypatch.setenv("RECIPECACHE_NODE_DIR", str(tmp_path / "node"))
    a = recipecache.open_store(url_a, namespace=namespace)
    assert a.put("k", b"only in store A")
    assert recipecache.open_store(url_a, namespace=namespace).get("k") == b"only in store A", "A's node copy"

    b = recipecache.open_store(url_b, namespace=namespace)
    assert b.get("k") is None
    assert b.stats().get("node_hits", 0) == 0
    assert b.put("k", b"store B's own")
    assert recipecache.open_store(url_b, namespace=namespace).get("k") == b"store B's own"
    again = recipecache.open_store(url_a, namespace=namespace)
    assert again.get("k") == b"only in store A" and again.stats()["node_hits"] == 1


@pytest.mark.parametrize("kind", ["filesystem", pytest.param("redis", marks=pytest.mark.redis)])
def test_the_operator_tools_of_a_store_see_its_node_copies_and_no_others(kind: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         request: pytest.FixtureRequest) -> None:
    """ls shows store B's node copies (a damaged one as bad), verify --fix removes a damaged one, clear removes
    them; store A's copies in the same directory are none of B's tools' business."""
    from recipecache.tools import admin

    url_a, url_b = two_stores(kind, tmp_path, request)
    namespace = "ns" + secrets.token_hex(4)
    node = tmp_path / "node"
    monkeypatch.setenv("RECIPECACHE_NODE_DIR", str(node))
    a, b = recipecache.open_store(url_a, namespace=namespace), recipecache.open_store(url_b, namespace=namespace)
    assert a.put("a-only", b"A" * 100) and b.put("k", b"B" * 100)
    _flip_last_byte(node_copy(node, b, "k"))

    ops_a, ops_b = StoreAdmin(a), StoreAdmin(b)
    listed = [(r.storage_key, r.node, r.reason) for r in admin.inspect_entries(ops_b)]
    assert sorted(listed, key=str) == sorted([(ops_b.storage_key("k"), False, None),
                                              (ops_b.storage_key("k"), True, "corrupt")], key=str)
    result = admin.verify(ops_b, fix=True)
    assert [(r.storage_key, r.node) for r in result.removed] == [(ops_b.storage_key("k"), True)]
    assert not node_copy(node, b, "k").exists() and b.get("k") == b"B" * 100, "fetched and copied again"
    assert node_copy(node, b, "k").exists()

    assert admin.clear(ops_b) == 1
    assert not node_copy(node, b, "k").exists(), "cleared with the store's entry"
    assert node_copy(node, a, "a-only").exists()
    assert [r.node for r in admin.inspect_entries(ops_a)] == [False, True]
