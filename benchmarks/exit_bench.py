"""How often a DDP + torch.compile + gloo job fails to exit, under three ways of starting its script.

Issue 15, item 19: under ``recipecache-run`` a rank once hung for good in
``~ProcessGroupGloo`` after the script's last step (2 runs of 11), while plain torchrun
exited cleanly 10 of 10. The cause was the bootstrap's ``runpy.run_path``, which destroys
the script's globals (the DDP model, its reducer, the process group) before the atexit
handlers, while other threads can still take the GIL. Each round runs, interleaved so all
see the same machine load:

(a) torchrun python script.py: the reference;
(b) torchrun + a ``runpy.run_path`` shim: what the bootstrap did before the fix;
(c) recipecache-run: the bootstrap runs the script as the real ``__main__``.

A run counts as *hung* when a rank did not exit by itself: it ran past ``--timeout`` (then
it is killed), or, for (c), the launcher ended it after ``--exit-grace`` (its report lists
it). The script's atexit handler also records whether its globals were still alive when
the atexit handlers ran, and whether it was still ``__main__`` (``python script.py``: both).

    python benchmarks/exit_bench.py [--runs 20] [--script tests/workers/ddp_exit.py] [--timeout 120]

The script gets one argument, a path prefix for its ``<prefix><rank>.json`` record (see
``tests/workers/exit_probe.py``); scripts that take none simply leave no record. All runs
share one warm compile cache (the first compiles cold).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from harness.paths import WORKERS
from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

RANKS = 2
#: What the bootstrap did before the fix.
RUNPY_SHIM = ("import os, runpy, sys\nsys.argv = sys.argv[1:]\nsys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def command(way: str, script: Path, out: Path, shim: Path, grace: float) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
                "--master-port", str(free_port())]
    if way == "python":
        return [*torchrun, str(script), str(out / "seen")]
    if way == "runpy":
        return [*torchrun, str(shim), str(script), str(out / "seen")]
    return [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--master-port", str(free_port()),
            "--exit-grace", str(grace), "--run-dir", str(out), str(script), str(out / "seen")]


def run_once(way: str, script: Path, out: Path, shim: Path, env: dict[str, str], timeout: float,
             grace: float) -> tuple[str, float, list[dict[str, bool]]]:
    """One job: its outcome (exit code, ``timeout`` or ``ended``), wall seconds, the ranks' atexit records."""
    out.mkdir(parents=True)
    start = time.perf_counter()
    proc = subprocess.Popen(command(way, script, out, shim, grace), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        outcome = f"exit {proc.wait(timeout=timeout)}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks share the session
        proc.wait()
        outcome = "timeout"
    wall = time.perf_counter() - start
    report = out / "report.json"
    if report.exists() and json.loads(report.read_text())["hung_ranks"]:
        outcome = "ended"
    records = [json.loads(p.read_text()) for p in sorted(out.glob("seen*.json"))]
    return outcome, wall, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="jobs per way (default 20)")
    parser.add_argument("--script", type=Path, default=WORKERS / "ddp_exit.py")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a job counts as hung (120)")
    parser.add_argument("--exit-grace", type=float, default=60.0, help="recipecache-run --exit-grace (60)")
    args = parser.parse_args()
    ways = ("python", "runpy", "recipecache-run")
    with tempfile.TemporaryDirectory(prefix="exit-bench-") as tmp:
        work = Path(tmp)
        shim = work / "runpy_shim.py"
        shim.write_text(RUNPY_SHIM)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
        env.update(TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"), RECIPECACHE_DIR=str(work / "store"),
                   OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
        outcomes: dict[str, Counter[str]] = {way: Counter() for way in ways}
        walls: dict[str, list[float]] = {way: [] for way in ways}
        alive: dict[str, Counter[str]] = {way: Counter() for way in ways}
        for i in range(args.runs):
            for way in ways:
                outcome, wall, records = run_once(way, args.script.resolve(), work / f"{way}-{i}", shim, env,
                                                  args.timeout, args.exit_grace)
                outcomes[way][outcome] += 1
                walls[way].append(wall)
                for record in records:
                    alive[way]["records"] += 1
                    alive[way]["main_is_script"] += record.get("main_is_script", False)
                    alive[way]["model_alive"] += record.get("model_alive", False)
                print(f"run {i + 1}/{args.runs} {way:>15}: {outcome:>8} {wall:6.1f} s", flush=True)
    print(f"\n{args.script} x {args.runs} per way, {RANKS} ranks, gloo")
    print(f"{'way':>15} {'hung':>9} {'outcomes':<32} {'median wall':>11}  atexit sees: main / model alive")
    for way in ways:
        hung = outcomes[way]["timeout"] + outcomes[way]["ended"]
        seen = alive[way]
        print(f"{way:>15} {hung:>4}/{args.runs:<4} {', '.join(f'{k}: {v}' for k, v in sorted(outcomes[way].items())):<32} "
              f"{statistics.median(walls[way]):>9.1f} s  {seen['main_is_script']}/{seen['records']} / "
              f"{seen['model_alive']}/{seen['records']}")


if __name__ == "__main__":
    main()
