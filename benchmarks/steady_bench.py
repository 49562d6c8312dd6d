"""Steady-step cost of the precompiled tier's calls beside torch's own warm cache (issue 33, later iterations).

cold_bench's fresh job (the tier, fresh ranks, a filled store) must run every iteration after
the first two within 1.2x of plain torchrun's warm job. Those iterations compile nothing: what
is left is what each call costs. This runs cold_bench's small GPT (DDP over gloo, one rank;
a train step and an eval pass per sequence length, as ``cold_bench.py job``) in fresh
processes:

* ``plain cold`` fills a local inductor cache (no recipecache), ``pc cold`` fills a store with
  the tier (``enable(precompile=True)``), neither timed;
* then, interleaved ``--pairs`` times: ``plain warm`` (torch's warm local cache) and ``pc fresh``
  (an empty inductor cache, the tier loading from the filled store). Each runs ``--warm``
  untimed iterations, then ``--iters`` timed ones, and reports the median per call of the
  compiled forward (train and eval) and of the whole train step, in microseconds.

Printed: each pair's medians (wall and this thread's CPU time: the CPU time is less disturbed
by other processes on a shared machine) and the tier / plain ratios, their medians over the
pairs, the load average. Last, one fresh process on the store runs the tier's calls and
torch's own (dynamo, its graphs from the store; ``Tier.active`` switched) in turn, the same
run's medians side by side. ``--profile`` writes a cProfile of each process's timed calls;
``--workdir`` keeps the caches and the store, and a later run on it skips the cold runs.

    python benchmarks/steady_bench.py [--pairs 3] [--iters 30] [--warm 2] [--lengths 16,24,32,40] [--profile]
                                      [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64


def job(args: argparse.Namespace) -> None:
    """One process: the small GPT under DDP (one rank), per iteration a train step and an eval pass per length."""
    if args.tier:
        from recipecache.torch_integration import enable

        enable(precompile=True)
    import torch
    import torch.distributed as dist
    from tiny_gpt import TinyGPT  # beside this script
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{args.out}.rendezvous", rank=0, world_size=1)
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, max(lengths), 32, 2, 2, head_bias=True)
    compiled = torch.compile(DistributedDataParallel(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def batch(it: int, step: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(it * 1009 + step * 31)
        seq = (torch.randint(0, VOCAB, (4, 1), generator=gen) + torch.arange(length + 1)) % VOCAB
        return seq[:, :-1], seq[:, 1:]

    #: per phase, (wall seconds, this thread's CPU seconds) of each timed call
    times: dict[str, list[tuple[float, float]]] = {}

    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    side = ""

    def note(timed: bool, what: str, start: tuple[float, float], end: tuple[float, float]) -> None:
        if timed:
            times.setdefault(side + what, []).append((end[0] - start[0], end[1] - start[1]))

    def iteration(it: int, timed: bool) -> None:
        for step, length in enumerate(lengths):
            tokens, targets = batch(it, step, length)
            start = now()
            loss = compiled(tokens, targets)
            forward = now()
            loss.backward()
            backward = now()
            opt.step()
            opt.zero_grad(set_to_none=True)
            note(timed, "train forward", start, forward)
            note(timed, "train backward", forward, backward)
            note(timed, "train step", start, now())
        model.eval()
        with torch.no_grad():
            for step, length in enumerate(lengths):
                tokens, targets = batch(it, 100 + step, length)
                start = now()
                compiled(tokens, targets)
                note(timed, "eval forward", start, now())
        model.train()

    tier = None
    if args.both:  # the tier's calls and torch's own (dynamo, its graphs from the store) in turn, in this process
        from recipecache.torch_integration import _session

        tier = _session.tier
    sides = ("tier ", "torch ") if tier is not None else ("",)
    for it in range(args.warm):
        for side in sides:
            if tier is not None:
                tier.active = side == "tier "
            iteration(it, False)
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    for it in range(args.iters):
        for side in sides if it % 2 == 0 else sides[::-1]:
            if tier is not None:
                tier.active = side == "tier "
            iteration(args.warm + it, True)
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{args.out}.prof")
    Path(args.out).write_text(json.dumps({what: [statistics.median(t[i] for t in v) * 1e6 for i in (0, 1)]
                                          for what, v in times.items()}))
    dist.destroy_process_group()


def run(work: Path, name: str, *, cache: Path, store: Path | None, options: argparse.Namespace,
        warm: int, iters: int, profile: bool = False, both: bool = False) -> dict[str, list[float]]:
    out = work / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", TORCHINDUCTOR_CACHE_DIR=str(cache),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "job", "--out", str(out), "--lengths", options.lengths,
           "--warm", str(warm), "--iters", str(iters)]
    if store is not None:
        env.update(RECIPECACHE_URL=f"file://{store}", RECIPECACHE_NAMESPACE="steady-bench")
        cmd.append("--tier")
    if profile:
        cmd.append("--profile")
    if both:
        cmd.append("--both")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    j = sub.add_parser("job")
    j.add_argument("--out", required=True)
    j.add_argument("--lengths", required=True)
    j.add_argument("--warm", type=int, required=True)
    j.add_argument("--iters", type=int, required=True)
    j.add_argument("--tier", action="store_true")
    j.add_argument("--profile", action="store_true")
    j.add_argument("--both", action="store_true")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--lengths", default="16,24,32,40")
    p.add_argument("--profile", action="store_true", help="write cProfiles of the timed calls (<workdir>/<side>-<pair>.json.prof)")
    p.add_argument("--workdir", type=Path, help="keep the caches and store here; a later run reuses them (skips the cold runs)")
    args = p.parse_args()
    if args.command == "job":
        job(args)
        return
    with tempfile.TemporaryDirectory(prefix="steady-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        plain, store = work / "plain-cache", work / "store"
        start = time.perf_counter()
        if not (work / "plain-cold.json").is_file():
            run(work, "plain-cold", cache=plain, store=None, options=args, warm=args.warm, iters=1)
        if not (work / "pc-cold.json").is_file():
            run(work, "pc-cold", cache=work / "pc-cold-cache", store=store, options=args, warm=args.warm, iters=1)
        print(f"cold runs filled the caches in {time.perf_counter() - start:.0f} s; medians per call, us "
              f"({args.iters} timed iterations of {len(args.lengths.split(','))} lengths after {args.warm})")
        ratios: dict[str, list[float]] = {}
        for pair in range(args.pairs):
            order = ("plain", "tier") if pair % 2 == 0 else ("tier", "plain")
            results: dict[str, dict[str, list[float]]] = {}
            for side in order:
                fresh = work / f"fresh-{pair}"
                shutil.rmtree(fresh, ignore_errors=True)
                results[side] = run(work, f"{side}-{pair}", cache=plain if side == "plain" else fresh,
                                    store=None if side == "plain" else store, options=args, warm=args.warm,
                                    iters=args.iters, profile=args.profile)
            print(f"  pair {pair} ({' first, '.join(order)} second; load average {os.getloadavg()[0]:.1f}): "
                  "tier vs plain warm, wall | CPU", flush=True)
            for what, plain_times in results["plain"].items():
                tier_times = results["tier"][what]
                cells = []
                for i, clock in enumerate(("wall", "cpu")):
                    ratio = tier_times[i] / plain_times[i]
                    ratios.setdefault(f"{what} {clock}", []).append(ratio)
                    cells.append(f"{tier_times[i]:7.0f} vs {plain_times[i]:7.0f} ({ratio:.2f}x)")
                print(f"    {what:<15} " + " | ".join(cells))
        print(f"median over {args.pairs} pairs, tier / plain warm (load average {os.getloadavg()[0]:.1f}):")
        for what, r in ratios.items():
            print(f"    {what:<20} {statistics.median(r):.2f}x")
        shutil.rmtree(work / "fresh-both", ignore_errors=True)
        both = run(work, "both", cache=work / "fresh-both", store=store, options=args, warm=args.warm,
                   iters=args.iters, both=True)
        print(f"one fresh process, the tier's calls and torch's own (its graphs from the store) in turn, "
              f"wall | CPU (load average {os.getloadavg()[0]:.1f}):")
        for what in (w.removeprefix("torch ") for w in both if w.startswith("torch ")):
            tier_times, torch_times = both["tier " + what], both["torch " + what]
            print(f"    {what:<15} " + " | ".join(f"{tier_times[i]:7.0f} vs {torch_times[i]:7.0f} "
                                                    f"({tier_times[i] / torch_times[i]:.2f}x)" for i in (0, 1)))

if __name__ == "__main__":
    main()
