"""Load test: many processes as simulated nodes x ranks on 127.0.0.1, against one Redis and a Redis Cluster.

Usage:
  python benchmarks/load_bench.py [--nodes 8] [--ranks-per-node 8] [--artifacts 50] [--min-mb 1] [--max-mb 8]
                                  [--compile-s 0.5] [--backends single,cluster] [--phases cold,warm,flat,fault]
  python benchmarks/load_bench.py --quick                  # 4 nodes x 4 ranks, 12 artifacts of 0.25-1 MB
  python benchmarks/load_bench.py --validate [--artifacts 20] [--scales 1x2,2x4,4x4] [--repeat 3]

The benchmark starts its own servers on 127.0.0.1 (one ``redis-server``; a cluster of 3
primaries, each with a replica, joined by ``redis-cli --cluster create``), runs every
process as ``benchmarks/load_worker.py`` with its simulated node's own node directory,
and stops everything it started, also on error or after ``--timeout`` seconds. Phases:

* ``cold``: every rank meets every artifact (each rank in its own order); one rank
  compiles each (``--compile-s`` of sleep plus making the bytes), the others wait for it;
* ``warm``: fresh nodes (empty node directories) read everything, all in the same order:
  the herd at a job's start;
* ``flat``: ``warm`` without the node tier: every rank reads every artifact from Redis;
* ``fault``: ``cold`` in a new namespace while the store fails under it: a restart of the
  single Redis, or SIGKILL of a cluster primary (its replica takes over), a tenth of the
  way through, while compiles are under way.

Per backend and phase it prints: p50/p99 seconds from asking for an artifact to holding
it, seconds until every process has every artifact, remote bytes per artifact over its
size (the copies Redis sent: at most the number of nodes with the node tier), Redis
commands per second (every node's ``INFO commandstats``), compiles per artifact, lost and
corrupt entries (an entry some rank published, or for the warm phases any entry, that
cannot be read back whole afterwards, or an artifact a rank got with the wrong bytes: must
be 0), lookups the store failed to answer (down, slow: the rank goes on without it),
fallbacks counted by the ranks' stores, and processes that raised (must be 0).

``--validate`` checks the simulator (``recipecache.sim``) against this machine: it
measures the host's aggregate rates for fetching from Redis and for reading node copies
(one small calibration run each), then runs the warm phase at three scales and prints
the measured time until every process has every artifact next to the simulator's
prediction for the same scale (schedule ``startup``, warm store, node tier, colocated),
and the error; the target is within 20%.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

import recipecache
from harness.redis_cluster import RedisCluster
from harness.redis_server import RedisServer
from recipecache.reasons import FAILED
from recipecache.sim import Costs, simulate

HERE = Path(__file__).resolve().parent

WORKER = HERE / "load_worker.py"
MB = 1024 * 1024


@dataclass
class Servers:
    """The store under test: its URL, its nodes (for counters), and how to make it fail."""

    name: str
    url: str
    nodes: Callable[[], list[RedisServer]]
    fail: Callable[[], None]
    recover: Callable[[], None]


def counters(nodes: list[RedisServer]) -> tuple[int, int]:
    """Bytes sent to clients and commands run so far, summed over ``nodes`` (``INFO`` itself left out;
    a primary's stream to its replica is in ``total_net_output_bytes`` too, and is taken out)."""
    sent = calls = 0
    for node in nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=10)
        stats = client.info("stats")
        sent += int(stats["total_net_output_bytes"]) - int(stats.get("total_net_repl_output_bytes", 0))
        calls += sum(v["calls"] for k, v in client.info("commandstats").items() if k != "cmdstat_info")
        client.close()
    return sent, calls


@contextlib.contextmanager
def single_redis(work: Path) -> Iterator[Servers]:
    # RDB on shutdown, so a restart keeps what was stored (a restart is a fault, not a flush)
    server = RedisServer(work / "redis", config="save 3600 1\nmaxclients 10000")
    server.start()

    def restart() -> None:
        """A clean restart: SHUTDOWN SAVE, however long the snapshot takes, then start on the same port."""
        assert server.proc is not None
        with contextlib.suppress(redis.exceptions.ConnectionError):
            redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=600).shutdown(save=True)
        server.proc.wait(timeout=600)
        server.proc = None
        server.start()

    try:
        yield Servers("redis", server.url, lambda: [server], restart, lambda: None)
    finally:
        server.stop()


