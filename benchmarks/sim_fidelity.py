"""Run a real 2-rank job, replay its event logs with the simulator, compare a measured figure.

    python benchmarks/sim_fidelity.py                 # run examples/train.py, then compare
    python benchmarks/sim_fidelity.py --no-run --run-dir DIR   # compare an existing run
    python benchmarks/sim_fidelity.py --policy no_stall # the job with --no-stall, no compile pool, replayed under no_stall
    python benchmarks/sim_fidelity.py --policy pool     # the job with --no-stall and its compile pool, under pool
    python benchmarks/sim_fidelity.py --policy pool --script-args "--steps 16"  # more steps: finer eager counts

The job is ``recipecache-run --nproc N --cache file://<run-dir>/cache --run-dir <run-dir> SCRIPT``
(``--policy no_stall`` adds ``--no-stall``), so its event logs land in ``<run-dir>/events``.
Under single-flight the figure is the stall, the measured ``total.stall_s`` of the launcher's
report (``--report``, default ``<run-dir>/report.json``); under behind it is the eager steps
counted in the event logs ((rank, step) pairs that ran a graph without inductor before its
background compile landed). Target: the prediction within 20% of the measurement. Exit
status 1 when it is not, 2 when the run fails.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from recipecache.errors import ConfigError
from recipecache.sim.fidelity import FIDELITY_POLICIES, replay

REPO = Path(__file__).resolve().parent.parent


def run_job(run_dir: Path, nproc: int, script: Path, extra: list[str], script_args: list[str],
            env: dict[str, str] | None = None) -> None:
    launcher = shutil.which("recipecache-run")
    if launcher is None:
        sys.exit("recipecache-run is not on PATH (pip install -e . once the launcher exists)")
    cmd = [launcher, "--nproc", str(nproc), "--url", f"file://{run_dir / 'cache'}", "--run-dir", str(run_dir),
           *extra, str(script), *script_args]
    print("$", shlex.join(cmd), flush=True)
    if subprocess.run(cmd, cwd=run_dir, check=False, env=env).returncode != 0:
        print("the job failed", file=sys.stderr)
        sys.exit(2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, help="where the run's events, cache and report live (default: a temp dir)")
    ap.add_argument("--report", type=Path, help="the launcher's report JSON (default: <run-dir>/report.json)")
    ap.add_argument("--field", default="total.stall_s", help="dotted path of the measured stall in the report")
    ap.add_argument("--policy", default="singleflight", choices=FIDELITY_POLICIES,
                    help="behind: run the job with --no-stall and compare eager steps")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--script", type=Path, default=REPO / "examples" / "train.py")
    ap.add_argument("--launcher-args", default="", help="extra launcher arguments, shell-quoted")
    ap.add_argument("--script-args", default="", help="the script's arguments, shell-quoted")
    ap.add_argument("--no-run", action="store_true", help="only replay an existing --run-dir")
    ap.add_argument("--tolerance", type=float, default=0.20)
    args = ap.parse_args()
    if args.no_run and args.run_dir is None:
        ap.error("--no-run needs --run-dir")
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="sim-fidelity-"))).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_run:
        extra = (["--no-stall"] if args.policy in ("no_stall", "pool") else []) + shlex.split(args.launcher_args)
        # the no_stall policy is the job without the compile pool; pool is the job's default
        env = {**os.environ, "RECIPECACHE_COMPILE_POOL": "0"} if args.policy == "no_stall" else None
        run_job(run_dir, args.nproc, args.script.resolve(), extra, shlex.split(args.script_args), env)
    try:
        result = replay(run_dir / "events", args.report or run_dir / "report.json", args.field, policy=args.policy)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    r = result.report
    print(f"trace: {r.ranks} ranks, {r.steps} steps, {r.shapes} keys; predicted under {r.policy}: "
          f"{r.compile_events} compiles, {r.wait_events} waits, {r.eager_steps} eager steps, "
          f"job stall {r.stall_s:.2f} s, worst step {r.worst_step_s:.2f} s, wall {r.wall_s:.2f} s")
    print(f"{result.figure}: measured {result.measured_s:.2f}, predicted {result.predicted_s:.2f}, "
          f"relative error {result.relative_error:.1%} (target {args.tolerance:.0%})")
    return 0 if result.relative_error <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
