"""A tiny 2-D mesh job (dp x tp) whose compiled graphs carry collectives: tensor, sequence or expert parallel.

usage: tp_ranks.py OUT_JSON [--mode {all,tp,fsdp_tp,mesh,tier}] [--steps N]

Every rank of a dp x tp mesh (4 ranks: dp=2 x tp=2, gloo, CPU) trains tiny MLPs whose
compiled graphs carry their collectives, and rank 0 writes every rank's losses (hex
floats: compared bit for bit), the tensor-parallel MLP's own losses and group sums to OUT_JSON. ``all``
(the default):

* tensor parallel: ``ColwiseParallel`` / ``RowwiseParallel`` over tp (all_reduce);
* sequence parallel: the same with sequence-sharded input and output (all_gather / reduce_scatter);
* expert parallel: the sequence-parallel output's rows exchanged within the tp group
  (``all_to_all_single``, with its backward);
* group sums: one compiled graph all-reduces ``rank + 1`` over the tp group (x2) and over
  the dp group (x3). Each rank's two sums say which groups it really ran its collectives
  on: a rank bound to another group's collective, or to its dp group where its tp group
  belongs, gets other sums (or fails).

``tp`` trains the tensor-parallel MLP alone, ``fsdp_tp`` with ``fully_shard`` over dp on top. ``mesh``
compiles only :func:`meshsum` (no training, no losses): an all-reduce over the tp mesh passed as an argument,
the same call on every rank (one key for the precompiled tier), whose compiled code names the tp group.
``tier`` runs :func:`meshsum`, then trains the tensor-parallel MLP alone: a module as TorchTitan builds it
(``parallelize_module``: DTensor parameters, the plan's hooks), whose losses are those of ``all``'s
tensor-parallel MLP (its parameters get the same gradients there) and differ between the tp groups (each dp
rank draws its own inputs).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

DIM = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class SequenceMLP(MLP):
    """The sequence-parallel MLP: its own ``forward`` code, so dynamo does not take its shorter input for a
    dynamic dimension of the tensor-parallel one (automatic dynamic shapes go by code object)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def groupsum(x: torch.Tensor, tp: str, dp: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduces of ``x`` over the tp and the dp group: each rank's sums tell which groups it really used."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x * 2, "sum", tp), funcol.all_reduce(x * 3, "sum", dp)


def meshsum(x: torch.Tensor, mesh: object) -> torch.Tensor:
    """An all-reduce of ``x`` over ``mesh``'s group: each rank's sum tells which group it really used."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x * 2, "sum", mesh)


def exchange(x: torch.Tensor, group: str) -> torch.Tensor:
    """Expert parallel's token exchange: half of each rank's rows go to the other rank of its group."""
    from torch.distributed import _functional_collectives as funcol

    half = [x.shape[0] // 2] * 2
    return funcol.all_to_all_single_autograd(x, half, half, group) * 1.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=("all", "tp", "fsdp_tp", "mesh", "tier"), default="all")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]
    tp_group, dp_group = tp_mesh.get_group().group_name, mesh["dp"].get_group().group_name
    mesh_sums: list[float] = []
    if args.mode in ("mesh", "tier"):
        mesh_sums = [float(torch.compile(meshsum)(torch.full((4,), float(rank + 1)), tp_mesh)[0])]
    if args.mode == "mesh":
        _write(args.out, rank, world, [], [], mesh_sums)
        return
    torch.manual_seed(0)
    tp_model, sp_model = MLP(), SequenceMLP()
    parallelize_module(tp_model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if args.mode == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(tp_model, mesh=mesh["dp"])
    parallelize_module(sp_model, tp_mesh, {"up": ColwiseParallel(input_layouts=Shard(0)),
                                           "down": RowwiseParallel(output_layouts=Shard(0))})
    models = [tp_model] if args.mode != "all" else [tp_model, sp_model]
    compiled = [torch.compile(m) for m in models]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    exchange_c = torch.compile(exchange)
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    losses: list[str] = []
    tp_losses: list[str] = []
    for step in range(args.steps):
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1000 * step + dp_rank))
        loss = compiled[0](x).pow(2).mean()
        tp_losses.append(float(loss.detach()).hex())
        if args.mode == "all":
            routed = exchange_c(compiled[1](x.chunk(2)[tp_rank]), tp_group)
            loss = loss + routed.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()).hex())
    sums = mesh_sums
    if args.mode == "all":
        tp_sum, dp_sum = torch.compile(groupsum)(torch.full((4,), float(rank + 1)), tp_group, dp_group)
        sums = [float(tp_sum[0]), float(dp_sum[0])]
    _write(args.out, rank, world, losses, tp_losses, sums)


def _write(out: str, rank: int, world: int, losses: list[str], tp_losses: list[str], sums: list[float]) -> None:
    """Rank 0 writes every rank's losses, tensor-parallel MLP losses and sums to ``out``; the process group ends."""
    gathered: list[dict[str, list] | None] = [None] * world
    dist.all_gather_object(gathered, {"losses": losses, "tp_losses": tp_losses, "sums": sums})
    if rank == 0:
        Path(out).write_text(json.dumps({field: [g[field] for g in gathered]
                                         for field in ("losses", "tp_losses", "sums")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
