"""Graphs with collectives (issue 27): a transformer block's cold job through recipecache beside plain torchrun.

4 ranks on gloo, a dp=2 x tp=2 mesh, ``benchmarks/tp_block_worker.py``: a pre-norm transformer
block (attention + SwiGLU MLP) parallelised as TorchTitan does (``ColwiseParallel`` /
``RowwiseParallel``, sequence parallel norms: all_gather and reduce_scatter over tp in the
compiled graphs), ``torch.compile(block)`` with torch's defaults. ``--modes``: ``tp``, and
``fsdp_tp`` (FSDP2 over dp on top). Per mode and repetition, in one run:

(a) plain torchrun, the ranks sharing one fresh local inductor dir and TMPDIR (one node);
(b) recipecache-run on an empty file store, laid out as (a) (one node, fresh shared local dirs); with
    ``--rank-dirs`` every rank of (a), (b) and (c) in its own empty dirs, as on four nodes (one node's
    ranks share torch's kernel builds through its local dirs: file locks, one g++ per kernel);
(c) recipecache-run again on that store with fresh empty dirs: a job of fresh ranks.

Printed per mode: the distinct graphs of the job (the keys rank 0 looked up), the graphs
compiled in each job (inductor's FX cache entries for (a), recipecache's report for (b) and
(c)), wall seconds (and the job's CPU seconds, g++ included) and (b)/(a) (medians over ``--reps``, each rep's figures too), whether
every job's losses equal (a)'s bit for bit, and where the cold compile's time went: per
rank its compile and wait seconds (event log), and the g++ work in
the local dirs (CPU probes, precompiled header, kernels: count and the span from the first
source written to the last library built). Targets: (b) compiles the distinct graphs only,
(b)/(a) <= 0.6, (c) compiles nothing. The load average is printed before and after each job, and
each job's phases in seconds after its launch: for recipecache the slowest rank's enable() start and
end, then the slowest rank's script start and first step's end, the script's end (rank 0's output
written) and the launcher's exit.

``--fresh``: how soon fresh ranks train the block (the precompiled tier with a DTensor module, issue 27).
Per mode and repetition: plain torchrun cold, then warm on its local dirs; recipecache ``--precompile``
cold on an empty store; then on that store, with fresh empty dirs, a fresh job with ``--precompile``
and one without (the graph store, which the tier's builds fill). Printed: per rank the seconds from
launch to its first step's end in plain warm, graph-store fresh and precompiled fresh, the
fresh/warm ratios of the slowest rank, compiles, the tier's fallbacks, and whether losses equal plain's.

    python benchmarks/collectives_bench.py [--modes tp,fsdp_tp] [--reps 1] [--steps 2] [--rank-dirs]
                                           [--compile-threads 1] [--fresh]
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
from typing import Any

from harness.cpu import children_cpu_s

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "tp_block_worker.py"
RANKS = 4


def _env(compile_threads: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    env["PYTHONPATH"] = str(ROOT)
    if compile_threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = compile_threads
    return env


def _plain_compiles(local: Path) -> int:
    """Graphs inductor compiled in the plain job: every rank's FX cache entries in its local dirs."""
    return sum(1 for p in local.rglob("fxgraph/*/*/*") if p.is_file())


def gxx_work(root: Path) -> dict[str, tuple[int, float]]:
    """What g++ built under ``root`` (the job's local dirs): per kind (``probes``, ``header``, ``kernels``) how many
    and the seconds from the first source written to the last output built (file times)."""
    spans: dict[str, list[float]] = {"probes": [], "header": [], "kernels": []}
    counts = dict.fromkeys(spans, 0)
    for path in root.rglob("*"):
        name = path.name
        if name.endswith(".h.gch"):
            kind = "header"
        elif name.endswith(".main.so"):
            kind = "kernels"
        elif name.endswith(".so") and path.with_suffix(".cpp").exists():
            kind = "probes"  # torch's CPU-feature probes: a test source and its library beside the kernels
        else:
            continue
        counts[kind] += 1
        built = path.stat().st_mtime
        source = Path(str(path).removesuffix(".gch")) if kind == "header" else path.with_suffix(".cpp")
        spans[kind] += [built, source.stat().st_mtime if source.exists() else built]
    return {kind: (counts[kind], max(t) - min(t) if t else 0.0) for kind, t in spans.items()}


