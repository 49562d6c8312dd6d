"""What every corpus program shares: its command line, a seed per (step, rank), and where its losses go.

The programs themselves use only their framework's own API: this module holds what a benchmark
needs from each (reproducible inputs and a record of the losses), nothing that changes how the
framework trains.
"""

from __future__ import annotations

import argparse
import json
import os
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


def write_losses(out: Path | None, losses: list[float]) -> None:
    """This rank's losses (as floats: bitwise comparable through JSON's repr of a double) to ``out``."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"losses-rank{rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank(), "losses": [float(x) for x in losses]}))
    tmp.replace(path)
