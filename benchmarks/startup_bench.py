"""What recipecache's start-up hook costs a Python process that starts: ``python -c pass``, many times.

The hook is one ``.pth`` line in site-packages that Python runs in every process at start-up
(:mod:`recipecache.autoenable`). Where ``RECIPECACHE_ENABLE`` is not set it must cost nothing measurable: the
line compares one environment variable and imports nothing. Three environments, each a virtual environment over
this one's site-packages (:mod:`support.hook_env`), started in turn so load on the machine falls on all alike:

* ``without``: no hook installed;
* ``off``: the hook installed, ``RECIPECACHE_ENABLE`` unset (every process of a machine that installed recipecache);
* ``on``: the hook installed and ``RECIPECACHE_ENABLE=1`` in a process that is no rank (pip, a DataLoader or
  compile worker of a job): it imports recipecache and waits for torch, which never comes.

Prints each one's median start-up time in milliseconds and the ratios to ``without``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.hook_env import HOOK_PTH, hook_environ, make_hook_env  # noqa: E402


def start_once(python: Path, environ: dict[str, str]) -> float:
    begin = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=environ, check=True)
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=200, help="starts of each environment (default 200)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        hooked = make_hook_env(Path(tmp) / "hooked")
        bare = make_hook_env(Path(tmp) / "bare")
        next(Path(tmp, "bare").glob(f"lib/python*/site-packages/{HOOK_PTH.name}")).unlink()
        cases = {
            "without": (bare, hook_environ()),
            "off": (hooked, hook_environ()),
            "on": (hooked, hook_environ(RECIPECACHE_ENABLE="1")),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.starts):
            for name, (python, environ) in cases.items():
                times[name].append(start_once(python, environ))
    base = statistics.median(times["without"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:>8}: median {median * 1000:7.2f} ms over {len(samples)} starts  ({median / base:.3f}x without)")


if __name__ == "__main__":
    main()
