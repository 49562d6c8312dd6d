"""Gaudi recipe sync across simulated nodes: real processes, a real filesystem store and redis-server.

A "node" is a recipe directory with its own agent process and simulated bridge ranks
(``hpu_bridge_sim.py``) that write and look up recipes by the bridge's file protocol.
Nothing waits on a clock: each step waits (with a generous deadline) for something the
processes did, such as a file appearing or an event in an agent's log.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.hpu_bridge_sim import lookup, recipe_bytes, write

import recipecache
from recipecache import envelope
from recipecache.errors import ConfigError
from recipecache.runs.events import read_events
from recipecache.hpu import (
    ENV_VAR,
    HpuSyncAgent,
    RecipeCacheConfig,
    format_config,
    hpu_fingerprint,
    node_directory,
    parse_config,
    rank_environment,
)
from recipecache.hpu.index import INDEX_KEY, Index, recipe_key
from recipecache.hpu.recipes import (
    META_SUFFIX,
    RECIPE_SUFFIX,
    TEMP_PREFIX,
    RecipeDir,
    RecipeFiles,
)
from recipecache.keys import storage_key
from harness.paths import REPO, TESTS

SIM = TESTS / "support" / "hpu_bridge_sim.py"
#: a hang guard: every wait is for an event (a process start took 13 s on a loaded machine, issue 28)
DEADLINE_S = 300.0
OLD, NEW = "1.18.0", "1.19.0"
MIB = 1024 * 1024


def wait_for(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def usage(directory: Path) -> int:
    """Bytes of recipes and metadata, what the bridge's cap counts (files may vanish meanwhile)."""
    total = 0
    for entry in os.scandir(directory):
        if entry.name.endswith((RECIPE_SUFFIX, META_SUFFIX)):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


def installed(directory: Path, name: str) -> bool:
    meta = directory / f"{name}{META_SUFFIX}"
    return meta.exists() and meta.stat().st_size > 0


class Bridge:
    """One simulated bridge rank on a node."""

    def __init__(self, directory: Path) -> None:
        env = {**os.environ, ENV_VAR: format_config(RecipeCacheConfig(str(directory)))}
        self.proc = subprocess.Popen([sys.executable, str(SIM)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=REPO)

    def send(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def run(self, name: str, size: int = 4096) -> str:
        return self.send(f"run {name} {size}").split()[0]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Node:
    """A recipe directory with its agent process (and bridges made on demand)."""

    def __init__(self, root: Path, name: str, url: str, namespace: str, *, driver: str = OLD, max_size_mb: int = 64,
                 env: dict[str, str] | None = None) -> None:
        self.dir = root / name / "recipes"
        self.events_dir = root / name / "events"
        self.url, self.namespace, self.driver, self.max_size_mb = url, namespace, driver, max_size_mb
        self.env = {**os.environ, "RECIPECACHE_EVENT_LOG": str(self.events_dir), **(env or {})}
        self.dir.mkdir(parents=True, mode=0o700)
        self.bridges: list[Bridge] = []
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "recipecache.hpu.agent", "--dir", str(self.dir), "--url", self.url,
             "--namespace", self.namespace, "--interval", "0.05", "--max-size-mb", str(self.max_size_mb),
             "--bridge-version", OLD, "--driver-version", self.driver, "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, cwd=REPO)

    def bridge(self) -> Bridge:
        self.bridges.append(Bridge(self.dir))
        return self.bridges[-1]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.events_dir) if e["event"] == kind] if self.events_dir.exists() else []

    def stop(self) -> dict[str, Any]:
        """Stop the agent (SIGTERM, as the launcher does) and return its final stats."""
        self.agent.send_signal(signal.SIGTERM)
        out, err = self.agent.communicate(timeout=DEADLINE_S)
        assert self.agent.returncode == 0, err
        return dict(json.loads(out)["agent"])

    def close(self) -> None:
        for bridge in self.bridges:
            bridge.close()
        if self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(name: str, url: str, namespace: str, **kwargs: Any) -> Node:
        made.append(Node(tmp_path, name, url, namespace, **kwargs))
        return made[-1]

    yield make
    for node in made:
        node.close()


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def namespace() -> str:
    return f"hpu-{uuid.uuid4().hex[:12]}"


