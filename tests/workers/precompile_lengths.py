"""One rank of a 2-rank DDP job whose inputs vary over a few sequence lengths (torch.compile's defaults).

usage (under recipecache-run or torchrun): precompile_lengths.py OUT_DIR [--lengths 8,12] [--iters 2] [--shift N] [--eval]

``examples/train.py``'s TinyLM, wrapped in DDP and compiled with ``torch.compile(ddp)``: no
``dynamic=`` argument, so torch's automatic dynamic marks the length dynamic at its second
value. Rank r meets the lengths rotated by r + ``--shift``, every iteration, training only, or
with ``--eval`` each training step followed by an eval step (``model.eval()``, no grad) of the
same length. Before each step the eager module computes the same loss (no grad) as the reference.

Each rank writes ``OUT_DIR/rank<r>.json``: per step the compiled loss and the eager one, and
dynamo's frame counter (frames it traced: 0 when every call was served precompiled).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train import TinyLM, make_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--lengths", default="8,12")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--shift", type=int, default=0, help="rotate every rank's lengths by this much more")
    p.add_argument("--eval", action="store_true", help="an eval step (no grad) after each training step")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lengths = [int(n) for n in args.lengths.split(",")]
    first = (rank + args.shift) % len(lengths)
    order = lengths[first:] + lengths[:first]
    torch.manual_seed(0)
    model = TinyLM(16)
    ddp = DistributedDataParallel(model)
    compiled = torch.compile(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, eager = [], []
    for it in range(args.iters):
        for step, length in enumerate(order):
            tokens, targets = make_batch(it * len(order) + step, rank, 4, length, 0)
            with torch.no_grad():
                eager.append(model(tokens, targets).item())
            loss = compiled(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if args.eval:
                model.eval()
                with torch.no_grad():
                    eager.append(model(tokens, targets).item())
                    losses.append(compiled(tokens, targets).item())
                model.train()
    from torch._dynamo.utils import counters

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"losses": losses, "eager": eager, "frames": int(counters["frames"]["total"])}))
    dist.barrier()
    del compiled, ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
