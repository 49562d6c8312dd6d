"""Helpers for tests that start real processes and crash them mid-work."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path


def wait_until_ready(proc: subprocess.Popen[bytes], ready: Path, what: str, timeout: float = 120.0) -> None:
    """Wait until ``proc`` writes ``ready`` (it is in the middle of its work); ``timeout`` only guards a hang."""
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"{what} never started"
        time.sleep(0.02)


def kill_once_ready(proc: subprocess.Popen[bytes], ready: Path, what: str, timeout: float = 120.0) -> None:
    """Wait until ``proc`` writes ``ready`` (it is in the middle of its work), then SIGKILL it, as a crash."""
    wait_until_ready(proc, ready, what, timeout)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def failed_job_output(output: str, tail: int = 4000) -> str:
    """A failed multi-rank job's output for an assertion message: each traceback's start, then the output's tail.

    torchrun's summary of a failed job fills the tail, so a rank's own traceback, the one line that says why
    it failed, would otherwise be cut off the message."""
    tracebacks = [output[m.start():m.start() + 3000] for m in re.finditer("Traceback \\(most recent call last\\)", output)]
    return "\n...\n".join([*tracebacks[:4], output[-tail:]])
