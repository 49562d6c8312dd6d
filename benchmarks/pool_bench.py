"""The cold job at its limit (issue 47): rank 0 alone has graphs to compile while the other ranks wait.

The job (``pool_bench.py job``, run by torchrun in every rank) is the small GPT of ``tiny_gpt.py`` trained with DDP
over gloo on CPU, compiled with torch's defaults (``torch.compile`` of the DDP module: automatic dynamic shapes),
every rank in its own empty ``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` (``--rank-dirs``), as if on its own node.
Every iteration trains one step per sequence length on every rank (a second length makes torch recompile the
graphs dynamic), then rank 0 ALONE runs an evaluation (no-grad forward) over other lengths, in another order each
iteration: inference graphs no other rank traces, while the next step's allreduce makes the others wait for it.

Sides, each job on new nodes (fresh empty rank dirs, an empty store, a fresh redis-server), interleaved over
``--reps`` (the order reverses every other repetition; medians over the repetitions):

* ``plain``: torchrun, torch's defaults (local caches only);
* ``torch redis``: torchrun with torch's own remote FX-graph and AOTAutograd caches on a real redis-server
  (``TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1``, ``TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=1``,
  ``TORCHINDUCTOR_REDIS_HOST/PORT``, read by ``torch/_inductor/remote_cache.py``); its keys are counted after the
  job, so a run where torch never used it says so;
* ``rc``: ``recipecache-run`` on an empty store (default mode);
* ``ns nopool``: ``recipecache-run --no-stall`` with ``RECIPECACHE_COMPILE_POOL=0`` (each rank compiles behind
  only the graphs it leads);
* ``ns pool``: ``recipecache-run --no-stall`` with ``RECIPECACHE_COMPILE_POOL=1`` (idle ranks compile others'
  graphs; where the pool is not built yet it runs as ``ns nopool``).

Printed: one table (cold wall, trained (the launcher's start to the last rank's last step: the wall less the exit,
where no-stall finishes its compiles behind), the job's CPU (every process waited for, g++ included) and the share of
the machine's cores it kept busy (near 100%, the pool has no idle core to compile on), iteration 0 of the slowest
rank, compile seconds per rank and their largest over mean and over smallest, the losses against plain torchrun's),
each side's ratios to plain torchrun and torch's remote cache, torch's own counters per rank, and the issue's targets
with met/MISSED:

* ``ns pool`` cold wall <= 0.7x torch redis and <= 0.65x plain; its iteration 0 <= 0.8x torch redis;
* its compile seconds per rank within 1.3x of each other (2 ranks), or largest <= 1.5x the mean (more ranks);
* ``rc`` losses bitwise equal to plain torchrun's; the no-stall sides' within 2e-3 (eager and compiled steps
  round differently).

Compile seconds per rank: for the recipecache sides each rank's metrics (``graph_compilation.TotalTime``, the
store's compiles in the rank, plus ``no_stall.compile_s``, its compiles behind in a worker: what the report's
"compile seconds: rank r compiled longest" sums, with the no-stall ones added); for torchrun's sides torch's
``torch._dynamo.utils.compilation_time_metrics["compile_fx_inner"]`` (inductor's compile of each forward and
backward graph, cache lookups included: on ``torch redis`` a remote hit still runs g++ on the kernels' source),
which every side also records, beside dynamo's whole ``_compile.compile_inner`` (tracing included).

    python benchmarks/pool_bench.py [--quick] [--nproc 2|4] [--reps N] [--iters N] [--lengths 16,24,32]
                                    [--eval-lengths 20,28,36] [--order aligned|rotated] [--sides plain,rc,...]
                                    [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cold_bench import VOCAB, Run, ratios, run_job, spread

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("plain", "torch redis", "rc", "ns nopool", "ns pool")
#: the issue's targets: the pool side's wall against torch's remote cache and plain torchrun, its iteration 0
#: against torch's remote cache, its compile seconds' spread over the ranks, the no-stall sides' loss difference
WALL_VS_REDIS, WALL_VS_PLAIN, ITER0_VS_REDIS = 0.7, 0.65, 0.8
BALANCE_TWO_RANKS, BALANCE_MANY_RANKS = 1.3, 1.5
LOSS_DIFF_TARGET = 2e-3
#: torch's compile timers each rank records (``compilation_time_metrics``, summed): inductor's and dynamo's
INDUCTOR_TIMER, DYNAMO_TIMER = "compile_fx_inner", "_compile.compile_inner"


# -- the job (runs in every rank under torchrun) ------------------------------------------
def make_batch(seed: int, size: int, length: int) -> tuple[Any, Any]:
    """``size`` arithmetic token sequences mod VOCAB of ``length`` + 1 tokens: inputs and next-token targets."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, VOCAB, (size, 1), generator=gen)
    step = torch.randint(1, 4, (size, 1), generator=gen)
    tokens = (first + step * torch.arange(length + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def rotated(values: list[int], by: int) -> list[int]:
    by %= len(values)
    return values[by:] + values[:by]


def job(args: argparse.Namespace) -> None:
    """Train on every rank, evaluate on rank 0 alone; rank 0 writes every rank's figures to ``--out``."""
    import torch
    import torch.distributed as dist
    from tiny_gpt import TinyGPT  # beside this script, on sys.path under torchrun and recipecache-run
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT / "examples"))
    from train import gather_at_rank0

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = [int(n) for n in args.lengths.split(",")]
    eval_lengths = [int(n) for n in args.eval_lengths.split(",")]
    order = rotated(lengths, rank if args.order == "rotated" else 0)
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, max(lengths + eval_lengths), args.dim, args.heads, args.layers, head_bias=True)
    # no buffers to broadcast: rank 0's forwards alone must start no collective
    compiled = torch.compile(DistributedDataParallel(model, broadcast_buffers=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mine: dict[str, Any] = {"iter_s": [], "steps": [], "losses": [], "start": time.time()}

    def call(compiled: Any, kind: str, it: int, length: int, seed: int, size: int) -> None:
        tokens, targets = make_batch(seed, size, length)
        start = time.perf_counter()
        loss = compiled(tokens, targets)
        if kind == "train":
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        mine["steps"].append([kind, it, length, time.time() - mine["start"], time.perf_counter() - start])
        mine["losses"].append(loss.item())  # exact: json writes a float's repr

    for it in range(args.iters):
        it_start = time.perf_counter()
        for step, length in enumerate(order):
            call(compiled, "train", it, length, it * 1009 + step * 31 + rank, args.batch)
        if rank == 0:
            model.eval()
            with torch.no_grad():
                for step, length in enumerate(rotated(eval_lengths, it)):
                    call(compiled, "eval", it, length, it * 1009 + 500 + step, args.eval_batch)
            model.train()
        mine["iter_s"].append(time.perf_counter() - it_start)
    mine["end"] = time.time()  # trained: what follows is reporting and, under no-stall, the compiles behind finishing
    mine["torch_compile_s"] = {name: sum(times) for name, times in compilation_time_metrics.items()}
    mine["torch_counters"] = {group: dict(counters[group]) for group in ("inductor", "aot_autograd") if group in counters}
    ranks = gather_at_rank0(mine, Path(args.out), rank, world)  # not all_gather_object: see its docstring
    if ranks is not None:
        Path(args.out).write_text(json.dumps({"ranks": ranks}))
    del compiled  # before the group goes, as cold_bench's job does
    dist.destroy_process_group()


def job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pool_bench.py job", description="the benchmark's job (one rank)")
    p.add_argument("--lengths", default="16,24,32")
    p.add_argument("--eval-lengths", default="20,28,36")
    p.add_argument("--order", choices=("aligned", "rotated"), default="aligned")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--out", required=True)
    return p


# -- the driver ---------------------------------------------------------------------------
@dataclass
class Job:
    """One side's job of one repetition: cold_bench's :class:`Run` and what this benchmark adds to it."""

    side: str
    run: Run
    #: torch redis: the keys torch left in the job's redis-server, by cache (``pt2:<cache>::...``)
    redis_keys: dict[str, int] = field(default_factory=dict)

    @property
    def compile_source(self) -> str:
        return "recipecache metrics" if self.run.metrics else f"torch {INDUCTOR_TIMER}"

    @property
    def compile_s(self) -> list[float]:
        """Per rank, its compile seconds (see the module's docstring for the source)."""
        if not self.run.metrics:
            return self.torch_s(INDUCTOR_TIMER)
        from recipecache import metrics_schema as schema

        per_rank = [0.0] * len(self.run.ranks)
        for m in self.run.metrics:
            rank = schema.RANK.read(m)
            per_rank[rank] += float(schema.COMPILE_S.read(m) or 0.0) + float(schema.NO_STALL_COMPILE_S.read(m) or 0.0)
        return per_rank

    def torch_s(self, timer: str) -> list[float]:
        return [float(r.get("torch_compile_s", {}).get(timer, 0.0)) for r in self.run.ranks]

    def torch_count(self, group: str, name: str) -> list[int]:
        return [int(r.get("torch_counters", {}).get(group, {}).get(name, 0)) for r in self.run.ranks]

    @property
    def largest_over_mean(self) -> float:
        seconds = self.compile_s
        mean = sum(seconds) / len(seconds)
        return max(seconds) / mean if mean > 0 else float("nan")

    @property
    def trained_s(self) -> float:
        """From the launcher's start to the last rank's last step: the job's wall less its exit (under no-stall, the
        compiles behind that finish for the next job, within the exit grace)."""
        return max(r["end"] for r in self.run.ranks) - self.run.phases["launcher start"]

    @property
    def cores_busy(self) -> float:
        """The share of the machine's cores the job kept busy: its CPU over its wall times the cores. Near 1, the
        job's wall is its CPU over the cores, and no compile can move onto an idle core: the pool has none to use."""
        return self.run.cpu_s / (self.run.wall_s * (os.cpu_count() or 1))

    @property
    def largest_over_smallest(self) -> float:
        seconds = self.compile_s
        return max(seconds) / min(seconds) if min(seconds) > 0 else float("inf")

    def loss_diff(self, plain: Job) -> float:
        """The largest |loss - plain's loss| at any step of any rank (inf where the steps differ in number)."""
        mine, theirs = self.run.losses, plain.run.losses
        if [len(r) for r in mine] != [len(r) for r in theirs]:
            return float("inf")
        return max((abs(a - b) for m, t in zip(mine, theirs) for a, b in zip(m, t)), default=0.0)

    def to_json(self, plain: Job | None) -> dict[str, Any]:
        return {
            "wall_s": self.run.wall_s, "trained_s": self.trained_s, "cpu_s": self.run.cpu_s,
            "cores_busy": self.cores_busy, "iter0_s": self.run.iter0_s, "iters_s": self.run.iters_s,
            "per_rank_iter_s": [r["iter_s"] for r in self.run.ranks],
            "compile_s": self.compile_s, "compile_source": self.compile_source,
            "largest_over_mean": self.largest_over_mean, "largest_over_smallest": self.largest_over_smallest,
            "torch_inductor_s": self.torch_s(INDUCTOR_TIMER), "torch_dynamo_s": self.torch_s(DYNAMO_TIMER),
            "torch_counters": [r.get("torch_counters", {}) for r in self.run.ranks],
            "recipecache_compiles": self.run.compiles if self.run.metrics else None,
            "no_stall": [m.get("no_stall", {}).get("compiles", 0) for m in self.run.metrics],
            "fallbacks": self.run.fallbacks(),
            "losses": self.run.losses,
            "losses_bitwise_equal_plain": None if plain is None else self.run.losses == plain.run.losses,
            "max_loss_diff_plain": None if plain is None else self.loss_diff(plain),
            "redis_keys": self.redis_keys,
        }


def run_side(work: Path, side: str, rep: int, job_args: list[str], nproc: int) -> Job:
    """One cold job of ``side`` on new nodes: empty rank dirs, an empty store or a fresh redis-server."""
    base = work / f"rep{rep}" / side.replace(" ", "-")
    base.mkdir(parents=True)
    common = {"dirs": base / "dirs", "nproc": nproc, "script": Path(__file__)}
    if side == "plain":
        return Job(side, run_job(work, side, f"n{nproc}", str(rep), job_args, store=None, **common))
    if side == "torch redis":
        from harness.redis_server import RedisServer

        with RedisServer(base / "redis") as server:
            env = {"TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
                   "TORCHINDUCTOR_REDIS_HOST": "127.0.0.1", "TORCHINDUCTOR_REDIS_PORT": str(server.port)}
            run = run_job(work, side, f"n{nproc}", str(rep), job_args, store=None, extra_env=env, **common)
            return Job(side, run, redis_keys(server.port))
    launcher_args = ["--no-stall"] if side.startswith("ns ") else []
    env = {"RECIPECACHE_COMPILE_POOL": "1" if side == "ns pool" else "0"} if launcher_args else {}
    return Job(side, run_job(work, side, f"n{nproc}", str(rep), job_args, store=base / "store",
                             launcher_args=launcher_args, extra_env=env, **common))


def redis_keys(port: int) -> dict[str, int]:
    """The keys in the redis-server on ``port``, counted by torch's cache name (``pt2:<name>::<key>:c1``)."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    found: Counter[str] = Counter()
    for key in client.scan_iter(count=1000):
        text = key.decode(errors="replace")
        found[text.split("::", 1)[0] if "::" in text else text] += 1
    client.close()
    return dict(found)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def summarise(jobs: list[Job], nproc: int) -> dict[str, Any]:
    """Print the table, the ratios, torch's counters and the targets; returns every figure."""
    by = {side: [j for j in jobs if j.side == side] for side in SIDES}
    by = {side: js for side, js in by.items() if js}
    reps = max(len(js) for js in by.values())
    plain = by.get("plain", [])
    redis_side = by.get("torch redis", [])

    print(f"\n== {nproc} ranks, {reps} repetition(s): medians (min-max) over the repetitions")
    print(f"{'side':<12} {'cold wall s':>18} {'trained s':>14} {'job CPU s':>14} {'cores busy':>10} "
          f"{'iter 0 s (slowest)':>20}  {'compile s per rank':<26} {'largest/mean':>12} {'largest/smallest':>16}  losses vs plain")
    figures: dict[str, Any] = {"nproc": nproc, "reps": reps, "sides": {}}
    for side, js in by.items():
        per_rank = [median([j.compile_s[k] for j in js]) for k in range(nproc)]
        if side == "plain":
            loss_text = "(reference)"
        elif not plain:
            loss_text = "(no plain side)"
        else:
            equal = all(j.run.losses == p.run.losses for j, p in zip(js, plain))
            diff = max(j.loss_diff(p) for j, p in zip(js, plain))
            loss_text = "bitwise equal" if equal else f"max |diff| {diff:.2e}"
        print(f"{side:<12} {spread([j.run.wall_s for j in js], '{:.1f}'):>18} "
              f"{spread([j.trained_s for j in js], '{:.1f}'):>14} {spread([j.run.cpu_s for j in js], '{:.1f}'):>14} "
              f"{median([j.cores_busy for j in js]):>10.0%} "
              f"{spread([j.run.iter0_s for j in js]):>20}  {' '.join(f'{s:5.1f}' for s in per_rank):<26} "
              f"{median([j.largest_over_mean for j in js]):>12.2f} {median([j.largest_over_smallest for j in js]):>16.2f}"
              f"  {loss_text}")
        figures["sides"][side] = {"runs": [j.to_json(p) for j, p in zip(js, plain or [None] * len(js))],
                                  "compile_s_median_per_rank": per_rank}
    print("compile s per rank: recipecache sides from each rank's metrics (graph_compilation.TotalTime + "
          f"no_stall.compile_s); torchrun's sides torch's {INDUCTOR_TIMER} (compilation_time_metrics)")

    print("trained: from the launcher's start to the last rank's last step (the wall less the exit: under no-stall, "
          "the compiles behind finishing for the next job); job CPU: every process of the job, g++ included; cores "
          f"busy: the job's CPU over its wall times the machine's {os.cpu_count()} cores (near 100%: no idle core for "
          "the pool to compile on, and the wall is the CPU over the cores)")

    print("\nratios (median over the repetitions): cold wall, trained and iteration 0 over plain torchrun's and over "
          "torch redis'")
    for side in by:
        cells = []
        for name, other in (("plain", plain), ("torch redis", redis_side)):
            if other and side != name:
                wall = ratios(by[side], other, lambda j: j.run.wall_s)
                trained = ratios(by[side], other, lambda j: j.trained_s)
                iter0 = ratios(by[side], other, lambda j: j.run.iter0_s)
                figures["sides"][side][f"wall_over_{name.replace(' ', '_')}"] = wall
                figures["sides"][side][f"trained_over_{name.replace(' ', '_')}"] = trained
                figures["sides"][side][f"iter0_over_{name.replace(' ', '_')}"] = iter0
                cells.append(f"/ {name}: wall {spread(wall)}, trained {spread(trained)}, iter 0 {spread(iter0)}")
        if cells:
            print(f"  {side:<12} {'; '.join(cells)}")

    print(f"\ntorch's own figures per rank (last repetition): {INDUCTOR_TIMER} s | {DYNAMO_TIMER} s | "
          "fxgraph cache miss/hit | autograd cache miss/hit")
    for side, js in by.items():
        j = js[-1]
        fx = zip(j.torch_count("inductor", "fxgraph_cache_miss"), j.torch_count("inductor", "fxgraph_cache_hit"))
        aot = zip(j.torch_count("aot_autograd", "autograd_cache_miss"), j.torch_count("aot_autograd", "autograd_cache_hit"))
        print(f"  {side:<12} {' '.join(f'{s:5.1f}' for s in j.torch_s(INDUCTOR_TIMER))} | "
              f"{' '.join(f'{s:5.1f}' for s in j.torch_s(DYNAMO_TIMER))} | "
              f"{' '.join(f'{m}/{h}' for m, h in fx)} | {' '.join(f'{m}/{h}' for m, h in aot)}")
    for j in redis_side:
        used = sum(j.redis_keys.values())
        print(f"  torch redis rep {j.run.rep}: {used} keys in redis after the job {j.redis_keys}"
              f"{'' if used else '  -- torch did NOT use its remote cache'}")
    for side in ("ns nopool", "ns pool"):
        for j in by.get(side, []):
            print(f"  {side} rep {j.run.rep}: compiles behind per rank "
                  f"{[m.get('no_stall', {}).get('compiles', 0) for m in j.run.metrics]}, "
                  f"fallbacks {j.run.fallbacks() or 'none'}")

    figures["targets"] = targets(by, nproc)
    return figures


def targets(by: dict[str, list[Job]], nproc: int) -> dict[str, Any]:
    """The issue's targets, met or MISSED; a target whose sides did not run is left out."""
    print("\ntargets (issue 47)")
    out: dict[str, Any] = {}

    def verdict(name: str, value: float, limit: float) -> None:
        out[name] = {"value": value, "limit": limit, "met": value <= limit}
        print(f"  {name:<58} {value:8.3g}  target <= {limit:<6g} {met(value <= limit)}")

    pool = by.get("ns pool", [])
    for other, limit in (("torch redis", WALL_VS_REDIS), ("plain", WALL_VS_PLAIN)):
        if pool and by.get(other):
            verdict(f"ns pool cold wall / {other}", median(ratios(pool, by[other], lambda j: j.run.wall_s)), limit)
    if pool and by.get("torch redis"):
        verdict("ns pool cold iteration 0 / torch redis",
                median(ratios(pool, by["torch redis"], lambda j: j.run.iter0_s)), ITER0_VS_REDIS)
    if pool:
        if nproc == 2:
            verdict("ns pool compile seconds, largest / smallest rank", median([j.largest_over_smallest for j in pool]),
                    BALANCE_TWO_RANKS)
        else:
            verdict("ns pool compile seconds, largest rank / mean", median([j.largest_over_mean for j in pool]),
                    BALANCE_MANY_RANKS)
    plain = by.get("plain", [])
    if plain and by.get("rc"):
        equal = all(a.run.losses == b.run.losses for a, b in zip(by["rc"], plain))
        out["rc losses bitwise equal to plain"] = {"met": equal}
        print(f"  {'rc losses bitwise equal to plain torchrun':<58} {str(equal):>8}  target True   {met(equal)}")
    for side in ("ns nopool", "ns pool"):
        if plain and by.get(side):
            verdict(f"{side} max |loss - plain loss|", max(a.loss_diff(b) for a, b in zip(by[side], plain)),
                    LOSS_DIFF_TARGET)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="the smallest job: 2 lengths, 1 layer, 2 iterations, 2 ranks, 1 repetition")
    p.add_argument("--nproc", type=int, choices=(2, 4), help="ranks (default 2)")
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions (default 1)")
    p.add_argument("--iters", type=int, help="iterations per job (default 3; 2 with --quick)")
    p.add_argument("--lengths", help="training sequence lengths (default 16,24,32; 16,24 with --quick)")
    p.add_argument("--eval-lengths", help="rank 0's evaluation lengths (default 20,28,36; 20,28 with --quick)")
    p.add_argument("--layers", type=int, help="transformer blocks (default 2; 1 with --quick)")
    p.add_argument("--order", choices=("aligned", "rotated"), default="aligned",
                   help="aligned: every rank trains the same length at each step; rotated: rank r's lengths rotated by r")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of: {', '.join(SIDES)} (default all)")
    p.add_argument("--workdir", type=Path, help="keep every job's dirs, stores and outputs here (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write every figure as JSON")
    args = p.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        p.error(f"--sides takes a comma-separated list of: {', '.join(SIDES)}")
    if args.quick and args.nproc not in (None, 2):
        p.error("--quick runs 2 ranks")
    nproc = args.nproc or 2
    sys.path.insert(0, str(ROOT))  # recipecache's metrics schema and event reader, for cold_bench's run_job
    job_args = ["--lengths", args.lengths or ("16,24" if args.quick else "16,24,32"),
                "--eval-lengths", args.eval_lengths or ("20,28" if args.quick else "20,28,36"),
                "--iters", str(args.iters or (2 if args.quick else 3)),
                "--layers", str(args.layers or (1 if args.quick else 2)), "--order", args.order]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="pool-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"pool_bench: {nproc} ranks (gloo, CPU), each in its own empty TORCHINDUCTOR_CACHE_DIR and TMPDIR; rank 0 "
          f"alone evaluates; job {' '.join(job_args)}; sides {', '.join(sides)}; {args.reps} repetition(s); "
          f"workdir {work}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    jobs: list[Job] = []
    failed: list[str] = []
    for rep in range(args.reps):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            try:
                jobs.append(run_side(work, side, rep, job_args, nproc))
            except SystemExit as exc:  # cold_bench's run_job: the job failed; the other sides still run
                failed.append(f"{side} rep {rep}")
                print(f"  {side} rep {rep} FAILED: {str(exc)[-1500:]}", flush=True)
    if not jobs:
        sys.exit("pool_bench: every job failed")
    figures = summarise(jobs, nproc)
    figures["failed"] = failed
    if failed:
        print(f"\nFAILED jobs, left out of the figures: {', '.join(failed)} (each one's whole output: a .log in the workdir)")
    figures["job_args"] = job_args
    figures["load_average_end"] = list(os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        job(job_parser().parse_args(sys.argv[2:]))
    else:
        main()
