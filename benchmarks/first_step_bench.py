"""First training step of a fresh process: recipecache hits vs torch's own warm local cache.

Two claims under test, for a process on a fresh node (empty ``TORCHINDUCTOR_CACHE_DIR``
and ``TMPDIR``) whose work another process already published:

* graph store (``enable()``): its first step is no slower than a process that finds
  everything in its own warm local inductor cache (target: <= 1.0x);
* precompiled tier (``enable(precompile=True)``): it skips dynamo's tracing and
  AOTAutograd altogether, so its first step takes at most 0.3x of the warm local one.

Models (``--models``): ``mlp``, a pre-LN block (LayerNorm, Linear 64->256, GELU, Linear
256->64, residual) on 8x16x64, and ``lm``, a small causal transformer LM (2 layers, 4
heads, width 64, vocab 256, sequence 32, batch 4, cross-entropy). Each run is a fresh
process doing one forward+backward+SGD step under torch.compile:

* ``cold+publish``, ``cold+precompile``: empty dirs and store; compile and publish
  (references, and they fill the two stores);
* ``cold local``: empty dirs, torch alone; fills the local cache ``warm local`` uses;
* ``hit`` (graph store), ``precompiled`` (precompiled store): empty dirs;
* ``warm local``: torch alone in ``cold local``'s dirs.

``hit``, ``precompiled`` and ``warm local`` alternate (``--pairs`` rounds, default 3) so
each round runs under similar load; ratios are of medians. Two times per run:
``step``, from just before the compiled call to after ``opt.step()`` (the first
training step; the targets), and ``process``, from right after ``import torch``
(``enable()``, model construction and ``torch.compile``'s own imports included). Every
run must produce the same loss and gradient digest: the precompiled path is bitwise
the normal path. Every side runs with torch's default precompiled headers
(``recipecache-run`` and ``enable()`` pin the same), so the FX keys are comparable; the
warm local runs keep ``cold local``'s ``TMPDIR``, which holds the header.

``--ranks`` adds the multi-rank target: ``examples/train.py`` (2 ranks, DDP over gloo)
as a job of fresh ranks (``recipecache-run --precompile --rank-dirs``, empty local
dirs) on a store a cold precompile job filled, against plain torchrun whose ranks share
a local inductor cache a cold plain job warmed; the job's first step is its slowest
rank's step 0 (DDP makes every rank wait for it). Target: <= 0.3x.

    python benchmarks/first_step_bench.py [--pairs N] [--models mlp,lm] [--ranks] [--workdir DIR]
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

import torch
import torch.nn.functional as F
from tiny_gpt import TinyGPT  # beside this script
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
HIT_TARGET = 1.0
PRECOMPILED_TARGET = 0.3


class PreLNBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def build(name: str, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model and its example inputs on ``device`` (seeded on the CPU: every process builds the same)."""
    torch.manual_seed(0)
    if name == "mlp":
        model, inputs = PreLNBlock(64), (torch.randn(8, 16, 64),)
    else:
        vocab, seq = 256, 32
        tokens = torch.randint(0, vocab, (4, seq + 1))
        model, inputs = TinyGPT(vocab, seq), (tokens[:, :-1], tokens[:, 1:])
    return model.to(device), tuple(t.to(device) for t in inputs)


#: what :class:`GpuWork` reports for each GPU run
GPU_FIGURES = ("triton_ptx", "autotune_benchmarks", "max_autotune_choices", "fx_hits", "fx_misses")


