"""Ray Train with ``RECIPECACHE_ENABLE=1`` as the only change, side by side with plain Ray Train, in one run.

usage: python benchmarks/ray_train_bench.py [--work DIR]

Needs Ray Train (``pip install 'ray[train]'``; not in the test extras: its install is 500 MB). The job is
``ray_train_worker.py``: ``TorchTrainer``, 2 CPU workers on gloo, a compiled MLP under DDP, 3 batch sizes. Four
jobs, each a new local Ray cluster:

* ``plain cold`` then ``plain warm``: without recipecache, the warm job in the cold job's torch caches (torch's
  own local cache, the best a user has without recipecache);
* ``recipecache cold`` on an empty store, then ``recipecache fresh`` on that store: each job on new empty
  torch caches and node directory, as on new nodes.

Each row: exit status, torch's FX cache misses summed over ranks (a rank that then waited for another's compile
counts one too), the compiles and hits the job report counts (``recipecache report RUN_DIR``), the ranks it lists, whether each rank's training thread saw the store, iteration 0
(slowest rank) and wall over plain warm's, and whether the losses are bitwise equal to plain cold's. The target
(issue 46): the fresh job compiles 0 and its report lists both ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.hook_env import hook_environ, make_hook_env
from harness.paths import REPO

WORKER = Path(__file__).resolve().parent / "ray_train_worker.py"
RANKS = 2
JOB_TIMEOUT_S = 900


@dataclass
class Job:
    name: str
    exit_code: int
    wall_s: float
    #: what each rank's training function wrote, by rank
    ranks: list[dict[str, Any]]
    #: ``recipecache report RUN_DIR --json`` (None without recipecache)
    report: dict[str, Any] | None


def run_job(python: Path, work: Path, name: str, *, store: str | None, inductor: Path) -> Job:
    out, runs = work / f"{name}-out", work / f"{name}-runs"
    extra = {"TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    if store is not None:
        extra.update(
            RECIPECACHE_ENABLE="1",
            RECIPECACHE_URL=store,
            RECIPECACHE_RUNS_DIR=str(runs),
            RECIPECACHE_NODE_DIR=str(work / f"{name}-node"),
        )
    environ = hook_environ(**extra)
    begin = time.perf_counter()
    proc = subprocess.run(
        [str(python), str(WORKER), str(out)],
        env=environ,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    wall = time.perf_counter() - begin
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    report = None
    run_dirs = sorted(runs.iterdir()) if runs.is_dir() else []
    if run_dirs:
        shown = subprocess.run(
            [sys.executable, "-m", "recipecache.tools.cli", "report", str(run_dirs[-1]), "--json"],
            env=hook_environ(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        report = json.loads(shown.stdout) if shown.returncode == 0 else None
    return Job(name, proc.returncode, wall, ranks, report)


def fx_misses(job: Job) -> int:
    return sum(rank["fx_misses"] for rank in job.ranks)


def row(job: Job, plain_cold: Job, plain_warm: Job) -> str:
    first = max((rank["seconds"][0] for rank in job.ranks), default=None)
    warm_first = max(rank["seconds"][0] for rank in plain_warm.ranks)
    equal = [rank["losses"] for rank in job.ranks] == [rank["losses"] for rank in plain_cold.ranks]
    compiles, hits, listed = (
        ("-", "-", "-")
        if job.report is None
        else (str(job.report["total"]["compiles"]), str(job.report["total"]["hits"]), str(len(job.report["ranks"])))
    )
    return (
        f"{job.name:>17} {job.exit_code:>4} {fx_misses(job):>9} {compiles:>8} {hits:>5} {listed:>6}"
        f" {''.join('y' if rank['store_on'] else 'n' for rank in job.ranks):>8}"
        f" {first if first is not None else float('nan'):>7.2f}s {first / warm_first if first else float('nan'):>6.2f}x"
        f" {job.wall_s:>6.1f}s {job.wall_s / plain_warm.wall_s:>6.2f}x {'=' if equal else 'differ':>7}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="keep the jobs' files here (default: a temporary directory)")
    args = parser.parse_args()
    try:
        import ray.train  # noqa: F401 - only to say what is missing before four jobs fail
    except ImportError as exc:
        sys.exit(f"ray_train_bench: Ray Train is not installed ({exc}); pip install 'ray[train]'")
    with tempfile.TemporaryDirectory(prefix="ray-train-bench-") as tmp:
        work = (args.work or Path(tmp)).absolute()
        work.mkdir(parents=True, exist_ok=True)
        python = make_hook_env(work / "hook-env")
        store = f"file://{work / 'store'}"
        plain_cold = run_job(python, work, "plain cold", store=None, inductor=work / "plain-inductor")
        plain_warm = run_job(python, work, "plain warm", store=None, inductor=work / "plain-inductor")
        cold = run_job(python, work, "recipecache cold", store=store, inductor=work / "cold-inductor")
        fresh = run_job(python, work, "recipecache fresh", store=store, inductor=work / "fresh-inductor")
        print(
            f"Ray Train, {RANKS} workers (gloo, CPU), torch from {REPO.name}'s environment, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        print(
            f"{'job':>17} {'exit':>4} {'fx misses':>9} {'compiles':>8} {'hits':>5} {'ranks':>6} {'store on':>8} {'iter 0':>8}"
            f" {'/warm':>7} {'wall':>7} {'/warm':>7} {'losses':>7}"
        )
        for job in (plain_cold, plain_warm, cold, fresh):
            print(row(job, plain_cold, plain_warm))
        met = (
            fresh.exit_code == 0
            and fx_misses(fresh) == 0
            and fresh.report is not None
            and fresh.report["total"]["compiles"] == 0
            and len(fresh.report["ranks"]) == RANKS
        )
        print(f"target (the fresh job compiles 0, its report lists every rank): {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
