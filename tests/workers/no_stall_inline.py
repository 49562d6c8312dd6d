"""One process with no-stall whose worker cannot give the rank's key for the backward graph (injected: its
first compile behind answers a key mismatch). The mismatch must be counted, and the graph compiled again
inline, from inside its switching callable at a later step, then run compiled.

Argument: a JSON file to write: this process's no-stall metrics once every graph switched.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.hang_guard import WORKER_HANG_GUARD_S

import recipecache
from recipecache.torch_integration.no_stall import controller


def inject_key_mismatch() -> None:
    """The first compile behind of a backward graph fails as a worker that computed another key does."""
    work = controller.NoStall._work
    failed: set[str] = set()

    def first_backward_mismatches(self: controller.NoStall, key: str, payload: bytes, cancelled: Any) -> float:
        if "backward" in self.graphs[key].name and not failed:
            failed.add(key)
            raise controller.WorkerFailed(f"the worker computed key other, the rank {key}", inline=True,
                                      key_mismatch=True)
        return work(self, key, payload, cancelled)

    controller.NoStall._work = first_backward_mismatches  # type: ignore[method-assign]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    recipecache.enable(no_stall=True, exit_grace=60)
    inject_key_mismatch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    deadline = time.monotonic() + WORKER_HANG_GUARD_S
    while True:
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        graphs = recipecache.torch_integration.metrics()["no_stall"]["graphs"]
        if len(graphs) >= 2 and all(g["switched_at"] is not None for g in graphs.values()):
            break
        assert time.monotonic() < deadline, f"not every graph switched within {WORKER_HANG_GUARD_S:g} s: {graphs}"
        time.sleep(0.1)
    Path(sys.argv[1]).write_text(json.dumps(recipecache.torch_integration.metrics()))


if __name__ == "__main__":
    main()
