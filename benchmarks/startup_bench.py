"""What recipecache's start-up hook costs a Python process that starts: ``python -c pass``, many times.

The hook is one ``.pth`` line in site-packages that Python runs in every process at start-up
(:mod:`recipecache.autoenable`). Where ``RECIPECACHE_ENABLE`` is not set it must cost nothing measurable: the
line compares one environment variable and imports nothing. Three environments, each a virtual environment over
this one's site-packages (:mod:`harness.hook_env`), started in turn so load on the machine falls on all alike:

* ``without``: no hook installed;
* ``off``: the hook installed, ``RECIPECACHE_ENABLE`` unset (every process of a machine that installed recipecache);
* ``on``: the hook installed and ``RECIPECACHE_ENABLE=1`` in a process that is no rank (pip, a DataLoader or
  compile worker of a job): it imports recipecache and waits for torch, which never comes.

Prints each one's median start-up time in milliseconds and the ratios to ``without``, and, since a difference of
a fraction of a millisecond drowns in the noise of process starts on a busy machine, what site's processing of the
line itself costs where off (``site.addpackage``, timed in this process).
"""

from __future__ import annotations

import argparse
import os
import site
import statistics
import subprocess
import tempfile
import time
import timeit
from pathlib import Path

from harness.hook_env import HOOK_PTH, hook_environ, make_hook_env


def start_once(python: Path, environ: dict[str, str]) -> float:
    begin = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=environ, check=True)
    return time.perf_counter() - begin


def line_cost_s(number: int = 2000) -> float:
    """Seconds site takes to read and run the hook's .pth line with ``RECIPECACHE_ENABLE`` unset."""
    os.environ.pop("RECIPECACHE_ENABLE", None)
    with tempfile.TemporaryDirectory(prefix="startup-bench-line-") as tmp:
        Path(tmp, HOOK_PTH.name).write_bytes(HOOK_PTH.read_bytes())
        return timeit.timeit(lambda: site.addpackage(tmp, HOOK_PTH.name, set()), number=number) / number


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
    print(f"site processing the line, off: {line_cost_s() * 1e6:.0f} us per process")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:>8}: median {median * 1000:7.2f} ms over {len(samples)} starts  ({median / base:.3f}x without)")


if __name__ == "__main__":
    main()