# -- PT_HPU_RECIPE_CACHE_CONFIG --------------------------------------------------------
def test_config_parses_documented_forms_and_round_trips() -> None:
    assert parse_config("/r,True,20") == RecipeCacheConfig("/r", True, 20, None)
    assert parse_config("/r,false,2048,TRUE") == RecipeCacheConfig("/r", False, 2048, True)
    assert parse_config("/r") == RecipeCacheConfig("/r", False, 1024, None)
    for config in (RecipeCacheConfig("/r", True, 5), RecipeCacheConfig("/r", False, 7, False)):
        assert parse_config(format_config(config)) == config
    assert format_config(RecipeCacheConfig("/r")) == "/r,false,1024"


@pytest.mark.parametrize("text", ["", ",false,1024,false", "/r,maybe,10", "/r,false,0", "/r,false,-5", "/r,false,1.5",
                                  "/r,false,ten", "/r,false,10,yes", "/r,false,10,false,more"])
def test_config_refuses_bad_values_in_one_line(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert ENV_VAR in str(info.value) and "\n" not in str(info.value)


def test_rank_environment_clears_only_on_local_rank_zero_and_only_when_asked(tmp_path: Path) -> None:
    configs = [parse_config(rank_environment(r, namespace="job", directory=tmp_path, delete=True, max_size_mb=64)[ENV_VAR])
               for r in range(3)]
    assert [c.delete for c in configs] == [True, False, False]
    assert {c.path for c in configs} == {str(tmp_path)} and {c.max_size_mb for c in configs} == {64}
    assert not parse_config(rank_environment(0, namespace="job")[ENV_VAR]).delete
    default = Path(parse_config(rank_environment(1, namespace="job")[ENV_VAR]).path)
    assert default == node_directory("job") and default.name == "job" and str(os.getuid()) in default.parent.name
    for bad in ({"namespace": "../x"}, {"namespace": "job", "directory": tmp_path / "a,b"}):
        with pytest.raises(ConfigError):
            rank_environment(0, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", ["max_size", "env_config", "group_writable"])
def test_agent_command_refuses_bad_input_with_one_line(tmp_path: Path, case: str) -> None:
    directory = tmp_path / "recipes"
    args = ["--dir", str(directory), "--max-size-mb", "0"] if case == "max_size" else []
    env = {**os.environ, ENV_VAR: "/r,sometimes,10"} if case == "env_config" else dict(os.environ)
    if case == "group_writable":
        directory.mkdir()
        directory.chmod(0o770)
        args = ["--dir", str(directory)]
    proc = subprocess.run([sys.executable, "-m", "recipecache.hpu.agent", "--url", f"file://{tmp_path / 's'}", "--once",
                           *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=DEADLINE_S, check=False)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr


# -- across nodes ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_recipe_from_one_node_is_a_hit_on_the_others(backend: str, request: pytest.FixtureRequest,
                                                    nodes: Callable[..., Node]) -> None:
    url = request.getfixturevalue("file_url" if backend == "file" else "redis_url")
    ns = namespace()
    a, b, c = (nodes(n, url, ns) for n in "abc")
    assert a.bridge().run("r1") == "compiled"
    for node in (b, c):
        wait_for(f"r1 on {node.dir}", functools.partial(installed, node.dir, "r1"))
        assert node.bridge().run("r1") == "hit"
        assert (node.dir / "r1.recipe").read_bytes() == (a.dir / "r1.recipe").read_bytes() == recipe_bytes("r1", 4096)
    assert b.bridges[0].run("r2") == "compiled"
    for node in (a, c):
        wait_for(f"r2 on {node.dir}", functools.partial(installed, node.dir, "r2"))
    assert a.bridges[0].run("r2") == "hit"
    stats = {n.dir.parent.name: n.stop() for n in (a, b, c)}
    assert (stats["a"]["published"], stats["a"]["installed"]) == (1, 1)
    assert (stats["b"]["published"], stats["b"]["installed"]) == (1, 1)
    assert (stats["c"]["published"], stats["c"]["installed"]) == (0, 2)
    assert [e["key"] for e in a.events("hpu_publish")] == ["r1"] and [e["key"] for e in c.events("hpu_install")] == ["r1", "r2"]


def test_partial_recipes_are_never_published_or_installed(nodes: Callable[..., Node], file_url: str) -> None:
    ns = namespace()
    a, b = nodes("a", file_url, ns), nodes("b", file_url, ns)
    store = recipecache.open_store(file_url, namespace=ns)
    key = recipe_key("held", hpu_fingerprint(OLD, OLD))
    writer, other = a.bridge(), a.bridge()
    # 1. Everything written, lock still held: only the lock says "not yet".
    assert writer.send("stall held 4096 meta") == "stalled held"
    assert other.run("ok1") == "compiled"
    wait_for("ok1 on b", lambda: installed(b.dir, "ok1"))  # a's agent has passed over "held" since it was written
    assert not (b.dir / "held.recipe").exists() and store.get(key) is None
    assert writer.send("finish") == "written held"
    wait_for("held on b once released", lambda: installed(b.dir, "held"))
    # 2. A writer killed half way through the recipe: the lock goes, the metadata never comes.
    crashing = a.bridge()
    assert crashing.send("stall torn 8192 recipe") == "stalled torn"
    crashing.close()
    assert other.run("ok2") == "compiled"
    wait_for("ok2 on b", lambda: installed(b.dir, "ok2"))
    assert not (b.dir / "torn.recipe").exists() and store.get(recipe_key("torn", hpu_fingerprint(OLD, OLD))) is None
    assert other.run("torn") == "compiled"  # a rank on a misses the torn recipe and writes it whole
    wait_for("torn on b once whole", lambda: installed(b.dir, "torn"))
    assert b.bridge().run("torn") == "hit"
    assert sorted(e["key"] for e in a.events("hpu_publish")) == ["held", "ok1", "ok2", "torn"]


def test_node_with_another_driver_never_receives_the_recipe(nodes: Callable[..., Node], file_url: str) -> None:
    ns = namespace()
    a, b, newer = nodes("a", file_url, ns), nodes("b", file_url, ns), nodes("newer", file_url, ns, driver=NEW)
    assert a.bridge().run("r1") == "compiled"
    wait_for("r1 on b", lambda: installed(b.dir, "r1"))
    skipped = wait_for("newer skipping r1", lambda: newer.events("hpu_skip"))
    assert skipped[0]["key"] == "r1" and skipped[0]["reason"] == "incompatible"
    assert skipped[0]["built_with"] == {"hpu_bridge": OLD, "hpu_driver": OLD}
    assert newer.bridge().run("r1") == "compiled"  # and its own r1 is published under its own fingerprint
    wait_for("b counting newer's r1", lambda: b.events("hpu_skip"))
    stats = newer.stop()
    assert (stats["skipped_incompatible"], stats["installed"], stats["published"]) == (1, 0, 1)
    assert (newer.dir / "r1.recipe").read_bytes() == recipe_bytes("r1", 4096)
    store = recipecache.open_store(file_url, namespace=ns)
    assert recipe_key("r1", hpu_fingerprint(OLD, OLD)) != recipe_key("r1", hpu_fingerprint(OLD, NEW))
    assert store.get(recipe_key("r1", hpu_fingerprint(OLD, NEW))) is not None
    assert b.stop()["skipped_incompatible"] == 1


def test_directory_stays_under_its_cap_on_every_node(nodes: Callable[..., Node], file_url: str) -> None:
    ns = namespace()
    a, small = nodes("a", file_url, ns), nodes("small", file_url, ns, max_size_mb=1)
    bridge = a.bridge()
    names = [f"big{i}" for i in range(6)]
    for name in names:
        assert bridge.run(name, 300 * 1024) == "compiled"
    assert bridge.run("huge", 3 * MIB // 2) == "compiled"
    samples: list[int] = []

    def settled() -> bool:
        samples.append(usage(small.dir))
        return len(small.events("hpu_install")) == len(names) and bool(small.events("hpu_skip"))

    wait_for("small node to take every recipe", settled)
    assert max(samples) <= MIB
    present = sorted(p.stem for p in small.dir.glob("*.recipe"))
    assert present == names[-3:]  # 3 x 300 KiB fit in 1 MiB; the oldest went first
    assert small.bridge().run(names[-1], 300 * 1024) == "hit"
    stats = small.stop()
    assert (stats["installed"], stats["evicted"], stats["too_large"]) == (6, 3, 1)
    assert small.events("hpu_skip")[0]["reason"] == "too_large"


def test_tampered_store_entry_is_refused_and_counted(nodes: Callable[..., Node], file_url: str) -> None:
    ns = namespace()
    secret = {"RECIPECACHE_SECRET": "job-secret-16-bytes"}
    a = nodes("a", file_url, ns, env=secret)
    assert a.bridge().run("r1") == "compiled"
    wait_for("a publishing r1", lambda: a.events("hpu_publish"))
    store = recipecache.open_store(file_url, namespace=ns)
    key = recipe_key("r1", hpu_fingerprint(OLD, OLD))
    forged = RecipeFiles("r1", b"\xcc" * 4096, b'{"size": 4096}').pack()
    store.backend.put(storage_key(ns, key), envelope.seal(key, forged, namespace=ns,
                                                          secret=b"not-the-job-secret-either"))
    b = nodes("b", file_url, ns, env=secret)
    refused = wait_for("b refusing r1", lambda: b.events("hpu_refuse"))
    assert refused[0]["key"] == "r1" and refused[0]["reason"] == "bad_signature"
    stats = b.stop()
    assert (stats["refused"], stats["installed"]) == (1, 0)
    assert not (b.dir / "r1.recipe").exists() and not installed(b.dir, "r1")


# -- in one process: the index and the directory protocol -------------------------------
@pytest.fixture
def pair(tmp_path: Path) -> tuple[HpuSyncAgent, HpuSyncAgent, recipecache.Store]:
    store = recipecache.open_store("memory://", namespace="job", secret="s" * 16)
    fp = hpu_fingerprint(OLD, OLD)
    return (HpuSyncAgent(tmp_path / "a", store, fingerprint=fp), HpuSyncAgent(tmp_path / "b", store, fingerprint=fp),
            store)


def test_lost_or_tampered_index_heals(pair: tuple[HpuSyncAgent, HpuSyncAgent, recipecache.Store]) -> None:
    a, b, store = pair
    assert write(a.dir.path, "r1", 1000)
    a.sync_once()
    before_r1 = store.get(INDEX_KEY)
    assert write(a.dir.path, "r2", 1000)
    a.sync_once()
    store.put(INDEX_KEY, before_r1 or b"")  # a racing agent's write, based on an older read, drops r2
    assert [name for _fp, name in Index.decode(store.get(INDEX_KEY) or b"").entries] == ["r1"]
    a.sync_once()
    b.sync_once()
    assert lookup(b.dir.path, "r1") and lookup(b.dir.path, "r2")
    # Both confirmed; now the index is replaced by an unsigned one, which the store refuses (and leaves for the
    # next put to replace).
    store.backend.put(storage_key("job", INDEX_KEY), envelope.seal(INDEX_KEY, Index.empty().encode(), namespace="job"))
    assert write(b.dir.path, "r3", 1000)
    b.sync_once()  # b reads no index and writes one with r3 only
    a.sync_once()  # a puts r1 and r2 back
    entries = Index.decode(store.get(INDEX_KEY) or b"").entries
    assert sorted(name for _fp, name in entries) == ["r1", "r2", "r3"]
    assert (a.stats()["published"], a.stats()["installed"]) == (2, 1)
    assert (b.stats()["refused"], a.stats()["refused"]) == (1, 0)


def test_clear_removes_recipes_and_leftover_temps(tmp_path: Path) -> None:
    directory = tmp_path / "recipes"
    directory.mkdir(mode=0o700)
    assert write(directory, "old", 1000)
    (directory / f"{TEMP_PREFIX}dead").write_bytes(b"x")
    store = recipecache.open_store("memory://", namespace="job")
    HpuSyncAgent(directory, store, fingerprint=hpu_fingerprint(OLD, OLD))
    assert sorted(p.name for p in directory.iterdir()) == ["old.meta", "old.recipe"]  # temps only
    HpuSyncAgent(directory, store, fingerprint=hpu_fingerprint(OLD, OLD), clear=True)
    assert list(directory.iterdir()) == []


def test_eviction_leaves_recipes_a_rank_is_reading(tmp_path: Path) -> None:
    directory = tmp_path / "recipes"
    directory.mkdir(mode=0o700)
    for name in ("first", "second"):
        assert write(directory, name, 400 * 1024)
        os.utime(directory / f"{name}.recipe", (1, 1 if name == "first" else 2))
    recipes = RecipeDir(directory, MIB)
    fd = os.open(directory / "first.meta", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a bridge rank reading the oldest recipe
        assert recipes.make_room(400 * 1024) == (True, ["second"])
        assert recipes.make_room(800 * 1024) == (False, [])
    finally:
        os.close(fd)
    assert recipes.make_room(800 * 1024) == (True, ["first"])


def test_started_agent_publishes_and_ends_with_its_parent(tmp_path: Path, file_url: str) -> None:
    directory = tmp_path / "recipes"
    parent = subprocess.Popen(
        [sys.executable, "-c",
         ("import sys, recipecache.hpu as h\n"
          f"p = h.start_agent(directory={str(directory)!r}, url={file_url!r}, namespace='job', interval=0.05,"
          f" bridge_version={OLD!r}, driver_version={OLD!r})\n"
          "print(p.pid, flush=True)\nsys.stdin.readline()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert parent.stdout is not None and parent.stdin is not None
    agent_pid = int(parent.stdout.readline())
    wait_for("the agent to create the directory", directory.exists)
    assert write(directory, "r1", 1000)
    store = recipecache.open_store(file_url, namespace="job")
    wait_for("r1 in the store", lambda: store.get(recipe_key("r1", hpu_fingerprint(OLD, OLD))))
    parent.stdin.close()
    parent.wait(timeout=DEADLINE_S)

    def gone() -> bool:
        try:
            return Path(f"/proc/{agent_pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
        except (FileNotFoundError, IndexError):
            return True

    wait_for("the orphaned agent to exit", gone)


# -- the agent never stops syncing silently (issue 15, item 1) ---------------------------
@pytest.mark.redis
def test_agent_syncs_on_through_a_hostile_index_manifest(nodes: Callable[..., Node], redis_url: str) -> None:
    """The issue's 33-byte RCM1 manifest (count 30,000,000) under the index key killed the sync thread."""
    import struct

    import redis

    ns = namespace()
    redis.Redis.from_url(redis_url).set(f"rc:e:{storage_key(ns, INDEX_KEY)}",
                                        b"RCM1" + struct.pack(">IQ", 30_000_000, 240_000_000) + b"g" * 17)
    a, b = nodes("a", redis_url, ns), nodes("b", redis_url, ns)
    assert a.bridge().run("r1") == "compiled"
    wait_for("r1 on b", functools.partial(installed, b.dir, "r1"))
    assert b.bridge().run("r1") == "hit"
    stats = {"a": a.stop(), "b": b.stop()}  # each asserts exit status 0
    assert stats["a"]["published"] == 1 and stats["b"]["installed"] == 1
    assert stats["a"]["cycle_errors"] == stats["b"]["cycle_errors"] == 0
    refusals = [e for node in (a, b) for e in node.events("hpu_refuse")]
    assert refusals and all(e["reason"] == "corrupt" for e in refusals)


def test_an_unexpected_error_costs_one_cycle_not_the_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    store = recipecache.open_store("memory://", namespace="job")
    agent = HpuSyncAgent(tmp_path / "a", store, fingerprint=hpu_fingerprint(OLD, OLD), interval=0.01)
    stop = threading.Event()
    calls: list[str] = []
    real = agent.sync_once

    def flaky() -> None:
        calls.append("sync")
        if len(calls) == 1:
            raise KeyError("a bug we did not foresee")
        real()
        if len(calls) == 3:
            stop.set()

    monkeypatch.setattr(agent, "sync_once", flaky)
    assert write(agent.dir.path, "r1", 1000)
    agent.run(stop)
    assert len(calls) == 4, "the loop went on after the error, and made its last pass"
    assert agent.stats()["cycle_errors"] == 1 and agent.stats()["published"] == 1


def test_agent_exits_nonzero_when_its_sync_thread_dies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import signal as signal_module

    from recipecache.hpu import agent as agent_module

    def die(self: HpuSyncAgent, stop: object) -> None:
        raise RuntimeError("the sync thread dies")

    monkeypatch.setattr(agent_module.HpuSyncAgent, "run", die)
    handlers = {s: signal_module.getsignal(s) for s in (signal_module.SIGTERM, signal_module.SIGINT)}
    try:
        status = agent_module.main(["--dir", str(tmp_path / "a"), "--url", "memory://", "--once",
                                    "--bridge-version", OLD, "--driver-version", OLD])
    finally:
        for signum, handler in handlers.items():
            signal_module.signal(signum, handler)
    assert status == 1
