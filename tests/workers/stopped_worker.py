"""A rank-like process whose no-stall worker is stopped (SIGSTOP) as soon as it is started, before it can have
asked to die with this process; prints the worker's pid, then waits to be killed (test_no_stall_state)."""

from __future__ import annotations

import os
import signal
import time

from recipecache.torch_integration.no_stall import pool

worker = pool._Worker()
os.kill(worker.proc.pid, signal.SIGSTOP)
print(worker.proc.pid, flush=True)
time.sleep(600)
