"""A Python environment with recipecache's start-up hook installed, the way a wheel installs it.

A virtual environment (no pip: a fraction of a second) whose site-packages holds the package's
``recipecache-autoenable.pth`` and one ``.pth`` path line naming the running environment's site-packages (torch and
recipecache's dependencies; sorted first, so they are importable when the hook's line runs, as in one
site-packages). recipecache itself comes from the checkout (``PYTHONPATH``, :func:`hook_environ`), so the tests
never install into, or change, the environment they run in.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from harness.paths import REPO

#: the line the package installs (setup.py copies it to the root of every wheel)
HOOK_PTH = REPO / "recipecache" / "recipecache-autoenable.pth"


def make_hook_env(directory: Path) -> Path:
    """Create the environment in ``directory``; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120)
    python = directory / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=120,
        ).stdout.strip()
    )
    # this environment's site-packages and those it sees beyond them (a --system-site-packages one's)
    base = dict.fromkeys([*site.getsitepackages(), *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))])
    (purelib / "0-base-environment.pth").write_text("".join(f"{path}\n" for path in base))
    (purelib / HOOK_PTH.name).write_bytes(HOOK_PTH.read_bytes())
    return python


def hook_environ(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) without recipecache's and torch's cache variables, with the
    checkout first on ``PYTHONPATH``, plus ``extra``."""
    environ = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_", "TORCHELASTIC_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [environ.get("PYTHONPATH")])])
    return {**environ, **extra}