class GpuWork:
    """Counts what a fresh GPU process compiles or tunes although a cache could have served it.

    Triton kernels reaching its PTX stage (a real compile: a kernel served from a cache
    skips it) and inductor's runtime autotuning of kernel configs (``benchmark_all_configs``),
    beside inductor's own counters (``select_algorithm_autotune``: max-autotune's choices).
    Counts calls in this process: the bench runs GPU children with one compile thread.
    """

    def __init__(self) -> None:
        self.ptx = self.benchmarks = 0
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        original_bench = CachingAutotuner.benchmark_all_configs

        def benchmark_all_configs(autotuner: Any, *args: Any, **kwargs: Any) -> Any:
            self.benchmarks += 1
            return original_bench(autotuner, *args, **kwargs)

        CachingAutotuner.benchmark_all_configs = benchmark_all_configs  # type: ignore[method-assign]
        try:
            from triton.backends.nvidia.compiler import CUDABackend
        except ImportError:  # another GPU vendor: PTX counts stay 0
            return
        original_ptx = CUDABackend.make_ptx

        def make_ptx(*args: Any, **kwargs: Any) -> Any:
            self.ptx += 1
            return original_ptx(*args, **kwargs)

        CUDABackend.make_ptx = staticmethod(make_ptx) if isinstance(  # type: ignore[method-assign]
            vars(CUDABackend).get("make_ptx"), staticmethod) else make_ptx

    def figures(self) -> dict[str, int]:
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        return {"triton_ptx": self.ptx, "autotune_benchmarks": self.benchmarks,
                "max_autotune_choices": int(inductor["select_algorithm_autotune"]),
                "fx_hits": int(inductor["fxgraph_cache_hit"]), "fx_misses": int(inductor["fxgraph_cache_miss"])}


