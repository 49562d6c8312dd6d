"""Where the benchmarks and the tests find the repository and the worker scripts they start, from any folder."""

from pathlib import Path

HARNESS = Path(__file__).resolve().parent
BENCHMARKS = HARNESS.parent
REPO = BENCHMARKS.parent
TESTS = REPO / "tests"
#: scripts the tests and the benchmarks start as processes (torchrun ranks, stuck peers, ...)
WORKERS = TESTS / "workers"