def run(tmp: Path, name: str, mode: str, steps: int, store: str | None, rank_dirs: bool,
        compile_threads: str, *options: str, local_of: str | None = None) -> dict[str, Any]:
    """One job; ``options`` go to recipecache-run; ``local_of``: the job whose local dirs it reuses (warm)."""
    out = tmp / f"{name}.json"
    env = _env(compile_threads)
    local = tmp / f"{local_of or name}-local"
    (local / "tmp").mkdir(parents=True, exist_ok=True)
    env |= {"TMPDIR": str(local / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(local / "inductor"), "OMP_NUM_THREADS": "1"}
    own_dirs: list[str] = []
    if store is None:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS)]
        own_dirs = ["--own-dirs", str(local / "ranks")] if rank_dirs else []
    else:
        command = [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--url", store, "--namespace",
                   "collectives-bench", "--run-dir", str(tmp / name), "--quiet",
                   *(["--rank-dirs", str(local / "ranks")] if rank_dirs else ["--node-dir", str(local / "node")]),
                   *options]
    load = os.getloadavg()[0]
    launched = time.time()
    start = time.perf_counter()
    cpu = children_cpu_s()
    proc = subprocess.run([*command, str(WORKER), str(out), "--mode", mode, "--steps", str(steps), *own_dirs],
                          env=env, capture_output=True, text=True, check=False, timeout=1800)
    wall = time.perf_counter() - start
    cpu = children_cpu_s() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text()) | {"wall_s": wall, "cpu_s": cpu, "load": (load, os.getloadavg()[0]),
                                            "gxx": gxx_work(local)}
    # the job's phases, seconds after its launch: the slowest rank's script start and first step's end, rank 0's
    # output written (the script's end), the launcher's exit
    result["first_step"] = [s + m["step0"] - launched for s, m in zip(result["starts"], result["marks"], strict=True)]
    result["phases"] = {"script start": max(result["starts"]) - launched,
                        "first step": max(result["first_step"]),
                        "script end": out.stat().st_mtime - launched, "exit": wall}
    if store is None:
        result["compiles"] = _plain_compiles(local)
        return result
    from recipecache.runs.events import read_events

    events = list(read_events(tmp / name / "events"))
    spans = [json.loads(path.read_text())["enable"] for path in sorted((tmp / name).glob("metrics-rank*.json"))]
    result["phases"] = {"enable() start": max(span["start"] for span in spans) - launched,
                        "enable() end": max(span["start"] + span["s"] for span in spans) - launched,
                        **result["phases"]}
    result["compiles"] = json.loads((tmp / name / "report.json").read_text())["total"]["compiles"]
    result["fallbacks"] = [json.loads(path.read_text()).get("precompile_fallbacks", {})
                           for path in sorted((tmp / name).glob("metrics-rank*.json"))]
    result["distinct"] = len({e["key"] for e in events if e["rank"] == 0 and e["event"] in ("hit", "miss")})
    result["per_rank"] = [{"compile_s": sum(e["duration"] for e in events if e["rank"] == r and e["event"] == "compile"),
                           "wait_s": sum(e["duration"] for e in events if e["rank"] == r and e["event"] == "wait")}
                          for r in range(RANKS)]
    return result


def describe(name: str, job: dict[str, Any]) -> str:
    gxx = ", ".join(f"{kind} {n} in {s:.1f} s" for kind, (n, s) in job["gxx"].items())
    phases = ", ".join(f"{phase} {s:.1f}" for phase, s in job["phases"].items())
    line = (f"    {name:6} {job['wall_s']:6.1f} s ({job['cpu_s']:.0f} CPU s), {job['compiles']} compiles, load "
            f"{job['load'][0]:.1f}->"
            f"{job['load'][1]:.1f}; s after launch: {phases}; g++: {gxx}")
    if "per_rank" in job:
        line += "\n           per rank compile/wait s: " + " ".join(
            f"r{r} {p['compile_s']:.1f}/{p['wait_s']:.1f}" for r, p in enumerate(job["per_rank"]))
    return line


