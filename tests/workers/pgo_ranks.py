"""Two ranks learn different automatic-dynamic decisions and publish them at the same moment.

usage (under recipecache-run, 2 ranks): pgo_ranks.py OUT_DIR ROUNDS

torch keeps its automatic-dynamic (PGO) decisions per process and writes them after each
frame compile; recipecache shares one state between all ranks, merged on write. Two
ranks that write at once must not lose each other's decisions.

Each round, every rank starts as a fresh process would (``torch._dynamo.reset()``, then
reads the shared state from the store), learns one decision of its own (a function of
its own called with two sizes: the second compile makes the dimension dynamic), and
then both ranks write their state at the same moment (released by one barrier). A rank's
state holds only what it read plus its own new decision, so a write that overwrote the
other rank's concurrent one would lose that decision for good.

Then, again as fresh processes, both ranks call every function once with a new size and
record whether its first compile was dynamic (the shared decision) or static. Local PGO
files are off, so decisions travel only through the store. The backend records the
decision and runs the graph eagerly: PGO is dynamo's, no inductor compile is needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.distributed as dist
from torch._dynamo import pgo

# one function (one code object, one PGO entry) per rank per round; each lambda its own line
FUNCS = [
    lambda x: x * 2 + 0,
    lambda x: x * 2 + 1,
    lambda x: x * 2 + 2,
    lambda x: x * 2 + 3,
    lambda x: x * 2 + 4,
    lambda x: x * 2 + 5,
    lambda x: x * 2 + 6,
    lambda x: x * 2 + 7,
    lambda x: x * 2 + 8,
    lambda x: x * 2 + 9,
    lambda x: x * 2 + 10,
    lambda x: x * 2 + 11,
]

_dynamic: list[bool] = []


def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Record whether dynamo traced this frame with a symbolic size, and run it eagerly."""
    traced = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
    _dynamic.append(any(isinstance(value, torch.SymInt) or
                        (isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape))
                        for value in traced))
    return gm.forward


def first_compile_is_dynamic(fn: Any, size: int) -> bool:
    before = len(_dynamic)
    torch.compile(fn, backend=recording_backend)(torch.ones(size))
    return _dynamic[before]


def main() -> None:
    out, rounds = Path(sys.argv[1]), int(sys.argv[2])
    assert 2 * rounds <= len(FUNCS)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dynamo_config.automatic_dynamic_local_pgo = False  # decisions travel only through the store
    for round_ in range(rounds):
        torch._dynamo.reset()  # as a fresh process: the next read comes from the store
        pgo.get_code_state()  # the decisions all ranks published so far
        dynamo_config.automatic_dynamic_remote_pgo = False  # learn without writing ...
        fn = torch.compile(FUNCS[2 * round_ + rank], backend=recording_backend)
        fn(torch.ones(5))
        fn(torch.ones(7))  # a second size: automatic dynamic
        dynamo_config.automatic_dynamic_remote_pgo = True
        dist.barrier()
        pgo.put_code_state()  # ... then write at the same moment as the other rank
        dist.barrier()
    torch._dynamo.reset()
    decisions = {index: first_compile_is_dynamic(fn, 11) for index, fn in enumerate(FUNCS[: 2 * rounds])}
    (out / f"rank{rank}.json").write_text(json.dumps(decisions))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
