"""Graphs with collectives (issue 27): a cold job through recipecache beside plain torchrun, then a fresh job.

4 ranks on gloo, a dp=2 x tp=2 mesh, ``tests/workers/tp_ranks.py`` (tiny MLPs; ``--mode``:
``tp`` tensor parallel, ``fsdp_tp`` FSDP2 over dp on top of it, ``all`` tensor, sequence and
expert parallel plus a graph over both groups). Per mode, in one run:

(a) plain torchrun, the ranks sharing one fresh local inductor dir and TMPDIR (one node);
(b) recipecache-run on an empty file store, laid out as (a) (one node, fresh shared local dirs), or with
    ``--rank-dirs`` every rank in its own empty dirs, as on four nodes (then torch's precompiled header and
    CPU probes are not shared through a common TMPDIR as in (a));
(c) recipecache-run again on that store with fresh empty dirs: a job of fresh ranks.

Printed: wall seconds, the graphs compiled in the job (inductor's ``fxgraph_cache_miss`` for
(a), recipecache's report for (b) and (c)), (b)/(a), and whether the losses equal (a)'s bit
for bit. Targets: (b) compiles the distinct graphs only, (b)/(a) <= 0.6, (c) compiles nothing.

    python benchmarks/collectives_bench.py [--modes tp,fsdp_tp] [--steps 2] [--rank-dirs]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "tp_ranks.py"
RANKS = 4


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    return env | {"PYTHONPATH": str(ROOT), "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _plain_compiles(tmp: Path) -> int:
    """Graphs inductor compiled in the plain job: every rank's FX cache entries in the shared local dir."""
    return sum(1 for p in (tmp / "inductor" / "fxgraph").glob("*/*/*") if p.is_file())


def run(tmp: Path, name: str, mode: str, steps: int, store: str | None, rank_dirs: bool = False) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    env = _env()
    local = tmp / f"{name}-local"
    (local / "tmp").mkdir(parents=True, exist_ok=True)
    if not rank_dirs:
        env |= {"TMPDIR": str(local / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(local / "inductor"), "OMP_NUM_THREADS": "1"}
    if store is None:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS)]
    else:
        command = [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--cache", store, "--namespace",
                   "collectives-bench", "--run-dir", str(tmp / name), "--quiet",
                   *(["--rank-dirs", str(tmp / f"{name}-dirs")] if rank_dirs else ["--node-dir", str(local / "node")])]
    start = time.perf_counter()
    proc = subprocess.run([*command, str(WORKER), str(out), "--mode", mode, "--steps", str(steps)], env=env,
                          capture_output=True, text=True, check=False, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text()) | {"wall_s": wall}
    if store is None:
        result["compiles"] = _plain_compiles(local)
    else:
        result["compiles"] = json.loads((tmp / name / "report.json").read_text())["total"]["compiles"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="tp,fsdp_tp")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rank-dirs", action="store_true", help="recipecache's ranks each in their own dirs")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"collectives-{mode}-") as tmp_dir:
            tmp = Path(tmp_dir)
            plain = run(tmp, "plain", mode, args.steps, None)
            store = f"file://{tmp / 'store'}"
            cold = run(tmp, "cold", mode, args.steps, store, args.rank_dirs)
            fresh = run(tmp, "fresh", mode, args.steps, store, args.rank_dirs)
        print(f"mode {mode}: plain torchrun {plain['wall_s']:.1f} s, {plain['compiles']} compiles | "
              f"recipecache cold {cold['wall_s']:.1f} s, {cold['compiles']} compiles "
              f"({cold['wall_s'] / plain['wall_s']:.2f}x plain) | fresh job {fresh['wall_s']:.1f} s, "
              f"{fresh['compiles']} compiles | losses equal plain: "
              f"{cold['losses'] == plain['losses'] and fresh['losses'] == plain['losses']}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
