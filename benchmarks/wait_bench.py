"""Redis commands per second per waiting rank: woken by the holder's release vs polling, in one run.

Usage: python benchmarks/wait_bench.py [--waiters 64] [--window 20] [--rounds 2] [--quick]

One process (this one) takes a key's lease, as a rank compiling it would, and holds it
(renewing it) while ``--waiters`` processes call ``store.get_or_compile`` on that key
and wait. After a settling second the benchmark counts every command the redis-server
it started runs (``INFO commandstats``, the ``INFO`` calls themselves left out) over
``--window`` seconds, then publishes the artifact and releases the lease, and each
waiter reports when it got the artifact. Two ways of waiting, interleaved round by round:

* ``wake``: recipecache as it is: each waiter blocks in ``BLMOVE`` on the holder's wake
  list and looks again only when the release wakes it (or the holder's lease would
  expire, or a progress line is due every 15 s);
* ``poll``: the same loop with the wake-up disabled (``lease_wait`` answers "cannot"),
  which is how every waiter waited before: look, read the lease, sleep 20 ms doubling to
  0.5 s, look again.

Prints per mode the median over rounds of commands/s per waiter during the wait and
the p50/p99 seconds from the release to each waiter holding the artifact, and the
ratio poll/wake. No waiter may compile (each key is compiled exactly once, by the holder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

import recipecache
from harness.redis_server import RedisServer
from recipecache.keys import storage_key
from recipecache.lease import HeldLease, new_token

WAITER = r"""
import json, os, sys, time
import recipecache
from recipecache.backends.redis import RedisBackend
url, namespace, mode, ready, out = sys.argv[1:6]
if mode == "poll":
    RedisBackend.lease_wait = lambda self, name, token, timeout: None
store = recipecache.open_store(url, namespace=namespace)
open(ready, "w").close()
def compile_fn():
    raise SystemExit("a waiter compiled: single-flight is broken")
data = store.get_or_compile("artifact", compile_fn)
json.dump({"done": time.time(), "bytes": len(data), "stats": store.stats()}, open(out, "w"))
"""


def commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for name, v in stats.items() if name != "cmdstat_info")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_round(server: RedisServer, work: Path, mode: str, waiters: int, window: float) -> dict[str, float]:
    namespace = f"wait-{mode}-{os.getpid()}-{time.monotonic_ns()}"
    store = recipecache.open_store(server.url, namespace=namespace)
    name = storage_key(namespace, "artifact")
    token = new_token()
    assert store.backend.lease_add(name, token, 30)
    lease = HeldLease(store.backend, name, token, 30)  # renewed every 10 s, as a compiling rank's is
    run = work / namespace
    run.mkdir()
    env = {**os.environ, "RECIPECACHE_WAIT_TIMEOUT": "600"}
    procs = [subprocess.Popen([sys.executable, "-c", WAITER, server.url, namespace, mode, str(run / f"ready{i}"),
                               str(run / f"out{i}.json")], env=env) for i in range(waiters)]
    try:
        deadline = time.monotonic() + 300
        while sum(1 for i in range(waiters) if (run / f"ready{i}").exists()) < waiters:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("waiters did not start")
            time.sleep(0.1)
        time.sleep(1.0)  # every waiter is in get_or_compile by now
        client = redis.Redis.from_url(server.url)
        before = commands(client)
        time.sleep(window)
        during = commands(client) - before
        release = time.time()
        store.put("artifact", b"x" * 1000)
        lease.release()
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"{sum(1 for c in codes if c)} waiters failed")
    outs = [json.loads((run / f"out{i}.json").read_text()) for i in range(waiters)]
    assert all(o["stats"]["compiles"] == 0 and o["stats"]["follower"] == 1 for o in outs)
    latency = [o["done"] - release for o in outs]
    store.close()
    return {"cmd_s_per_waiter": during / window / waiters, "wake_p50_s": percentile(latency, 0.5),
            "wake_p99_s": percentile(latency, 0.99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiters", type=int, default=64)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of waiting that are counted")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="16 waiters, a 5 s window, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.waiters, args.window, args.rounds = 16, 5.0, 1
    results: dict[str, list[dict[str, float]]] = {"poll": [], "wake": []}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", config="maxclients 10000") as server:
        for r in range(args.rounds):
            for mode in ("poll", "wake") if r % 2 == 0 else ("wake", "poll"):
                results[mode].append(one_round(server, Path(tmp), mode, args.waiters, args.window))
                print(f"round {r + 1} {mode}: {results[mode][-1]}", flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in results.items()}
    print(f"\n{args.waiters} waiters, {args.window:.0f} s counted, {args.rounds} rounds (medians)")
    print(f"{'mode':<6} {'cmd/s/waiter':>13} {'wake p50 s':>11} {'wake p99 s':>11}")
    for mode, m in med.items():
        print(f"{mode:<6} {m['cmd_s_per_waiter']:>13.3f} {m['wake_p50_s']:>11.3f} {m['wake_p99_s']:>11.3f}")
    poll, wake = med["poll"]["cmd_s_per_waiter"], med["wake"]["cmd_s_per_waiter"]
    print(f"commands/s per waiter, poll/wake: {poll / wake:.1f}x" if wake else
          "commands/s per waiter: no command while woken waiters waited (use a longer --window)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
