"""Every benchmark starts: the issues' targets are figures a new user gets by running these scripts.

The house plan (issue 30) moved the tests' helpers into ``tests/support`` and ``test_orphans`` into
``tests/launcher``; seven benchmarks that imported them from the tests stopped at their imports
(``ModuleNotFoundError``), ``orphans_bench.py`` and ``repeat_jobs_bench.py`` (issue 28's targets) among them,
and no test noticed. What both need is now ``benchmarks/harness`` (issue 45), and no benchmark imports from
``tests/``. ``--help`` runs each one's imports and its argument parser, and nothing else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from harness.paths import BENCHMARKS, REPO, TESTS

#: the scripts a user runs (``tiny_gpt.py`` and ``load_worker.py`` are imported or started by them)
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if "argparse" in p.read_text())


def test_every_benchmark_is_found() -> None:
    assert {"orphans_bench.py", "repeat_jobs_bench.py", "cold_bench.py", "collectives_bench.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_starts_from_any_folder(script: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    found |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return found


def test_no_benchmark_imports_the_tests() -> None:
    """A benchmark that imports from ``tests/`` breaks when a test helper moves; what both need is the harness."""
    test_modules = {p.stem for p in TESTS.rglob("*.py")} | {"support"}
    offenders = {
        str(path.relative_to(REPO)): sorted(
            name for name in _imported_modules(path) if name.split(".")[0] in test_modules
        )
        for path in BENCHMARKS.rglob("*.py")
    }
    for path in BENCHMARKS.rglob("*.py"):
        offenders[str(path.relative_to(REPO))] += [
            line.strip() for line in path.read_text().splitlines() if "sys.path.insert(" in line and "tests" in line
        ]
    assert not {path: names for path, names in offenders.items() if names}