def child(mode: str, model_name: str, device: str, compile_mode: str) -> None:
    """One fresh process's first step; prints its times, digest and counters as JSON."""
    import hashlib
    import time

    start = time.perf_counter()  # torch is imported: process start-up is not what this compares
    gpu = GpuWork() if device != "cpu" else None
    if mode != "plain":
        import recipecache

        recipecache.enable(precompile=mode == "pc")
    model, inputs = build(model_name, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
    step_start = time.perf_counter()
    out = compiled(*inputs)
    loss = out if out.dim() == 0 else out.pow(2).mean()
    loss.backward()
    opt.step()
    if gpu is not None:
        torch.cuda.synchronize()
    end = time.perf_counter()
    digest = hashlib.sha256(loss.detach().cpu().numpy().tobytes())
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    from torch._dynamo.utils import counters

    result: dict[str, Any] = {"process_s": end - start, "step_s": end - step_start, "digest": digest.hexdigest()[:16],
                              "frames": int(counters["frames"]["total"])}
    if gpu is not None:
        result.update(gpu.figures())
    if mode != "plain":
        from recipecache.torch_integration import metrics

        m = metrics()
        result.update(compiles=m["graph_compilation"]["TotalNumber"], precompiled=m["lookups"]["precompiled"],
                      fallbacks=m["fallbacks"])
    print(json.dumps(result))


def clean_env(dirs: Path, device: str = "cpu") -> dict[str, str]:
    """A fresh node's environment: its own empty inductor (and so Triton) cache and temp dir.

    On a GPU, inductor compiles in this process (one compile thread), so :class:`GpuWork`
    sees every Triton compile and autotuning run.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_", "TRITON_"))}
    (dirs / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(dirs / "inductor"), TMPDIR=str(dirs / "tmp"),
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH")))))
    if device != "cpu":
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    return env


def run(workdir: Path, name: str, mode: str, model: str, dirs: Path | None = None, *, device: str = "cpu",
        compile_mode: str = "default") -> dict[str, Any] | None:
    """Run one child in ``dirs`` (fresh ones under ``workdir`` when None).

    A failed child ends the bench on the CPU; on a GPU it is reported (exit status, the
    end of its stderr, the whole of it in ``<workdir>/failed-*.log``) and that side skipped,
    so one broken path does not hide the others' figures.
    """
    dirs = dirs or Path(tempfile.mkdtemp(prefix=f"{model}-{name.replace(' ', '-')}-", dir=workdir))
    env = clean_env(dirs, device)
    if mode != "plain":
        env["RECIPECACHE_URL"] = f"file://{workdir / f'store-{mode}-{compile_mode}'}"
    env["PYTHONFAULTHANDLER"] = "1"  # a child killed by a signal prints its Python stacks
    proc = subprocess.run([sys.executable, __file__, "--child", mode, model, device, compile_mode], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        message = f"{model} {name} failed (exit status {proc.returncode}):\n{proc.stderr[-3000:]}"
        if device == "cpu":
            sys.exit(message)
        log = workdir / f"failed-{model}-{name.replace(' ', '-').replace('+', '-')}.log"
        log.write_text(proc.stdout + "\n---- stderr\n" + proc.stderr)
        print(f"  {message}\n  (whole output: {log})", flush=True)
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["dirs"] = dirs
    extra = f", {result['compiles']} graph compiles" if "compiles" in result else ""
    extra += f", {result['frames']} frames traced"
    if "triton_ptx" in result:
        extra += (f", {result['triton_ptx']} Triton compiles, {result['autotune_benchmarks']} autotuning runs, "
                  f"{result['max_autotune_choices']} max-autotune choices, FX hit/miss {result['fx_hits']}/"
                  f"{result['fx_misses']}")
    if result.get("fallbacks"):
        extra += f", fallbacks {result['fallbacks']}"
    print(f"  {model} {name:<16} step {result['step_s']:7.2f} s  process {result['process_s']:7.2f} s{extra}",
          flush=True)
    return result


def ratio(rows: list[dict[str, Any]], base: list[dict[str, Any]], field: str) -> tuple[float, float, float]:
    a, b = statistics.median(r[field] for r in rows), statistics.median(r[field] for r in base)
    return a, b, a / b


def single_process(workdir: Path, model: str, pairs: int, device: str = "cpu",
                   compile_mode: str = "default") -> dict[str, Any]:
    def side(name: str, mode: str, dirs: Path | None = None) -> dict[str, Any]:
        return run(workdir, name, mode, model, dirs, device=device, compile_mode=compile_mode)

    print(f"{model} on {device}, torch.compile mode {compile_mode}:", flush=True)
    cold = {name: side(name, mode) for name, mode in
            (("cold+publish", "rc"), ("cold+precompile", "pc"), ("cold local", "plain"))}
    if cold["cold local"] is None:
        sys.exit(f"{model}: torch alone failed; nothing to compare with")
    warm_dirs = cold["cold local"]["dirs"]
    sides = {"hit": ("rc", "cold+publish"), "precompiled": ("pc", "cold+precompile"), "warm local": ("plain", "")}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for _ in range(pairs):
        for name, (mode, filled_by) in sides.items():
            if not filled_by or cold[filled_by] is not None:  # a store its cold run failed to fill serves nothing
                row = side(name, mode, None if filled_by else warm_dirs)
                if row is not None:
                    rounds[name].append(row)
    results = [r for r in cold.values() if r is not None]
    if device != "cpu":
        for name in ("hit", "precompiled"):
            if any(r["triton_ptx"] or r["autotune_benchmarks"] or r["max_autotune_choices"] for r in rounds[name]):
                print(f"WARNING: {model}: a {name} run compiled Triton kernels or autotuned on a fresh node")
    digests = {r["digest"] for r in results + [r for rows in rounds.values() for r in rows]}
    # a path: the cold run that filled a cache, and the runs that cache served
    by_path = {filled_by or "cold local": {r["digest"] for r in [cold[filled_by or "cold local"], *rounds[name]]
                                           if r is not None}
               for name, (_, filled_by) in sides.items()}
    if len(digests) != 1:
        # On the CPU every path runs the same kernels. On a GPU, kernels autotuned anew (a
        # Triton config chosen by timing) may round differently: compare within one path.
        message = f"{model}: runs disagree on the results: {sorted(digests)}"
        if device == "cpu" or any(len(d) != 1 for d in by_path.values()):
            sys.exit(f"{message}; by path: { {path: sorted(d) for path, d in by_path.items()} }")
        print(f"WARNING: {message}, one per path (each cold run autotuned anew): "
              + ", ".join(f"{path} {d.pop()}" for path, d in by_path.items()))
    if any(r["compiles"] for r in rounds["hit"] + rounds["precompiled"]):
        print(f"WARNING: {model}: a hit compiled graphs; the store did not serve everything")
    if any(r["frames"] for r in rounds["precompiled"]):
        print(f"WARNING: {model}: a precompiled run traced frames")
    summary: dict[str, Any] = {"digests": sorted(digests), "device": device, "mode": compile_mode,
                               "cold_s": {name: r["process_s"] for name, r in cold.items() if r is not None}}
    if device != "cpu":
        summary["gpu_work"] = {name: [{k: r[k] for k in GPU_FIGURES} for r in rows] for name, rows in rounds.items()}
    for field in ("step_s", "process_s"):
        summary[field] = {name: [r[field] for r in rows] for name, rows in rounds.items()}
    print(f"\n{model}: medians of {pairs} rounds (step = first compiled fwd+bwd+SGD step; process = since import torch)")
    for name, target in (("hit", HIT_TARGET), ("precompiled", PRECOMPILED_TARGET)):
        if not rounds[name]:
            print(f"  {name:<12} no figures: its runs failed")
            continue
        for field in ("step_s", "process_s"):
            mine, warm, r = ratio(rounds[name], rounds["warm local"], field)
            summary[f"{name}_{field}_ratio"] = r
            verdict = f"target <= {target}: {'met' if r <= target else 'MISSED'}" if field == "step_s" else "info"
            print(f"  {name:<12} {field[:-2]:<8} {mine:6.2f} s vs warm local {warm:6.2f} s: {r:5.2f}x ({verdict})")
    print("  cold (reference, process): " + ", ".join(f"{name} {seconds:.1f} s"
                                                    for name, seconds in summary["cold_s"].items())
          + f"; digests {' '.join(summary['digests'])}\n")
    return summary


def job(workdir: Path, name: str, *, precompile: bool, dirs: Path) -> list[float]:
    """One 2-rank run of examples/train.py; returns every rank's first-step seconds."""
    losses = workdir / f"{name}.json"
    args = [str(EXAMPLE), "--buckets", "16,32", "--steps", "2", "--losses", str(losses)]
    env = clean_env(dirs)
    if precompile:
        cmd = [sys.executable, "-m", "launcher.main", "--nproc", "2", "--precompile", "--url",
               f"file://{workdir / 'store-ranks'}", "--namespace", "bench", "--run-dir", str(workdir / name),
               "--rank-dirs", str(dirs), *args]
    else:  # plain torchrun: both ranks share one local inductor cache (warm after the cold job)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"job {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    first = json.loads(losses.read_text())["step_s"][0]
    print(f"  ranks {name:<22} first step per rank {' '.join(f'{t:6.2f}' for t in first)} s", flush=True)
    return first


def multi_rank(workdir: Path, pairs: int) -> dict[str, Any]:
    print("2-rank job (examples/train.py, DDP over gloo): cold jobs fill the store and the local cache")
    job(workdir, "cold precompile", precompile=True, dirs=workdir / "ranks-cold")
    job(workdir, "cold torchrun", precompile=False, dirs=workdir / "ranks-local")
    fresh, warm = [], []
    for i in range(pairs):
        fresh.append(max(job(workdir, f"fresh ranks precompiled {i}", precompile=True,
                             dirs=workdir / f"ranks-fresh-{i}")))
        warm.append(max(job(workdir, f"torchrun warm local {i}", precompile=False, dirs=workdir / "ranks-local")))
    r = statistics.median(fresh) / statistics.median(warm)
    print(f"\nranks: job first step (slowest rank), medians of {pairs}: fresh ranks on the precompiled store "
          f"{statistics.median(fresh):.2f} s vs plain torchrun warm local {statistics.median(warm):.2f} s: {r:.2f}x "
          f"(target <= {PRECOMPILED_TARGET}: {'met' if r <= PRECOMPILED_TARGET else 'MISSED'})")
    return {"fresh_precompiled_s": fresh, "torchrun_warm_local_s": warm, "ratio": r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--models", default="mlp,lm", help="comma-separated: mlp, lm (default both)")
    p.add_argument("--ranks", action="store_true", help="also the 2-rank job target")
    p.add_argument("--workdir", type=Path, help="where stores and cache dirs go (default: a new temp dir)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: on a GPU, also count Triton "
                   "compiles and autotuning runs of each fresh process")
    p.add_argument("--mode", default="default", choices=("default", "reduce-overhead", "max-autotune"),
                   help="torch.compile mode (reduce-overhead: CUDA graphs)")
    p.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "DEVICE", "COMPILE_MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="first-step-bench-"))).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"first step of a fresh process (threads: {os.environ.get('OMP_NUM_THREADS', '1')}, workdir {workdir})")
    figures: dict[str, Any] = {m: single_process(workdir, m, args.pairs, args.device, args.mode)
                               for m in args.models.split(",") if m}
    if args.ranks:
        figures["ranks"] = multi_rank(workdir, args.pairs)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
