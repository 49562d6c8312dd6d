"""What every corpus program shares: its command line, a seed per (step, rank), and where its losses go.

The programs themselves use only their framework's own API: this module holds what a benchmark
needs from each (reproducible inputs and a record of the losses), nothing that changes how the
framework trains.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def parser(doc: str | None, steps: int, lengths: str) -> argparse.ArgumentParser:
    """The options every corpus program takes: where its losses go, how long it trains, which sizes it meets."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="a directory: each rank writes losses-rank<R>.json there")
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument(
        "--lengths", default=lengths, help=f"the sizes the batches cycle through, comma-separated (default {lengths})"
    )
    return p


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def rank() -> int:
    """This process's global rank from the launcher's variables (0 when started alone)."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def generator(step: int, salt: int = 0) -> torch.Generator:
    """A generator seeded by (step, rank, salt): every run of a program sees the same data on each rank."""
    return torch.Generator().manual_seed(1_000_003 * salt + 1009 * step + rank())


class Record:
    """This rank's losses and when each step ended, written to ``--out`` for the benchmark and the tests.

    Times are seconds since :meth:`start` (called where the program begins to train: the
    framework's setup before it, its first step after), so a benchmark can compare how long
    iterations 0 and 1 took with and without the cache. Losses are written as JSON floats
    (Python's repr of a double round-trips), so runs compare bit for bit.
    """

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.losses: list[float] = []
        self.step_end_s: list[float] = []
        self._start = time.perf_counter()

    def start(self) -> None:
        self._start = time.perf_counter()

    def step(self, loss: float) -> None:
        self.losses.append(float(loss))
        self.step_end_s.append(time.perf_counter() - self._start)

    def write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"losses-rank{rank()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": rank(), "losses": self.losses, "step_end_s": self.step_end_s}))
        tmp.replace(path)
