"""Under ``recipecache-run`` a DDP + torch.compile + gloo script exits as it does under ``python script.py``.

Issue 15, item 19: the bootstrap used to run the script with ``runpy.run_path``, which
drops the script's globals as soon as it returns: the DDP model (and through its reducer
the gloo process group) was destroyed in the bootstrap, before the atexit handlers, and
once a rank hung for good in ``~ProcessGroupGloo`` joining a gloo thread that waited for
the GIL. Under ``python script.py`` the script stays ``__main__`` and its globals die in
interpreter finalization, after every atexit handler.

``tests/workers/ddp_exit.py`` is run ``RUNS`` times, 2 ranks, with one compile cache shared
by the runs (cold for the first, warm after): every run must exit 0 by itself, no rank
ended by the launcher, and every rank's atexit handler must see the script still
``__main__`` with its DDP model alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.ports import free_port
from harness.paths import WORKERS

pytestmark = [pytest.mark.multirank, pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(1200)]

WORKER = WORKERS / "ddp_exit.py"
RUNS = 6
RANKS = 2


def test_ddp_compile_script_exits_as_under_python_every_time(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), RECIPECACHE_DIR=str(tmp_path / "store"))
    for run in range(RUNS):
        run_dir = tmp_path / f"run{run}"
        proc = subprocess.run(
            [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--master-port", str(free_port()),
             "--exit-grace", "60", "--run-dir", str(run_dir), str(WORKER), str(run_dir / "seen")],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"run {run}: {proc.stderr[-4000:]}"
        report = json.loads((run_dir / "report.json").read_text())
        assert report["hung_ranks"] == [], f"run {run}: a rank hung at exit"
        for rank in range(RANKS):
            seen = json.loads((run_dir / f"seen{rank}.json").read_text())
            assert seen == {"main_is_script": True, "model_alive": True}, f"run {run}, rank {rank}: {seen}"