def fresh_jobs(mode: str, rep: int, args: argparse.Namespace) -> None:
    """``--fresh``: plain cold then warm, the tier cold, then fresh jobs with and without the tier (module doc)."""
    with tempfile.TemporaryDirectory(prefix=f"collectives-fresh-{mode}-") as tmp_dir:
        tmp = Path(tmp_dir)
        store = f"file://{tmp / 'store'}"
        common = (mode, args.steps)
        jobs = {"plain": run(tmp, "plain", *common, None, args.rank_dirs, args.compile_threads)}
        jobs["plain warm"] = run(tmp, "warm", *common, None, args.rank_dirs, args.compile_threads, local_of="plain")
        jobs["tier cold"] = run(tmp, "tiercold", *common, store, args.rank_dirs, args.compile_threads, "--precompile")
        jobs["tier fresh"] = run(tmp, "tierfresh", *common, store, args.rank_dirs, args.compile_threads,
                                 "--precompile")
        jobs["graph-store fresh"] = run(tmp, "gsfresh", *common, store, args.rank_dirs, args.compile_threads)
    print(f"mode {mode} rep {rep}:", flush=True)
    for name, job in jobs.items():
        print(describe(name, job), flush=True)
    warm = max(jobs["plain warm"]["first_step"])
    print("  seconds from launch to the first step's end, per rank:", flush=True)
    for name in ("plain warm", "graph-store fresh", "tier fresh"):
        job = jobs[name]
        print(f"    {name:17} {' '.join(f'{t:6.2f}' for t in job['first_step'])}  slowest / plain warm's "
              f"{max(job['first_step']) / warm:.2f}x; wall {job['wall_s']:.1f} s, {job.get('compiles', '-')} compiles, "
              f"tier fallbacks {job.get('fallbacks', '-')}, losses equal plain: "
              f"{job['losses'] == jobs['plain']['losses']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="tp,fsdp_tp")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rank-dirs", action="store_true", help="every rank in its own dirs, as on four nodes")
    parser.add_argument("--compile-threads", default="1",
                        help="TORCHINDUCTOR_COMPILE_THREADS for every job ('' leaves torch's default: the CPU count)")
    parser.add_argument("--fresh", action="store_true",
                        help="fresh jobs with and without the precompiled tier beside plain warm (module doc)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    for mode in args.modes.split(","):
        if args.fresh:
            for rep in range(args.reps):
                fresh_jobs(mode, rep, args)
            continue
        reps = []
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory(prefix=f"collectives-{mode}-") as tmp_dir:
                tmp = Path(tmp_dir)
                store = f"file://{tmp / 'store'}"
                jobs: dict[str, dict[str, Any]] = {}
                order = ["plain", "cold"] if rep % 2 == 0 else ["cold", "plain"]  # neither side always first
                for name in order:
                    jobs[name] = run(tmp, name, mode, args.steps, None if name == "plain" else store, args.rank_dirs,
                                     args.compile_threads)
                jobs["fresh"] = run(tmp, "fresh", mode, args.steps, store, args.rank_dirs, args.compile_threads)
            reps.append(jobs)
            print(f"mode {mode} rep {rep}:", flush=True)
            for name in ("plain", "cold", "fresh"):
                print(describe(name, jobs[name]), flush=True)
        ratios = [r["cold"]["wall_s"] / r["plain"]["wall_s"] for r in reps]
        equal = all(r[name]["losses"] == r["plain"]["losses"] for r in reps for name in ("cold", "fresh"))
        print(f"mode {mode}: distinct graphs {reps[0]['cold']['distinct']} | plain torchrun "
              f"{statistics.median(r['plain']['wall_s'] for r in reps):.1f} s, "
              f"{[r['plain']['compiles'] for r in reps]} compiles | recipecache cold "
              f"{statistics.median(r['cold']['wall_s'] for r in reps):.1f} s, {[r['cold']['compiles'] for r in reps]} "
              f"compiles, {statistics.median(ratios):.2f}x plain (reps {' '.join(f'{x:.2f}' for x in ratios)}; "
              f"target <= 0.6) | fresh job {statistics.median(r['fresh']['wall_s'] for r in reps):.1f} s, "
              f"{[r['fresh']['compiles'] for r in reps]} compiles | losses equal plain bit for bit: {equal}",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
