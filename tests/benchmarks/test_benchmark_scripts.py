"""Every benchmark starts: the issues' targets are figures a new user gets by running these scripts.

The house plan (issue 30) moved the tests' helpers into ``tests/support`` and ``test_orphans`` into
``tests/launcher``; seven benchmarks that import them from the tests stopped at their imports
(``ModuleNotFoundError``), ``orphans_bench.py`` and ``repeat_jobs_bench.py`` (issue 28's targets) among them,
and no test noticed. ``--help`` runs each one's imports and its argument parser, and nothing else.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

BENCHMARKS = REPO / "benchmarks"
#: the scripts a user runs (``tiny_gpt.py`` and ``load_worker.py`` are imported or started by them)
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if "argparse" in p.read_text())


def test_every_benchmark_is_found() -> None:
    assert {"orphans_bench.py", "repeat_jobs_bench.py", "cold_bench.py", "collectives_bench.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_starts_from_any_folder(script: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
