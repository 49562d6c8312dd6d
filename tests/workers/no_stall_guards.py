"""One process with no-stall and a graph inductor specializes while compiling it.

Argument: a JSON file to write. ``AdaptiveAvgPool1d`` under automatic dynamic shapes: the
second length traces a dynamic graph, and inductor's lowering adds a guard on that length
(``Eq(L, 32)``) to the shape environment, as it does in plain torch.compile (where a third
length then recompiles). The script runs length 32 until its graph runs compiled, then
lengths 40, 24 and 32, which dynamo's guards all send to that graph: each output must match eager's. It writes each length's largest
difference from eager and the no-stall metrics.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.hang_guard import WORKER_HANG_GUARD_S

import recipecache


def dynamic_graph_switched() -> bool:
    """Whether the graph the loop calls (the one with the most calls without inductor) runs compiled now."""
    graphs = recipecache.torch_integration.metrics()["no_stall"]["graphs"].values()
    busiest = max(graphs, key=lambda g: g["eager_calls"], default=None)
    return busiest is not None and (busiest["switched_at"] is not None or bool(busiest.get("failed")))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    recipecache.enable(no_stall=True, exit_grace=120)
    torch.manual_seed(0)
    pool = torch.nn.AdaptiveAvgPool1d(6)
    compiled = torch.compile(pool)
    inputs = {length: torch.randn(2, 3, length) for length in (24, 32, 40)}
    differences: dict[int, float] = {}

    def run(length: int) -> None:
        out = compiled(inputs[length])
        differences[length] = max(differences.get(length, 0.0), (out - pool(inputs[length])).abs().max().item())

    deadline = time.monotonic() + WORKER_HANG_GUARD_S
    run(24)  # a static graph
    run(32)  # automatic dynamic: a graph for every length, which inductor specializes while compiling it
    while not dynamic_graph_switched():
        assert time.monotonic() < deadline, "no switch"
        run(32)
        time.sleep(0.2)
    for _ in range(3):  # dynamo's guards send every length to the dynamic graph
        run(40)
        run(24)
        run(32)
    Path(sys.argv[1]).write_text(json.dumps({
        "differences": differences, "metrics": recipecache.torch_integration.metrics()}))


if __name__ == "__main__":
    main()
