"""A Ray Train job that knows nothing of recipecache: ``TorchTrainer`` with 2 CPU workers on gloo, a small MLP
compiled with ``torch.compile`` and wrapped by Ray's ``prepare_model`` (DDP), trained on batches of 3 sizes (the last partial
batch of a dataset, a varying number of samples).

Ray runs the training function in a thread of its own in each worker, after its process group came up in
another: the case that found recipecache's per-thread settings. Each rank writes its losses and whether the
store was on in its training thread, the seconds of each iteration and its FX graph cache's misses to ``OUT/rank<R>.json``.

usage: ray_train_worker.py OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import ray
import ray.train.torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

RANKS = 2
BATCHES = (8, 8, 6, 8, 5, 8)


def train(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = ray.train.torch.prepare_model(torch.compile(net))  # DDP over the compiled module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    losses, seconds = [], []
    for size in BATCHES:
        begin = time.perf_counter()
        x, y = torch.randn(size, 16, generator=generator), torch.randn(size, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        seconds.append(time.perf_counter() - begin)
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "rank": rank,
        "losses": losses,
        "seconds": seconds,
        "store_on": bool(torch._inductor.config.fx_graph_remote_cache),
        "fx_misses": torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def main() -> None:
    ray.init(num_cpus=RANKS, include_dashboard=False, log_to_driver=False)
    try:
        TorchTrainer(
            train,
            train_loop_config={"out": sys.argv[1]},
            scaling_config=ScalingConfig(num_workers=RANKS, use_gpu=False),
            torch_config=ray.train.torch.TorchConfig(backend="gloo"),
        ).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
