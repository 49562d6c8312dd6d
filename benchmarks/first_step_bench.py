"""First training step of a fresh process: recipecache hit vs torch's own warm local cache.

The claim under test: a process on a fresh node (empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TMPDIR``) whose graphs another process already published starts as fast as a process
that finds everything in its own warm local inductor cache (target: no slower, <= 1.0x),
and far faster than compiling.

Scenarios, each a fresh process running one forward+backward+SGD step of a small pre-LN
block (LayerNorm, Linear 64->256, GELU, Linear 256->64, residual) under torch.compile:

* ``cold+publish``: empty dirs, empty store; compiles and publishes (reference);
* ``cold local``: empty dirs, torch alone; fills the local cache used by ``warm local``;
* ``hit``: empty dirs, the store ``cold+publish`` filled;
* ``warm local``: torch alone in ``cold local``'s dirs (its inductor dir and its ``TMPDIR``,
  which holds the precompiled header).

``hit`` and ``warm local`` alternate (``--pairs`` pairs, default 3) so each pair runs
under similar load; the ratio is of their medians. The step time starts before
``recipecache.enable()`` (right after ``import torch``), so the hook setup and the store
round trips are inside it. Every run must produce the same loss and parameter digest.
Both sides run with torch's default precompiled headers (``recipecache-run`` pins the
same), so the FX keys are comparable.

    python benchmarks/first_step_bench.py [--pairs N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TARGET_RATIO = 1.0


def child(mode: str) -> None:
    """One fresh process's first step; prints {"first_step_s", "digest", "compiles"} as JSON."""
    import hashlib
    import time

    import torch

    start = time.perf_counter()
    if mode == "rc":
        import recipecache

        recipecache.enable()
    torch.manual_seed(0)
    dim = 64

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(dim)
            self.fc1 = torch.nn.Linear(dim, 4 * dim)
            self.fc2 = torch.nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))

    model = Block()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model)
    x = torch.randn(8, 16, dim)
    step_start = time.perf_counter()
    loss = compiled(x).pow(2).mean()
    loss.backward()
    opt.step()
    end = time.perf_counter()
    digest = hashlib.sha256(loss.detach().numpy().tobytes())
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    out: dict[str, Any] = {"first_step_s": end - start, "step_only_s": end - step_start,
                           "digest": digest.hexdigest()[:16]}
    if mode == "rc":
        from recipecache.torch_integration import metrics

        out["compiles"] = metrics()["graph_compilation"]["TotalNumber"]
    print(json.dumps(out))


def run(workdir: Path, name: str, mode: str, store: Path, dirs: Path | None = None) -> dict[str, Any]:
    """Run one child in ``dirs`` (fresh ones under ``workdir`` when None)."""
    dirs = dirs or Path(tempfile.mkdtemp(prefix=f"{name.replace(' ', '-')}-", dir=workdir))
    (dirs / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(dirs / "inductor"), TMPDIR=str(dirs / "tmp"),
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    if mode == "rc":
        env["RECIPECACHE_URL"] = f"file://{store}"
    proc = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["dirs"] = dirs
    extra = f", {result['compiles']} graph compiles" if "compiles" in result else ""
    print(f"  {name:<13} {result['first_step_s']:7.2f} s{extra}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="interleaved hit/warm pairs (default 3)")
    p.add_argument("--workdir", type=Path, help="where stores and cache dirs go (default: a new temp dir)")
    p.add_argument("--child", choices=("rc", "plain"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="first-step-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "store"
    print(f"first step of a fresh process (threads: {os.environ.get('OMP_NUM_THREADS', '1')}, workdir {workdir})")
    results = [run(workdir, "cold+publish", "rc", store), run(workdir, "cold local", "plain", store)]
    warm_dirs = results[1]["dirs"]
    hits, warms = [], []
    for _ in range(args.pairs):
        hits.append(run(workdir, "hit", "rc", store))
        warms.append(run(workdir, "warm local", "plain", store, dirs=warm_dirs))
    results += hits + warms
    digests = {r["digest"] for r in results}
    if len(digests) != 1:
        sys.exit(f"runs disagree on the results: {sorted(digests)}")
    if any(r["compiles"] for r in hits):
        print("WARNING: a hit compiled graphs; the store did not serve everything")
    hit_s = statistics.median(r["first_step_s"] for r in hits)
    warm_s = statistics.median(r["first_step_s"] for r in warms)
    ratio = hit_s / warm_s
    print(f"\nmedian of {args.pairs}: hit {hit_s:.2f} s, warm local {warm_s:.2f} s, "
          f"ratio {ratio:.2f} (target <= {TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'MISSED'})")
    print(f"cold (reference): with recipecache {results[0]['first_step_s']:.2f} s, "
          f"torch alone {results[1]['first_step_s']:.2f} s; all runs digest {digests.pop()}")


if __name__ == "__main__":
    main()
