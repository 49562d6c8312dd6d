"""One precompiled-tier scenario in a fresh process: train a tiny model two steps, report JSON.

usage: precompile_worker.py OUT_JSON {rc|plain} MODEL_DIR [--offset-size N] [--broken]

The model and the extra function come from ``MODEL_DIR/pc_model.py`` (written by the
test, so a test can change that source file between processes): ``Net`` trains two
steps; ``--offset-size N`` then gives it an ``offset`` tensor of size N (a plain
attribute: guarded, not in the key) for a third step; ``broken`` has a graph break.
``rc`` calls ``recipecache.enable(precompile=True)`` (store, secret and metrics from the
environment); ``plain`` is torch alone.

Reported: per part a digest of every output, loss and gradient byte; dynamo's frame
counter and the compiler runs ($GXX_LOG lines) during the model's two steps (and the frame counter
during the offset step); the
largest difference between the compiled model's first output and eager's; metrics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch


def compiler_runs() -> int:
    """C++ sources compiled so far (the g++ wrapper also logs version queries, which compile nothing)."""
    log = os.environ.get("GXX_LOG")
    return sum(".cpp" in line for line in Path(log).read_text().splitlines()) if log and Path(log).exists() else 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("mode", choices=("rc", "plain"))
    p.add_argument("model_dir")
    p.add_argument("--offset-size", type=int)
    p.add_argument("--broken", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, args.model_dir)
    import pc_model

    if args.mode == "rc":
        import recipecache

        recipecache.enable(precompile=True)
    from torch._dynamo.utils import counters

    report: dict[str, Any] = {}
    torch.manual_seed(0)
    model = pc_model.Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model)
    inputs = [torch.randn(4, 8) for _ in range(3)]
    with torch.no_grad():
        eager_first = model(inputs[0])

    def step(x: torch.Tensor, digest: Any) -> torch.Tensor:
        out = compiled(x)
        loss = out.pow(2).mean()
        loss.backward()
        for t in (out, loss, *(q.grad for q in model.parameters())):
            digest.update(t.detach().numpy().tobytes())
        opt.step()
        opt.zero_grad()
        return out

    gxx_before = compiler_runs()
    digest = hashlib.sha256()
    first = step(inputs[0], digest)
    step(inputs[1], digest)
    report["max_diff_vs_eager"] = (first.detach() - eager_first).abs().max().item()
    report["model_digest"] = digest.hexdigest()
    report["model_frames"] = int(counters["frames"]["total"])
    report["model_compiler_runs"] = compiler_runs() - gxx_before
    if args.offset_size is not None:
        model.offset = torch.zeros(args.offset_size)
        digest = hashlib.sha256()
        frames_before = int(counters["frames"]["total"])
        step(inputs[2], digest)
        report["offset_digest"] = digest.hexdigest()
        report["offset_frames"] = int(counters["frames"]["total"]) - frames_before
    if args.broken:
        broken = torch.compile(pc_model.broken)
        report["broken"] = hashlib.sha256(broken(torch.arange(4.0)).numpy().tobytes()).hexdigest()
    if args.mode == "rc":
        from recipecache.torch_integration import metrics

        report["metrics"] = metrics()
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
