"""One process with no-stall training a two-conv net until its forward and backward both run compiled, and on.

Argument: a JSON file to write. On the CPU inductor lays convolutions' activations and weights out channels-last,
so the forward compiled behind hands its backward other layouts than the ones eager gave where AOTAutograd traced
that backward (the forward ran without inductor then): the compiled backward asserts the traced ones. The script
trains the compiled net beside an eager twin, from the same weights on the same batches, until every graph switched
and three steps more (a process whose graphs all hit: six steps), and writes the largest loss difference and the
metrics.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.hang_guard import WORKER_HANG_GUARD_S

import recipecache


def all_switched(steps: int) -> bool:
    """Every graph compiled behind switched (or failed); or, a few steps in, none was deferred (a fresh process
    whose graphs were all in the store)."""
    graphs = recipecache.torch_integration.metrics()["no_stall"]["graphs"].values()
    if not graphs:
        return steps >= 3
    return all(g["switched_at"] is not None or g.get("failed") for g in graphs)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    recipecache.enable(no_stall=True, exit_grace=120)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 4 * 4, 4))
    twin = copy.deepcopy(net)
    compiled = torch.compile(net)
    pairs = [(compiled, torch.optim.SGD(net.parameters(), lr=0.01)), (twin, torch.optim.SGD(twin.parameters(), lr=0.01))]
    batch = torch.randn(4, 3, 8, 8)
    worst, after, steps = 0.0, 0, 0
    deadline = time.monotonic() + WORKER_HANG_GUARD_S
    while after < 3:
        losses = []
        for model, opt in pairs:
            opt.zero_grad()
            loss = model(batch).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        steps += 1
        if all_switched(steps):
            after += 1
        else:
            assert time.monotonic() < deadline, "no switch"
            time.sleep(0.2)
    Path(sys.argv[1]).write_text(json.dumps({"worst": worst, "metrics": recipecache.torch_integration.metrics()}))


if __name__ == "__main__":
    main()
