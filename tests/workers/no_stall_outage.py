"""One process with no-stall on a real Redis that goes down while its first compile behind runs.

Arguments: a working directory for redis-server and a JSON file to write. The script starts
its own redis-server, runs a graph once (this process leads its compile behind), stops the
server before the worker can have published (the worker is still importing torch) and
starts it again once the compile ended. The worker compiled the graph but could not
publish it: this process must still switch to it (torch's local cache, which it shares
with the worker). It writes the metrics and the call's largest difference from eager.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from harness.redis_server import RedisServer
from support.hang_guard import WORKER_HANG_GUARD_S

import recipecache


def no_stall() -> dict:
    return recipecache.torch_integration.metrics()["no_stall"]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    workdir, out = Path(sys.argv[1]), Path(sys.argv[2])
    with RedisServer(workdir) as server:
        recipecache.enable(server.url, namespace="outage", no_stall=True, exit_grace=60)
        compiled = torch.compile(lambda x: torch.relu(x) * 2)
        x = torch.randn(8)
        compiled(x)
        server.stop()  # the outage
        deadline = time.monotonic() + WORKER_HANG_GUARD_S
        while no_stall()["compiles"] + no_stall()["failed"] == 0:
            assert time.monotonic() < deadline, "the compile behind never ended"
            compiled(x)
            time.sleep(0.2)
        server.start()
        worst = 0.0
        while not no_stall()["switches"] and not no_stall()["failed"]:
            assert time.monotonic() < deadline, "never switched"
            worst = max(worst, (compiled(x) - torch.relu(x) * 2).abs().max().item())
            time.sleep(0.2)
        worst = max(worst, (compiled(x) - torch.relu(x) * 2).abs().max().item())
        out.write_text(json.dumps({"metrics": recipecache.torch_integration.metrics(), "difference": worst}))
        recipecache.torch_integration.disable()


if __name__ == "__main__":
    main()
