"""Simulator speed: one full simulation (schedule draw + policy) per policy and size.

    python benchmarks/sim_bench.py [--repeat 3] [--sizes 1024x10000x1000 ...]

Prints the median wall and CPU seconds of ``--repeat`` runs; the target is 1024 ranks x
10,000 steps x 1,000 shapes in under 10 s on one core. CPU seconds are the figure to
trust on a shared machine, where wall time includes waiting for a core.
"""

from __future__ import annotations

import argparse
import statistics
import time

from recipecache.sim import POLICIES, simulate

TARGET_S = 10.0


def size(text: str) -> tuple[int, int, int]:
    ranks, steps, shapes = (int(x) for x in text.split("x"))
    return ranks, steps, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", type=size, nargs="+", default=[(64, 1000, 100), (1024, 10000, 1000)],
                    help="RANKSxSTEPSxSHAPES")
    ap.add_argument("--distribution", default="zipf", choices=("zipf", "uniform"))
    args = ap.parse_args()
    print(f"{'ranks x steps x shapes':<24}{'policy':<14}{'wall_s':>9}{'cpu_s':>9}{'first meetings':>16}  target")
    for ranks, steps, shapes in args.sizes:
        for policy in POLICIES:
            walls, cpus = [], []
            for _ in range(args.repeat):
                wall0, cpu0 = time.perf_counter(), time.process_time()
                report = simulate(policy, ranks=ranks, steps=steps, shapes=shapes, distribution=args.distribution)
                walls.append(time.perf_counter() - wall0)
                cpus.append(time.process_time() - cpu0)
            cpu = statistics.median(cpus)
            print(f"{f'{ranks} x {steps} x {shapes}':<24}{policy:<14}{statistics.median(walls):>9.2f}{cpu:>9.2f}"
                  f"{report.first_meetings:>16}  {'ok' if cpu < TARGET_S else 'SLOW'} (< {TARGET_S:.0f} s)")


if __name__ == "__main__":
    main()
