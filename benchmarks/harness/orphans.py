"""The orphan job: a 2-rank gloo job (``tests/workers/orphan_job.py``) whose launcher or agent is SIGKILLed at one
point, then watched until none of its processes is left (issue 28). ``tests/launcher/test_orphans.py`` asserts
they all end; ``benchmarks/orphans_bench.py`` measures how soon, so a busy machine cannot fail a test with seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness.paths import WORKERS
from harness.ports import free_port
from recipecache.parent_death import parent_of

WORKER = WORKERS / "orphan_job.py"
#: the variable every process of the job inherits, with the job's own value: how its processes are found
MARKER = "ORPHAN_TEST_MARKER"
#: bound on waiting for the job to reach its point (a start of two ranks on a busy machine)
REACH_WITHIN_S = 180.0


def job_processes(marker: str) -> list[int]:
    """The live processes (not zombies) whose environment carries ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return found


def kill_job(marker: str) -> None:
    """SIGKILL every process of the job still there, so that a failed run leaves nothing behind."""
    for pid in job_processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within:g} s: {what}"
        time.sleep(0.1)


def kill_at(
    point: str, victim: str, options: list[str], marker: str, base: Path, hang_guard: float
) -> tuple[float, dict[int, str]]:
    """Start the 2-rank job under ``base``, SIGKILL ``victim`` once both ranks are at ``point``, and wait until
    no process of the job is left or ``hang_guard`` seconds passed: the seconds that took, and the survivors
    (pid: command line). The caller kills survivors (:func:`kill_job`)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    environ.update({MARKER: marker, "RECIPECACHE_DIR": str(base / "store")})
    events = base / "events"
    events.mkdir()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.main",
            "--nproc",
            "2",
            "--master-port",
            str(free_port()),
            "--quiet",
            "--exit-grace",
            "600",
            *options,
            "--run-dir",
            str(base / "run"),
            str(WORKER),
            str(events),
            point,
        ],
        env=environ,
        cwd=base,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert launcher.stderr is not None
    try:
        wait_for(
            lambda: launcher.poll() is not None or all((events / f"{point}-rank{r}").exists() for r in (0, 1)),
            REACH_WITHIN_S,
            f"both ranks at {point}",
        )
        assert launcher.poll() is None, f"the job ended before {point}: {launcher.stderr.read().decode()[-3000:]}"
        if victim == "agent":
            agents = [pid for pid in job_processes(marker) if parent_of(pid) == launcher.pid]
            assert len(agents) == 1, agents
            os.kill(agents[0], signal.SIGKILL)
        else:
            launcher.kill()
        killed = time.monotonic()
        while job_processes(marker) and time.monotonic() - killed < hang_guard:
            time.sleep(0.1)
        took = time.monotonic() - killed
        return took, {pid: _cmdline(pid) for pid in job_processes(marker)}
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stderr.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"
