"""One process with no-stall whose worker is stuck (stopped with SIGSTOP) in its first compile behind.

Arguments: MODE and a JSON file to write.

* ``deadline``: the compile's deadline (``RECIPECACHE_NO_STALL_TIMEOUT``, set by the test) ends the
  worker; the script steps until the graph is counted failed (``no_stall_timeout``), its lease released and the
  worker gone (each bounded by the hang guard), then writes the metrics, whether the graph's key is still leased
  and whether the stopped worker still exists.
* ``exit``: the script writes the graph's key and the worker's pid, then returns: the exit
  grace (``exit_grace=1``) must end the stopped worker and the process exit.
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

from no_stall_kill import worker_pid  # this directory is the script's (sys.path[0])


def stop_worker(deadline: float) -> int:
    """SIGSTOP this process's no-stall worker (a stuck compile), waiting for it to start until ``deadline``."""
    while (pid := worker_pid()) is None:
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    return pid


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    mode, out = sys.argv[1], Path(sys.argv[2])
    store = recipecache.enable(no_stall=True, exit_grace=1)
    compiled = torch.compile(lambda x: torch.relu(x) * 2)
    x = torch.randn(8)
    compiled(x)
    deadline = time.monotonic() + WORKER_HANG_GUARD_S
    pid = stop_worker(deadline)
    key = next(iter(recipecache.torch_integration.metrics()["no_stall"]["graphs"]))
    if mode == "exit":
        out.write_text(json.dumps({"key": key, "worker": pid}))
        return
    # the count comes first, then the lease's release and the worker's end: wait for all three (on a loaded machine
    # the release came after this loop's read of the count, and the test saw the lease still held)
    while not (
        recipecache.torch_integration.metrics()["fallbacks"].get("no_stall_timeout")
        and not store.compiling(key)
        and not Path(f"/proc/{pid}").exists()
    ):
        assert time.monotonic() < deadline, "the stuck compile was never ended, or its lease or worker outlived it"
        assert torch.equal(compiled(x), torch.relu(x) * 2)
        time.sleep(0.1)
    out.write_text(json.dumps({"metrics": recipecache.torch_integration.metrics(), "still_leased": store.compiling(key),
                               "worker_exists": Path(f"/proc/{pid}").exists()}))


if __name__ == "__main__":
    main()
