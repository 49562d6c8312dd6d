"""One rank of ``collectives_bench.py``: a small transformer block trained with tensor + sequence parallel.

usage: tp_block_worker.py OUT_JSON [--mode {tp,fsdp_tp}] [--steps N] [--own-dirs DIR]

A pre-norm block (RMSNorm, causal multi-head attention, RMSNorm, SwiGLU MLP, residuals) on a
dp x tp mesh (4 ranks: dp=2 x tp=2, gloo, CPU), parallelised as TorchTitan parallelises its
Llama blocks: ``wq``/``wk``/``wv`` and ``w1``/``w3`` ``ColwiseParallel``, ``wo`` and ``w2``
``RowwiseParallel`` with sequence-sharded output, the norms ``SequenceParallel`` and each
sub-module's input gathered over the sequence (``PrepareModuleInput``): the compiled graphs
carry all_gather and reduce_scatter over the tp group. ``fsdp_tp`` shards the block over dp
with FSDP2 (``fully_shard``) on top. ``torch.compile(block)`` with torch's defaults.

Rank 0 writes every rank's losses (hex floats, compared bit for bit) and each rank's
timeline (``perf_counter`` seconds since the process started torch: ``imported``,
``mesh``, each step's end) to OUT_JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

START = time.time()
if "--own-dirs" in sys.argv:  # before torch reads them: this rank's own TMPDIR and inductor dir, as on its own node
    OWN = Path(sys.argv[sys.argv.index("--own-dirs") + 1]) / f"rank{os.environ['RANK']}"
    (OWN / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ |= {"TMPDIR": str(OWN / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(OWN / "inductor")}

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIM, HEADS, HIDDEN, SEQ, BATCH = 64, 4, 128, 16, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head_dim = DIM // HEADS
        # -1: the heads of this rank (colwise sharded projections hold HEADS / tp of them)
        q, k, v = (w(x).view(batch, seq, -1, head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def parallel_block(mesh: "DeviceMesh", mode: str) -> Block:
    """The block (seeded), parallelised over ``mesh``'s ``tp`` dimension as TorchTitan does, and for ``fsdp_tp``
    sharded over its ``dp`` dimension with FSDP2 (the corpus's ``fsdp_tp`` program trains this one too)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(0)
    block = Block()
    gathered_input = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(block, mesh["tp"], {
        "attention_norm": SequenceParallel(),
        "attention": gathered_input,
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gathered_input,
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    if mode == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(block, mesh=mesh["dp"])
    return block


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=("tp", "fsdp_tp"), default="tp")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--own-dirs", help="each rank in its own empty dirs under this one (read before torch)")
    args = parser.parse_args()
    marks = {"imported": time.time() - START}

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    marks["mesh"] = time.time() - START
    block = parallel_block(mesh, args.mode)
    compiled = torch.compile(block)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    losses: list[str] = []
    for step in range(args.steps):
        x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1000 * step + dp_rank))
        loss = compiled(x.chunk(2, dim=1)[tp_rank]).pow(2).mean()  # this rank's part of the sequence
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()).hex())
        marks[f"step{step}"] = time.time() - START
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, {"losses": losses, "marks": marks, "start": START})
    if rank == 0:
        Path(args.out).write_text(json.dumps({"losses": [g["losses"] for g in gathered],
                                              "marks": [g["marks"] for g in gathered],
                                              "starts": [g["start"] for g in gathered]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
