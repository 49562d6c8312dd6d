"""A real Redis Cluster for tests and benchmarks: N primaries (and optional replicas) on 127.0.0.1;
and a primary with a sentinel.

Each node is a :class:`~redis_server.RedisServer` with ``cluster-enabled yes``; ``redis-cli
--cluster create`` joins them (Debian's redis-server package ships redis-cli). Nodes are
started and killed one by one (``kill``: SIGKILL, as a crashed machine), and ``stop`` ends
them all. Everything is bounded in time: a cluster that does not form in 30 s is an error.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from harness.ports import free_port, port_below
from harness.redis_server import RedisServer

#: short node timeout: a killed primary's replica takes over within a few seconds
NODE_TIMEOUT_MS = 1000


class RedisCluster:
    def __init__(self, workdir: Path, *, primaries: int = 3, replicas: int = 0, config: str = "",
                 node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli not found: Debian's redis-server package installs it")
        self.cli = cli
        self.primaries, self.replicas = primaries, replicas
        self.config = config
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [RedisServer(Path(workdir) / f"node{i}", config=self._config(Path(workdir) / f"node{i}"),
                                  port=port_below(55535)) for i in range(primaries * (1 + replicas))]

    def _config(self, workdir: Path) -> str:
        # the cluster bus port is given, not port + 10000, which may be taken
        return (f"cluster-enabled yes\ncluster-port {free_port()}\ncluster-config-file {workdir / 'nodes.conf'}\n"
                f"cluster-node-timeout {self.node_timeout_ms}\ncluster-require-full-coverage no\n"
                f"cluster-allow-reads-when-down no\nrepl-diskless-sync-delay 0\n{self.config}\n")

    @property
    def seeds(self) -> str:
        """Every node as ``host:port,...``, for a ``redis+cluster://`` URL."""
        return ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.seeds}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        create = [self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                  "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        proc = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        try:
            self.wait_ok()
            self._wait_replicas_synced()
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and maps all 16384 slots to live primaries
        (after a kill: until a replica has taken over the dead primary's slots)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(self._healthy(node) for node in self.live()):
                    return
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def _wait_replicas_synced(self, timeout: float = 60.0) -> None:
        """Until every replica has its primary's data: one that never synced will not take over."""
        deadline = time.monotonic() + timeout
        while any(self.client(node).info("replication").get("master_link_status", "up") != "up"
                  for node in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not sync with their primaries")
            time.sleep(0.1)

    def _healthy(self, node: RedisServer) -> bool:
        client = self.client(node)
        if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            return False
        live = {n.port for n in self.live()}
        ranges = client.execute_command("CLUSTER", "SLOTS")
        covered = sum(int(r[1]) - int(r[0]) + 1 for r in ranges)
        return covered == 16384 and all(int(r[2][1]) in live for r in ranges)

    def client(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5)

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.proc is not None and node.proc.poll() is None]

    def primary_nodes(self) -> list[RedisServer]:
        return [node for node in self.live() if self.client(node).info("replication")["role"] == "master"]

    def primary_of(self, slot: int) -> RedisServer:
        """The live primary serving hash slot ``slot``."""
        client = self.client(self.live()[0])
        port = next(int(r[2][1]) for r in client.execute_command("CLUSTER", "SLOTS") if int(r[0]) <= slot <= int(r[1]))
        return next(node for node in self.live() if node.port == port)

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        return [node for node in self.live() if node is not primary
                and self.client(node).info("replication").get("master_port") == primary.port]

    def quiesce(self, primary: RedisServer, timeout: float = 60.0) -> None:
        """Stop ``primary`` taking writes (``CLIENT PAUSE ... WRITE``; its clients' writes wait), then wait until each
        of its replicas has applied everything it acknowledged.

        Redis replicates asynchronously: a primary killed at a random moment loses the writes it
        acknowledged but had not yet streamed, on a busy machine more of them. Killed after this,
        it loses none: a writer whose write was waiting gets an error, never an acknowledgement.
        """
        client = self.client(primary)
        client.execute_command("CLIENT", "PAUSE", int(timeout * 1000), "WRITE")
        offset = int(client.info("replication")["master_repl_offset"])
        replicas = self.replicas_of(primary)
        assert replicas, "the primary has a replica"
        deadline = time.monotonic() + timeout
        while any(int(self.client(node).info("replication")["slave_repl_offset"]) < offset for node in replicas):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not catch up with their paused primary")
            time.sleep(0.01)

    def kill(self, node: RedisServer) -> None:
        """SIGKILL one node, as a crashed machine: no shutdown, no save."""
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait()
        node.proc = None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisSentinel:
    """One primary watched by one sentinel (``redis-server --sentinel``), on 127.0.0.1."""

    SERVICE = "recipecache"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.primary = RedisServer(self.workdir / "primary")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.SERVICE}"

    def start(self) -> None:
        self.primary.start()
        conf = self.workdir / "sentinel.conf"
        conf.write_text(f"bind 127.0.0.1\nport {self.port}\ndir {self.workdir}\nlogfile {self.workdir / 'sentinel.log'}\n"
                        f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary.port} 1\n")
        binary = shutil.which("redis-server")
        assert binary is not None
        self.proc = subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120  # a hang guard: it waits for the answer
        while time.monotonic() < deadline:
            try:
                answer = redis.Redis(port=self.port, socket_timeout=1).execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
                if answer:
                    return
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the sentinel did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        self.primary.stop()

    def __enter__(self) -> RedisSentinel:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
