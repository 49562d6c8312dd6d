"""A training rank that knows nothing of recipecache: plain torch, as a user's script is before any change.

It joins a gloo group the way any launcher's rank does (``init_process_group`` from the environment: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), compiles one tiny forward (one graph, one C++ kernel: seconds of
compile, not minutes), runs it, and writes to ``OUT/rank<R>.json`` its result and whether the start-up hook enabled
recipecache in it (torch's FX graphs go to a remote cache, which only recipecache's enable() sets here). With
``--no-exit-handlers`` it ends as Ray ends its workers: right after destroying its process group, without running
exit handlers.

usage: plain_ranks.py OUT [--no-exit-handlers]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    @torch.compile(dynamic=False)
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w + 1.0).sum(dim=1)

    torch.manual_seed(0)
    result = step(torch.randn(4, 8), torch.randn(8, 8))
    report = {
        "rank": rank,
        "result": result.tolist(),
        "enabled": bool(torch._inductor.config.fx_graph_remote_cache),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    if "--no-exit-handlers" in sys.argv:
        os._exit(0)


if __name__ == "__main__":
    main()
