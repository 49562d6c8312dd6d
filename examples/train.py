"""A tiny DDP job whose ranks meet compile shapes at different steps: recipecache's reference workload.

Run it plain (``torchrun --nproc-per-node 2 examples/train.py``) or through the cache
(``recipecache-run --nproc 2 examples/train.py``); both give the same losses.

Why it looks like this:

* Batches are bucketed to a few sequence lengths and compiled with ``dynamic=False``,
  so every bucket length is its own graph, the way padded-bucket training compiles in
  practice; the compile, not the math, is what this job costs.
* Rank ``r`` walks the bucket schedule ``r`` steps ahead of rank 0, so one rank meets a
  length the other has already compiled: the case the shared store exists for. DDP's
  gradient all-reduce makes every rank wait for the slowest one each step, which is
  exactly the stall recipecache removes.
* Everything is seeded per (step, rank) and runs on one thread per rank, so a run is
  bitwise reproducible and losses can be compared with and without the cache.

``--losses FILE`` (written by rank 0) records, per step, every rank's loss, every rank's
step seconds and sequence length, and every rank's inductor cache counters, so tests
and benchmarks can compare runs without parsing logs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VOCAB = 64


class TinyLM(nn.Module):
    """Embedding, a one-hidden-layer MLP and an output head; returns the next-token loss.

    As small as a model with a real forward and backward can be: the compile, not the
    math, is what this job is about, and every kernel costs a g++ run on CPU.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.hidden = nn.Linear(dim, 2 * dim)
        self.head = nn.Linear(2 * dim, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(F.gelu(self.hidden(self.embed(tokens))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bucket_length(step: int, rank: int, buckets: list[int]) -> int:
    """The sequence length rank ``rank`` trains on at ``step``: rank r is r steps ahead of rank 0."""
    return buckets[(step + rank) % len(buckets)]


def make_batch(step: int, rank: int, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod VOCAB (learnable: the next token is the last plus a per-row stride)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    seq = (start + stride * torch.arange(length + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def step_marker() -> Callable[[int], None] | None:
    """recipecache's ``mark_step`` when the integration provides one (it writes the trace's ``step`` events)."""
    try:
        integration = importlib.import_module("recipecache.torch_integration")
    except ImportError:
        return None
    return getattr(integration, "mark_step", None)


def declare_shapes(compiled: Callable[..., torch.Tensor], model: nn.Module,
                   inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Declare the bucket shapes to recipecache; it compiles them up front under ``recipecache-run --prewarm``."""
    try:
        import recipecache
    except ImportError:
        return False
    return recipecache.declare_shapes(compiled, inputs, module=model) is not None


def compile_counts() -> dict[str, float]:
    """Graph compiles, waits and their seconds in this process so far (zeros without recipecache)."""
    try:
        from recipecache.torch_integration import metrics
    except ImportError:
        return {"compiles": 0, "compile_s": 0.0, "waits": 0, "wait_s": 0.0}
    m = metrics()
    graphs = m.get("graph_compilation", {})
    return {"compiles": graphs.get("TotalNumber", 0), "compile_s": graphs.get("TotalTime", 0.0),
            "waits": m.get("waits", 0), "wait_s": m.get("wait_s", 0.0)}


def cache_counters() -> dict[str, int]:
    """Inductor's own cache counters of this process (FX graph and AOTAutograd hits and misses)."""
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in counters["inductor"].items() if "cache" in k}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="training steps (default 4: each rank meets each length twice)")
    p.add_argument("--buckets", default="16,32",
                   help="comma-separated sequence lengths (default 16,32; each one more graph, tens of seconds cold)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=32, help="model width (<= 64 keeps compiles cheap)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--losses", type=Path, help="write per-step losses, step seconds and lengths as JSON (rank 0)")
    return p.parse_args()


def train(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Run the steps; returns this rank's losses, step seconds, lengths and compile counts.

    The DDP model lives only in here, so it is freed while the process group is still
    registered: a Reducer that drops the group's last reference destroys it while holding
    the GIL and joins gloo's run loop, which may be waiting for the GIL (a hang at exit).
    """
    buckets = [int(b) for b in args.buckets.split(",")]
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(TinyLM(args.dim))
    compiled = torch.compile(model, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    mark_step = step_marker()
    prewarmed = declare_shapes(compiled, model, [make_batch(0, rank, args.batch, n, args.seed) for n in buckets])
    before_training = compile_counts()
    out: dict[str, Any] = {"losses": [], "step_s": [], "lengths": []}
    for step in range(args.steps):
        length = bucket_length(step, rank, buckets)
        tokens, targets = make_batch(step, rank, args.batch, length, args.seed)
        start = time.perf_counter()
        loss = compiled(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        if mark_step is not None:
            mark_step(step)
        out["losses"].append(loss.item())
        out["step_s"].append(seconds)
        out["lengths"].append(length)
        if rank == 0:
            print(f"step {step} length {length} loss {loss.item():.6f} ({seconds:.2f} s)", flush=True)
    after = compile_counts()
    out["prewarmed"] = prewarmed
    out["in_training"] = {k: after[k] - before_training[k] for k in after}
    return out


def gather_at_rank0(mine: dict[str, Any], path: Path, rank: int, world: int) -> list[dict[str, Any]] | None:
    """Every rank's ``mine`` on rank 0 (None elsewhere), through files beside ``path`` and a barrier.

    Not ``dist.all_gather_object``: torch 2.13's gloo frees a finished collective's work on
    its worker thread, and all_gather_object's work holds tensors Python made, so freeing
    it needs the GIL. When that collective is the job's last, the worker can be freeing it
    while the main thread already finalizes the interpreter; it cannot take the GIL and the
    process aborts ("terminate called without an active exception", pytorch#179291). Seen
    under plain torchrun and recipecache-run alike, a few times in some 150 jobs on
    2 loaded cores. A barrier's work holds no tensors.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.rank{rank}")
    part.write_text(json.dumps(mine))
    dist.barrier()
    if rank != 0:
        return None
    parts = [path.with_name(f"{path.name}.rank{r}") for r in range(world)]
    gathered = [json.loads(p.read_text()) for p in parts]
    for p in parts:
        p.unlink()
    return gathered


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: dict[str, Any] = {**train(args, rank), "inductor_counters": cache_counters()}
    per_rank = gather_at_rank0(mine, args.losses, rank, world) if args.losses is not None else None
    if per_rank is not None and args.losses is not None:
        args.losses.write_text(json.dumps({
            "world_size": world,
            "threads": torch.get_num_threads(),
            # [step][rank]
            **{name: [list(v) for v in zip(*(r[name] for r in per_rank))] for name in ("losses", "step_s", "lengths")},
            "inductor_counters": [r["inductor_counters"] for r in per_rank],
            # whether the bucket shapes were prewarmed, and what each rank compiled or waited for after that
            "prewarmed": all(r["prewarmed"] for r in per_rank),
            "in_training": [r["in_training"] for r in per_rank],
        }, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
