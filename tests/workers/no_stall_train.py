"""The example's DDP job (``examples/train.py``: its model, batches and bucket schedule), run for a
number of steps (``--steps``) or, with ``--until-switched SECONDS``, until every rank runs every graph
it met compiled (no-stall's switch, agreed through an all-reduce each step). SECONDS bounds the job
against a hang, not the compile's pace: a step count would be a guess at how fast the worker compiles,
and a busy machine can run hundreds of eager steps before it is done.

Rank 0 writes ``--out``: per step every rank's loss, and the steps the job ran. Steps pause
``--pause`` seconds, as a data loader would, so a compile behind them gets the cores too. With
``--kill-worker`` rank 0 kills its no-stall worker after its first step, mid-compile (a worker
that dies: another rank must take the graph over). With ``--rank0-eval LENGTHS`` rank 0 alone evaluates after each step
(graphs no other rank meets: the compile pool's case); with ``--eval-once-others-switched`` too, it starts only once
every other rank runs all its own graphs compiled, so that their workers are idle when its graphs queue (whatever the
compiles take, not a race between workers). With ``--set-globals`` the script first sets the
process-global torch settings training scripts set before they compile (:func:`set_globals`), which
torch's graph keys read: no-stall's worker, which never runs the script, must compile under them too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train import TinyLM, bucket_length, gather_at_rank0, make_batch  # noqa: E402

from no_stall_kill import kill_worker  # noqa: E402 - this directory is the script's


def all_switched() -> bool:
    """Whether every graph this process ran without inductor now runs compiled (True without recipecache); one
    whose compile failed behind too, since it switches once some process publishes it."""
    try:
        from recipecache.torch_integration import metrics
    except ImportError:
        return True
    graphs = metrics().get("no_stall", {}).get("graphs", {})
    # a graph this process compiled for another one (the compile pool) and never ran has nothing to switch
    return all(g["switched_at"] is not None for g in graphs.values() if g["eager_calls"])


def set_globals() -> None:
    """Precision, determinism and config settings made at run time, as a training script makes them."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch._inductor.config.fallback_random = True
    torch.compiler.config.cache_key_tag = "no-stall-test"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--until-switched", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--buckets", default="16,32")
    p.add_argument("--pause", type=float, default=0.2)
    p.add_argument("--kill-worker", action="store_true", help="rank 0 kills its worker after its first step")
    p.add_argument("--set-globals", action="store_true", help="set global torch settings first (set_globals)")
    p.add_argument("--rank0-eval", default="", metavar="LENGTHS",
                   help="after each step rank 0 alone evaluates at these lengths: graphs only it meets")
    p.add_argument("--eval-once-others-switched", action="store_true",
                   help="rank 0 evaluates only from the step at which every other rank runs all its graphs compiled")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.set_globals:
        set_globals()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    buckets = [int(b) for b in args.buckets.split(",")]
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(32))
    compiled = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: list[float] = []
    step_s: list[float] = []
    give_up = time.monotonic() + args.until_switched
    step = 0
    evaluating = bool(args.rank0_eval) and not args.eval_once_others_switched
    while step < args.steps or args.until_switched:
        tokens, targets = make_batch(step, rank, 4, bucket_length(step, rank, buckets), 0)
        start = time.perf_counter()
        loss = compiled(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        if args.rank0_eval and not evaluating:
            others_switched = torch.tensor([1 if rank == 0 or all_switched() else 0])
            dist.all_reduce(others_switched, op=dist.ReduceOp.MIN)
            evaluating = bool(others_switched.item())
        if rank == 0 and evaluating:
            with torch.no_grad():
                for length in (int(n) for n in args.rank0_eval.split(",")):
                    compiled(*make_batch(step, rank, 4, length, 0))
        if args.kill_worker and rank == 0 and step == 0:
            kill_worker(time.monotonic() + 120)
        time.sleep(args.pause)
        step += 1
        if args.until_switched and step >= 2 * len(buckets):
            # a job that evaluates is done once rank 0 has evaluated and runs those graphs compiled too
            finished = all_switched() and (evaluating or not args.rank0_eval)
            done = torch.tensor([1 if finished or time.monotonic() > give_up else 0])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                break
    del compiled, model, opt
    gathered = gather_at_rank0({"losses": losses, "step_s": step_s}, args.out, rank, world)
    if gathered is not None:
        args.out.write_text(json.dumps({"steps": len(losses), "losses": [list(v) for v in zip(*(g["losses"] for g in gathered))],
                                        "step_s": [list(v) for v in zip(*(g["step_s"] for g in gathered))]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
