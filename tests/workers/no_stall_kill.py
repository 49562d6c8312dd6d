"""One process with no-stall: its first compile behind the steps is killed (the worker process).

Argument: a JSON file to write. The graph whose worker died must run eager (counted as
``no_stall_failed``), its lease released, and training go on; then this process compiles it again, in
a new worker, and switches. The script writes the losses, its no-stall metrics and whether the killed
graph's lease was freed after the failure.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.hang_guard import WORKER_HANG_GUARD_S

import recipecache


def worker_pid() -> int | None:
    """The pid of this process's no-stall worker, if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == os.getpid() and b"no_stall.worker" in cmdline:
            return int(entry.name)
    return None


def kill_worker(deadline: float) -> None:
    """SIGKILL this process's no-stall worker, waiting for it to start until ``deadline`` (``time.monotonic()``)."""
    while (pid := worker_pid()) is None:
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # the grace lets the compile behind still running at exit (the backward's) finish on a loaded machine:
    # the metrics file written at exit must count the one failure this script caused, not one more
    store = recipecache.enable(no_stall=True, exit_grace=600)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    losses = []

    def step() -> None:
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    step()
    kill_worker(time.monotonic() + WORKER_HANG_GUARD_S)
    deadline = time.monotonic() + WORKER_HANG_GUARD_S
    no_stall = recipecache.torch_integration.metrics()["no_stall"]
    while no_stall["failed"] == 0:
        assert time.monotonic() < deadline, "the killed worker's compile was never counted failed"
        step()
        time.sleep(0.1)
        no_stall = recipecache.torch_integration.metrics()["no_stall"]
    failed = [key for key, g in no_stall["graphs"].items() if g.get("failed")]
    # the failed job frees the lease as it ends; no graph is called meanwhile, so nothing here takes it again
    deadline = time.monotonic() + WORKER_HANG_GUARD_S
    while any(store.compiling(key) for key in failed) and time.monotonic() < deadline:
        time.sleep(0.05)
    lease_freed = [not store.compiling(key) for key in failed]  # the test asserts them
    deadline = time.monotonic() + WORKER_HANG_GUARD_S
    while not all(no_stall["graphs"][key]["switched_at"] for key in failed):
        assert time.monotonic() < deadline, f"the failed graphs never switched: {no_stall['graphs']}"
        step()  # eager, until this process compiles the graph again and switches
        time.sleep(0.1)
        no_stall = recipecache.torch_integration.metrics()["no_stall"]
    for _ in range(5):
        step()
    metrics = recipecache.torch_integration.metrics()
    Path(sys.argv[1]).write_text(json.dumps({"losses": losses, "metrics": metrics, "lease_freed": lease_freed}))


if __name__ == "__main__":
    main()
