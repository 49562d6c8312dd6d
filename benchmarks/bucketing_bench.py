"""Padding waste of percentile vs optimal bucket boundaries, and the cost of computing them.

Two length distributions:

* a real text corpus: the fortune cookies of Debian's ``fortunes`` package
  (``apt-get install fortunes``; read from /usr/share/games/fortunes, no network), one
  item per fortune, its length in whitespace tokens;
* synthetic: 10^6 log-normal token lengths (median ~55, long tail), the shape of most NLP
  corpora.

Prints, for k buckets, the fraction of computed elements that is padding with
``percentile_buckets`` and with ``optimal_buckets``, then the time ``optimal_buckets`` takes
on 10^6 lengths (integer token counts: exact; float durations: binned, with its gap).

    python benchmarks/bucketing_bench.py [--corpus-dir DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from recipecache.shapes import optimal_buckets, padding_waste, percentile_buckets

FORTUNES = Path("/usr/share/games/fortunes")
KS = (2, 4, 8, 16, 32, 64)
N_SYNTHETIC = 1_000_000


def fortune_lengths(directory: Path) -> np.ndarray:
    """Whitespace token count of every fortune (files are fortunes separated by '%' lines;
    the .dat indexes and .u8 links are skipped)."""
    lengths: list[int] = []
    for path in sorted(directory.iterdir()):
        if path.suffix or path.is_symlink() or not path.is_file():
            continue
        text = path.read_text(encoding="latin-1")
        lengths.extend(len(chunk.split()) for chunk in text.split("\n%\n") if chunk.strip())
    return np.asarray(lengths, dtype=np.int64)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def waste_table(name: str, lengths: np.ndarray) -> None:
    print(
        f"\n{name}: {lengths.size} lengths, {np.unique(lengths).size} distinct, "
        f"median {np.median(lengths):g}, max {lengths.max():g}"
    )
    print(f"{'k':>4}  {'percentile':>10}  {'optimal':>8}  {'ratio':>6}")
    for k in KS:
        pct = padding_waste(lengths, percentile_buckets(lengths, k))
        opt = optimal_buckets(lengths, k).padding_waste
        print(f"{k:>4}  {pct:>10.4f}  {opt:>8.4f}  {pct / opt if opt else float('inf'):>6.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-dir", type=Path, default=FORTUNES)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not args.corpus_dir.is_dir():
        print(f"error: no corpus at {args.corpus_dir}: apt-get install fortunes", file=sys.stderr)
        return 2

    rng = np.random.default_rng(0)
    synthetic = np.maximum(1, np.round(rng.lognormal(4.0, 0.8, N_SYNTHETIC))).astype(np.int64)
    waste_table(f"fortunes corpus ({args.corpus_dir})", fortune_lengths(args.corpus_dir))
    waste_table("synthetic log-normal(4, 0.8) token lengths", synthetic)

    print(f"\noptimal_buckets time, {N_SYNTHETIC} lengths, median of {args.repeats}:")
    for k in (8, 64):
        seconds = median_seconds(partial(optimal_buckets, synthetic, k), args.repeats)
        print(f"  integer lengths ({np.unique(synthetic).size} distinct), k={k}: {seconds:.3f} s (exact)")
    durations = rng.lognormal(1.5, 0.6, N_SYNTHETIC)  # e.g. audio clip seconds: every value distinct
    result = optimal_buckets(durations, 64)
    seconds = median_seconds(partial(optimal_buckets, durations, 64), args.repeats)
    print(
        f"  float lengths ({np.unique(durations).size} distinct), k=64: {seconds:.3f} s "
        f"(binned: waste {result.padding_waste:.4f}, at most {result.bound_gap:.4f} above optimal)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
