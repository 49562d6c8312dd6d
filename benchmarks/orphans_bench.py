"""Nothing outlives a killed launcher, and how soon: issue 28's target, 0 processes of a 2-rank job left
10 s after its launcher is SIGKILLed, at each of 5 points of the job.

The job and the kill are the ones ``tests/launcher/test_orphans.py`` runs (:func:`harness.orphans.kill_at`): a
2-rank gloo job stopped at a point (``started``, ``rendezvous``, ``collective``, ``training``, ``exit``), the launcher
SIGKILLed once both ranks are there, then the seconds until no process carrying the job's marker is
left. The test asserts only that they all end (a hang guard bounds its wait); the seconds are this
figure, measured here so that a busy machine cannot fail a test with them::

    python benchmarks/orphans_bench.py [--repeat 1] [--target 10]

Exit status 1 if any process was left after ``--target`` seconds, 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the launcher and recipecache of this checkout

from harness.orphans import kill_at, kill_job  # noqa: E402

POINTS = ("started", "rendezvous", "collective", "training", "exit")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="kills at each point")
    parser.add_argument("--target", type=float, default=10.0, help="seconds the job's processes may take to end")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}; SIGKILL of the launcher of a 2-rank job, target {args.target:g} s")
    worst, failed = 0.0, False
    with tempfile.TemporaryDirectory(prefix="orphans-bench-") as tmp:
        for i in range(args.repeat):
            for point in POINTS:
                marker, base = uuid.uuid4().hex, Path(tmp, f"{point}-{i}")
                base.mkdir()
                try:
                    took, survivors = kill_at(point, "launcher", [], marker, base, hang_guard=2 * args.target)
                finally:
                    kill_job(marker)
                left = took > args.target or bool(survivors)
                worst, failed = max(worst, took), failed or left
                print(f"{point:<11} all gone after {took:5.1f} s  left {len(survivors)}"
                      f"{'  FAIL ' + repr(survivors) if left else ''}", flush=True)
    print(f"worst {worst:.1f} s, load {os.getloadavg()[0]:.1f}: {'FAIL' if failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
