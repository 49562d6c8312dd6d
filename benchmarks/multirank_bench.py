"""Compile stalls of one torchrun job under three ways of sharing compiled artifacts.

The job is ``examples/train.py`` (DDP over gloo, rank r one bucket ahead of rank 0),
every rank in its own empty local dirs (``recipecache-run --rank-dirs``), as if each
ran on its own node:

(a) private: torch's local caches only, nothing shared;
(b) torch-redis: PyTorch's built-in remote FX-graph and AOTAutograd caches on Redis;
(c) recipecache on the same Redis.

All three run through ``recipecache-run`` (``--no-enable`` for a and b), so the thread
count and the precompiled-header flag (torch's default, on) are the same and only the sharing differs.
Printed per scenario: the job's wall time, its stall (per rank, the step seconds above
that rank's fastest step, summed over ranks: what compiles and the waits for them cost),
the graphs compiled (inductor's ``fxgraph_cache_miss``), and the ratios (c)/(a), (c)/(b);
for (c) also recipecache's own report. Read (b)'s count with its wall time: its remote
hits carry kernel source, not the built ``.so``, so a "hit" on a fresh node still runs
g++ (see the torch notes) and is not counted as a compile.

Then the fresh-node target: a fresh process with empty local dirs whose first step
loads another process's artifact from the store, against the same first step in a fresh
process whose local inductor dir is warm (no store); recipecache aims at <= 1.3x. The
pairs run interleaved so both sides see the same machine load; medians are printed.

    python benchmarks/multirank_bench.py [--repeat 3] [--buckets 16,32] [--steps 4]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = ROOT / "examples" / "train.py"


@dataclass
class Result:
    name: str
    wall_s: float
    step_s: list[list[float]]  # [step][rank]
    compiled: int
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def stall_s(self) -> float:
        per_rank = list(zip(*self.step_s))
        return sum(sum(t - min(times) for t in times) for times in per_rank)

    @property
    def first_step_s(self) -> list[float]:
        return self.step_s[0]


def run_job(work: Path, name: str, job_args: list[str], *, nproc: int, rank_dirs: Path, cache: str | None,
            extra_env: dict[str, str] | None = None) -> Result:
    run_dir = work / name
    losses = run_dir / "losses.json"
    cmd = [sys.executable, "-m", "launcher.main", "--nproc", str(nproc), "--run-dir", str(run_dir),
           "--rank-dirs", str(rank_dirs)]
    cmd += ["--url", cache, "--namespace", "bench"] if cache else ["--no-enable"]
    cmd += [str(EXAMPLE), *job_args, "--losses", str(losses)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    env.update(extra_env or {})
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name}: job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads(losses.read_text())
    compiled = sum(c.get("fxgraph_cache_miss", 0) for c in data["inductor_counters"])
    report = json.loads((run_dir / "report.json").read_text()) if cache else {}
    result = Result(name, wall, data["step_s"], compiled, report)
    print(f"  {name:<22} wall {wall:7.1f} s  stall {result.stall_s:7.1f} s  graphs compiled {compiled:3d}  "
          f"first step {' '.join(f'{t:.2f}' for t in result.first_step_s)} s", flush=True)
    return result


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--buckets", default="16,32", help="sequence lengths of the job (default 16,32)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3, help="fresh-node / warm-local pairs (default 3)")
    p.add_argument("--workdir", type=Path, help="keep everything here (default: a temp dir, removed)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = p.parse_args()
    job_args = ["--buckets", args.buckets, "--steps", str(args.steps)]

    with tempfile.TemporaryDirectory(prefix="rcbench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        with RedisServer(work / "redis") as redis:
            torch_redis = {"TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
                           "TORCHINDUCTOR_REDIS_HOST": "127.0.0.1", "TORCHINDUCTOR_REDIS_PORT": str(redis.port)}
            print(f"job: {args.nproc} ranks, buckets {args.buckets}, {args.steps} steps; cold runs, empty stores")
            a = run_job(work, "a-private", job_args, nproc=args.nproc, rank_dirs=work / "a-dirs", cache=None)
            b = run_job(work, "b-torch-redis", job_args, nproc=args.nproc, rank_dirs=work / "b-dirs", cache=None,
                        extra_env=torch_redis)
            c = run_job(work, "c-recipecache", job_args, nproc=args.nproc, rank_dirs=work / "c-dirs",
                        cache=redis.url)

            print(f"fresh node vs warm local cache, first step, {args.repeat} interleaved pairs")
            fresh: list[float] = []
            warm: list[float] = []
            for i in range(args.repeat):
                warm += run_job(work, f"warm-local-{i}", job_args, nproc=args.nproc, rank_dirs=work / "a-dirs",
                                cache=None).first_step_s
                fresh += run_job(work, f"fresh-store-hit-{i}", job_args, nproc=args.nproc,
                                 rank_dirs=work / f"fresh-dirs-{i}", cache=redis.url).first_step_s

    total = c.report.get("total", {})
    print()
    print(f"{'scenario':<16} {'wall_s':>8} {'stall_s':>8} {'compiled':>9}")
    for r in (a, b, c):
        print(f"{r.name:<16} {r.wall_s:>8.1f} {r.stall_s:>8.1f} {r.compiled:>9}")
    print(f"(c)/(a): wall {ratio(c.wall_s, a.wall_s)}  stall {ratio(c.stall_s, a.stall_s)}  "
          f"compiled {ratio(c.compiled, a.compiled)}")
    print(f"(c)/(b): wall {ratio(c.wall_s, b.wall_s)}  stall {ratio(c.stall_s, b.stall_s)}  "
          f"compiled {ratio(c.compiled, b.compiled)}")
    print(f"recipecache report (c): compiles {total.get('compiles')}  hits {total.get('hits')}  "
          f"waits {total.get('waits')}  stall_s {total.get('stall_s', 0):.1f}  saved_s {total.get('saved_s', 0):.1f}")
    fresh_med, warm_med = statistics.median(fresh), statistics.median(warm)
    print(f"first step: fresh node + store hit median {fresh_med:.2f} s, warm local cache median {warm_med:.2f} s, "
          f"ratio {ratio(fresh_med, warm_med)} (target <= 1.3)")
    if args.json:
        args.json.write_text(json.dumps({
            "scenarios": {r.name: {"wall_s": r.wall_s, "stall_s": r.stall_s, "compiled": r.compiled,
                                   "step_s": r.step_s} for r in (a, b, c)},
            "recipecache_report_total": total,
            "first_step": {"fresh_store_hit": fresh, "warm_local": warm, "ratio": fresh_med / warm_med},
        }, indent=2))


if __name__ == "__main__":
    main()
