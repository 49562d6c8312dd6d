"""Two tensor-parallel ranks whose cold compiles must overlap: rank 0 leads the forward, rank 1 the backward.

usage: overlap_ranks.py OUT_DIR [--steps N] [--sync [--forge zeros|short]]

2 ranks, gloo, a tp=2 mesh, a tiny MLP parallelised colwise/rowwise (its compiled graphs carry
all_reduce), ``torch.compile``, SGD. Rank 0 writes both ranks' losses (hex floats: compared bit
for bit) to ``OUT_DIR/losses.json``.

``--sync`` (under recipecache-run) orders the cold compiles with explicit events, no timing:
rank 1 starts only once rank 0 has lowered the forward (so rank 0 holds the forward's lease and
rank 1 finds it busy), and rank 0's forward compile then goes on only once rank 1 has lowered
the backward: with overlap rank 1 leads the backward meanwhile; without it rank 1 waits for
the forward, so rank 0 waits in vain until :data:`GIVE_UP_S` and writes ``overlapped`` false.

``--forge`` (with ``--sync``): once rank 0 has published the forward's output strides, it replaces
them in the (unsigned) store with a plausible wrong record, as anybody who may write the store
could: every stride ``0`` (``zeros``), or one output short (``short``). Rank 1 must refuse it (a
counted fallback: it waits for the forward in its compile), so rank 0 does not wait for rank 1's
backward.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tp_ranks import DIM, MLP  # the same tiny MLP the collectives tests parallelise

#: how long a rank waits for the other's event before it goes on without it (a bound against a hang, not a timing)
GIVE_UP_S = 240.0


def _wait_for(path: Path) -> bool:
    deadline = time.monotonic() + GIVE_UP_S
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _forge_strides(how: str) -> None:
    """Replace the output strides record this rank published with a forged one of the same form."""
    from recipecache.torch_integration import _session
    from recipecache.store_admin import StoreAdmin
    from recipecache.tools import admin

    store = _session.store
    assert store is not None
    (entry,) = [r for r in admin.inspect_entries(StoreAdmin(store))
                if r.header and r.header.meta.get("kind") == "output_strides" and not r.node]  # the entry, not a copy
    assert entry.header is not None
    name = entry.header.key
    record = json.loads(bytes(store.get(name, trace=False) or b"{}"))
    strides = record["strides"]
    forged = [None if s is None else ["0"] * len(s) for s in strides] if how == "zeros" else strides[:-1]
    store.put(name, json.dumps({**record, "strides": forged}).encode(), trace=False, meta={"kind": "output_strides"})


def _order_compiles(out: Path, rank: int, forge: str | None) -> None:
    """Wrap the point where inductor has lowered a graph (after recipecache's own hook there)."""
    from torch._inductor import compile_fx

    lowered = compile_fx._check_triton_bf16_support

    def ordered(graph: object) -> None:
        lowered(graph)
        context = torch._guards.TracingContext.try_get()
        forward = context is not None and context.output_strides is not None
        if rank == 0 and forward:
            if forge:
                _forge_strides(forge)
                (out / "leader-lowered").touch()
                return  # rank 1 refuses the record and waits for this forward: nothing to wait for here
            (out / "leader-lowered").touch()
            overlapped = _wait_for(out / "backward-lowered")
            (out / "overlapped.json").write_text(json.dumps(overlapped))
        elif rank == 1 and not forward:
            (out / "backward-lowered").touch()

    compile_fx._check_triton_bf16_support = ordered


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--forge", choices=("zeros", "short"))
    args = parser.parse_args()
    out = Path(args.out)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.sync:
        _order_compiles(out, rank, args.forge)
        if rank == 1 and not _wait_for(out / "leader-lowered"):
            raise SystemExit("rank 0 never lowered the forward")
    losses: list[str] = []
    for step in range(args.steps):
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(step))
        loss = compiled(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()).hex())
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