@contextlib.contextmanager
def redis_cluster(work: Path) -> Iterator[Servers]:
    # deploy/'s node timeout: a node busy serving 64 processes on a loaded host is not a dead one
    cluster = RedisCluster(work / "cluster", primaries=3, replicas=1, config="maxclients 10000", node_timeout_ms=5000)
    cluster.start()
    try:
        yield Servers("cluster", cluster.url, cluster.live, lambda: cluster.kill(cluster.primary_nodes()[0]),
                      cluster.wait_ok)
    finally:
        cluster.stop()


def make_artifacts(count: int, min_mb: float, max_mb: float, seed: int) -> list[list[Any]]:
    """``[key, size, seed, sha256]`` per artifact, sizes uniform in [min_mb, max_mb]."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        size = int(rng.uniform(min_mb, max_mb) * MB)
        data = np.random.default_rng(seed * 1000 + i).bytes(size)
        out.append([f"graph-{i}", size, seed * 1000 + i, hashlib.sha256(data).hexdigest()])
    return out


@dataclass
class Phase:
    name: str
    mode: str
    namespace: str
    node_tier: bool = True
    shuffle: bool = False
    fault: bool = False


def run_phase(servers: Servers, phase: Phase, artifacts: list[list[Any]], *, nodes: int, per_node: int,
              compile_s: float, work: Path, deadline: float, node_root: Path | None = None) -> dict[str, Any]:
    """Run one phase; ``node_root`` holds the nodes' directories (default: fresh ones for this run)."""
    run = work / f"{servers.name}-{phase.name}-{time.monotonic_ns()}"
    run.mkdir(parents=True)
    node_root = node_root or run / "nodes"
    start, progress = run / "start", run / "progress"
    procs = []
    try:
        for rank in range(nodes * per_node):
            spec = {"url": servers.url, "namespace": phase.namespace, "rank": rank, "artifacts": artifacts,
                    "node_dir": str(node_root / f"node{rank // per_node}") if phase.node_tier else None,
                    "mode": phase.mode, "shuffle": phase.shuffle, "compile_s": compile_s,
                    "ready": str(run / f"ready{rank}"), "start": str(start), "progress": str(progress),
                    "out": str(run / f"out{rank}.json")}
            (run / f"spec{rank}.json").write_text(json.dumps(spec))
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(run / f"spec{rank}.json")]))
        while sum((run / f"ready{r}").exists() for r in range(len(procs))) < len(procs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"{phase.name}: workers did not start")
            time.sleep(0.05)
        before = counters(servers.nodes())
        began = time.time()
        start.touch()
        total = len(procs) * len(artifacts)
        if phase.fault:
            while not progress.exists() or len(progress.read_bytes()) < 2 * total // 10:  # 2 bytes per key done
                if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
                    break
                time.sleep(0.01)
            servers.fail()
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if phase.fault:
        servers.recover()
    outs = [json.loads((run / f"out{r}.json").read_text()) for r in range(len(procs)) if codes[r] == 0]
    after = counters(servers.nodes())
    times = sorted(t for o in outs for t in o["times"])
    wall = max(o["ended"] for o in outs) - began if outs else float("nan")
    total_size = sum(a[1] for a in artifacts)
    published = {k for o in outs for k in o["published"]}
    return {
        "phase": phase.name,
        "raised": sum(1 for c in codes if c != 0),
        "p50_s": times[len(times) // 2] if times else float("nan"),
        "p99_s": times[min(len(times) - 1, int(0.99 * len(times)))] if times else float("nan"),
        "all_s": wall,
        # counters restart with a restarted server: only phases without a fault have these
        "copies": None if phase.fault else (after[0] - before[0]) / total_size,
        "cmd_s": None if phase.fault else (after[1] - before[1]) / wall,
        "compiles_per_artifact": sum(len(o["compiled"]) for o in outs) / len(artifacts),
        # warm phases read what the cold phase published: all of it must be there afterwards
        "lost": lost_entries(servers.url, phase.namespace, artifacts,
                             {a[0] for a in artifacts} if phase.mode == "warm" else published),
        "corrupt": sum(len(o["corrupt"]) for o in outs),
        # lookups the store did not answer (down, slow, full): the rank compiled or went on without
        "failed": sum(n for o in outs for reason, n in o["stats"]["misses_by_reason"].items() if reason in FAILED),
        "fallbacks": sum(o["stats"]["fallback"] for o in outs),
        "why": dict(sum((Counter({f"{k} {r}": n for k in ("misses", "fallback")
                                  for r, n in o["stats"][f"{k}_by_reason"].items() if r != "not_found"})
                         for o in outs), Counter())),
        "node_hits": sum(o["stats"]["node_hits"] for o in outs),
    }


def lost_entries(url: str, namespace: str, artifacts: list[list[Any]], published: set[str]) -> int:
    """Entries some rank published that cannot be read back whole now."""
    store = recipecache.open_store(url, namespace=namespace)
    digests = {a[0]: a[3] for a in artifacts}
    lost = 0
    for key in published:
        data = store.get(key)
        lost += data is None or hashlib.sha256(data).hexdigest() != digests[key]
    store.close()
    return lost


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_rows(rows: list[dict[str, Any]], servers: str, nodes: int, per_node: int) -> None:
    print(f"\n{servers}: {nodes} nodes x {per_node} ranks")
    print(f"{'phase':<7}{'p50 s':>8}{'p99 s':>8}{'all s':>8}{'copies':>8}{'cmd/s':>9}{'compiles':>9}"
          f"{'lost':>6}{'corrupt':>8}{'failed':>7}{'fallbacks':>10}{'raised':>7}")
    for r in rows:
        print(f"{r['phase']:<7}{r['p50_s']:>8.2f}{r['p99_s']:>8.2f}{r['all_s']:>8.1f}{fmt(r['copies'], '.2f'):>8}"
              f"{fmt(r['cmd_s'], '.0f'):>9}{r['compiles_per_artifact']:>9.2f}{r['lost']:>6}{r['corrupt']:>8}"
              f"{r['failed']:>7}{r['fallbacks']:>10}{r['raised']:>7}", flush=True)
    for r in rows:
        if r["why"]:
            print(f"  {r['phase']}: {', '.join(f'{n} {what}' for what, n in sorted(r['why'].items()))}")


def load(args: argparse.Namespace, work: Path, deadline: float) -> int:
    artifacts = make_artifacts(args.artifacts, args.min_mb, args.max_mb, seed=1)
    print(f"{args.artifacts} artifacts, {sum(a[1] for a in artifacts) / MB:.0f} MiB in all "
          f"({args.min_mb:g}-{args.max_mb:g} MiB); copies = bytes Redis sent / artifact bytes")
    bad = 0
    for backend in args.backends:
        with (single_redis if backend == "single" else redis_cluster)(work / backend) as servers:
            rows = []
            for name in args.phases:
                phase = {"cold": Phase("cold", "cold", "load", shuffle=True),
                         "warm": Phase("warm", "warm", "load"),
                         "flat": Phase("flat", "warm", "load", node_tier=False),
                         "fault": Phase("fault", "cold", "fault", shuffle=True, fault=True)}[name]
                rows.append(run_phase(servers, phase, artifacts, nodes=args.nodes, per_node=args.ranks_per_node,
                                      compile_s=args.compile_s, work=work, deadline=deadline))
            print_rows(rows, f"{servers.name} ({servers.url.split('?')[0][:60]})", args.nodes, args.ranks_per_node)
            bad += sum(r["lost"] + r["corrupt"] + r["raised"] for r in rows)
    print(f"\nlost + corrupt + raised: {bad} (must be 0)")
    return 1 if bad else 0


def validate(args: argparse.Namespace, work: Path, deadline: float) -> int:
    """The simulator's prediction of the warm phase against the measured one, at three scales.

    This host is shared and its load moves, so each measurement is taken right after a
    calibration of its own (the host's aggregate rates for fetching from Redis and for
    reading node copies, ``k`` processes at once), ``--repeat`` times; medians are printed.
    """
    artifacts = make_artifacts(args.artifacts, args.min_mb, args.max_mb, seed=2)
    total_mb = sum(a[1] for a in artifacts) / MB
    common = {"compile_s": 0.0, "work": work, "deadline": deadline}
    k = 4
    errors = []
    print(f"{len(artifacts)} artifacts, {total_mb:.0f} MiB; every scale measured {args.repeat} times, each right "
          f"after a calibration ({k} processes fetching from Redis, then {k} reading one node's copies)")
    print(f"\n{'scale':<8}{'ranks':>6}{'fetch MB/s':>11}{'copy MB/s':>10}{'measured s':>12}{'predicted s':>13}"
          f"{'error':>8}")
    with single_redis(work / "validate") as servers:
        run_phase(servers, Phase("seed", "cold", "v"), artifacts, nodes=1, per_node=1, **common)
        run_phase(servers, Phase("cal-fill", "warm", "v"), artifacts, nodes=1, per_node=1, node_root=work / "cal",
                  **common)
        for nodes, per_node in args.scales:
            rows = []
            for _ in range(args.repeat):
                remote = run_phase(servers, Phase("cal-remote", "warm", "v", node_tier=False), artifacts, nodes=k,
                                   per_node=1, **common)
                local = run_phase(servers, Phase("cal-local", "warm", "v"), artifacts, nodes=1, per_node=k,
                                  node_root=work / "cal", **common)
                remote_mb_s, local_mb_s = k * total_mb / remote["all_s"], k * total_mb / local["all_s"]
                measured = run_phase(servers, Phase("warm", "warm", "v"), artifacts, nodes=nodes, per_node=per_node,
                                     **common)["all_s"]
                costs = Costs(compute_s=0.0, fetch_latency_s=0.0, artifact_mb=total_mb / len(artifacts),
                              bandwidth_mb_s=remote_mb_s, store_mb_s=remote_mb_s, local_mb_s=local_mb_s)
                predicted = simulate("singleflight", schedule="startup", ranks=nodes * per_node,
                                     shapes=len(artifacts), warm=True, node_tier=True, ranks_per_node=per_node,
                                     colocated=True, costs=costs).stall_s
                rows.append((remote_mb_s, local_mb_s, measured, predicted))
            remote_mb_s, local_mb_s, measured, predicted = (statistics.median(r[i] for r in rows) for i in range(4))
            errors.append(abs(predicted - measured) / measured)
            print(f"{f'{nodes}x{per_node}':<8}{nodes * per_node:>6}{remote_mb_s:>11.0f}{local_mb_s:>10.0f}"
                  f"{measured:>12.2f}{predicted:>13.2f}{errors[-1]:>8.0%}", flush=True)
    print(f"\nlargest error {max(errors):.0%} (target within 20%)")
    return 0


def scales(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split("x")) for part in text.split(",")]  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--artifacts", type=int, default=50)
    parser.add_argument("--min-mb", type=float, default=1.0)
    parser.add_argument("--max-mb", type=float, default=8.0)
    parser.add_argument("--compile-s", type=float, default=0.5, help="seconds one compile takes")
    parser.add_argument("--backends", type=lambda t: t.split(","), default=["single", "cluster"])
    parser.add_argument("--phases", type=lambda t: t.split(","), default=["cold", "warm", "flat", "fault"])
    parser.add_argument("--validate", action="store_true", help="the simulator against the warm phase at --scales")
    parser.add_argument("--scales", type=scales, default=[(1, 2), (2, 4), (4, 4)],
                        help="NODESxRANKS,... for --validate (default 1x2,2x4,4x4)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per scale for --validate (medians)")
    parser.add_argument("--quick", action="store_true", help="4 nodes x 4 ranks, 12 artifacts of 0.25-1 MB")
    parser.add_argument("--timeout", type=float, default=1800.0, help="stop everything after this many seconds")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.ranks_per_node, args.artifacts, args.min_mb, args.max_mb = 4, 4, 12, 0.25, 1.0
        args.compile_s = 0.1
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory(prefix="load-bench-") as tmp:
        return (validate if args.validate else load)(args, Path(tmp), deadline)


if __name__ == "__main__":
    sys.exit(main())
