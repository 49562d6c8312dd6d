"""A 2-rank gloo job (no torch.compile) that stops for good at one point, after writing a file that says it is there.

Usage: ``orphan_job.py EVENTS_DIR POINT``. Each rank writes ``EVENTS_DIR/<POINT>-rank<RANK>`` on
reaching the point (where a rank does not reach it, as rank 0 in ``rendezvous``, it says so
the moment it starts waiting), then waits forever without using the CPU:

- ``started``: before any rendezvous;
- ``rendezvous``: rank 1 in ``init_process_group``, rank 0 never joining;
- ``collective``: after the rendezvous, rank 1 in an ``all_reduce``, rank 0 never joining;
- ``training``: both ranks in a loop of ``all_reduce`` steps, after the first steps;
- ``exit``: the script has returned; an atexit handler never returns.
"""

import atexit
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

EVENTS, POINT = Path(sys.argv[1]), sys.argv[2]
RANK = int(os.environ["RANK"])


def reached(point: str) -> None:
    (EVENTS / f"{point}-rank{RANK}").write_text(str(os.getpid()))


def stop_here() -> None:
    threading.Event().wait()


if POINT == "started":
    reached(POINT)
    stop_here()
if POINT == "rendezvous":
    reached(POINT)
    if RANK == 0:
        stop_here()
dist.init_process_group("gloo")
if POINT == "collective":
    reached(POINT)
    if RANK == 0:
        stop_here()
    dist.all_reduce(torch.ones(1))
if POINT == "training":
    for step in range(1_000_000):
        dist.all_reduce(torch.ones(1024))
        if step == 10:
            reached(POINT)
        if step % 1000 == 999:
            dist.barrier()
if POINT == "exit":
    atexit.register(stop_here)
    atexit.register(reached, POINT)  # runs first: atexit handlers run last-in, first-out
