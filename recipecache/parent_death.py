"""Processes that end with the process that started them: the launcher's torchrun, each rank, the no-stall worker.

torchrun starts every rank in its own session and the launcher starts torchrun in its own
session, so neither a closed terminal nor a signal to the launcher's process group reaches
them, and a parent killed outright (SIGKILL, the OOM killer) runs no cleanup: its children
would be re-parented to init and run on, a rank waiting forever on a store or a collective
whose other side is gone. Linux delivers a chosen signal to a process when its parent dies
(``PR_SET_PDEATHSIG``); the one race, a parent that died before the request, is closed by
checking the parent afterwards. Elsewhere nothing is armed.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: prctl option from <linux/prctl.h>
PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int, parent: int) -> bool:
    """Have ``signum`` sent to this process when its parent dies; end at once if ``parent`` is already gone.

    ``parent`` is the pid of the process that started this one, known from before the
    request: once armed, a parent pid other than it means the parent died before the
    request took effect (this process was re-parented), so the signal will never come and
    the process ends now, with status 1. Returns whether the signal is armed (False off Linux).
    """
    if sys.platform != "linux":
        return False
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) != 0:
        return False
    if os.getppid() != parent:
        os._exit(1)
    return True


def parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid`` (Linux, from ``/proc``), or None when it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None
