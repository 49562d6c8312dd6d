"""``recipecache report RUN_DIR``: recipecache-run's job report for the run directory of any job, from synthetic
metrics files (the real jobs: ``tests/torch_integration/test_any_launcher.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from recipecache.runs.report import build_report, format_report, load_metrics, world_ranks


def metrics(
    rank: int, *, threads: int = 1, world_size: int = 3, compiles: int = 1, host: str = "h"
) -> dict[str, Any]:
    return {
        "rank": rank, "world_size": world_size, "host": host, "pid": 100 + rank, "wall_s": 1.0,
        "graph_compilation": {"TotalNumber": compiles, "TotalTime": 2.5 * compiles},
        "cache": {"TotalHit": 1, "TotalMiss": compiles}, "store": {"puts": compiles},
        "settings": {"threads": threads, "namespace": "train", "cache": "file:///s", "node_tier": True},
    }


def write(run_dir: Path, rank: int, data: Any) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"metrics-rank{rank}.json").write_text(json.dumps(data))


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recipecache.tools.cli", *argv], capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_world_size_lists_a_rank_that_left_no_metrics(tmp_path: Path) -> None:
    write(tmp_path, 0, metrics(0))
    write(tmp_path, 2, metrics(2))
    proc = cli("report", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["expected_ranks"] == [0, 1, 2] and report["missing_ranks"] == [1]
    assert report["total"]["compiles"] == 2 and report["run_dir"] == str(tmp_path)
    text = cli("report", str(tmp_path)).stdout
    assert "WARNING: no usable metrics from rank(s) 1" in text


def test_settings_the_ranks_differ_in_are_said(tmp_path: Path) -> None:
    for rank, threads in enumerate((1, 1, 4)):
        write(tmp_path, rank, metrics(rank, threads=threads))
    found = load_metrics(tmp_path)
    report = build_report(found, world_ranks(found))
    assert report["total"]["settings_differ"] == {
        "threads": [{"value": 1, "ranks": [0, 1]}, {"value": 4, "ranks": [2]}]
    }
    assert "WARNING: the ranks differ in threads: 1 on rank(s) 0, 1; 4 on rank(s) 2" in format_report(report)


def test_damaged_settings_make_the_metrics_unreadable(tmp_path: Path) -> None:
    write(tmp_path, 0, {**metrics(0), "settings": {"threads": [1]}})
    write(tmp_path, 1, {**metrics(1), "world_size": 0})
    found = load_metrics(tmp_path)
    assert "settings is not a map" in found[0].error  # type: ignore[union-attr]
    assert "world_size is not a number of ranks" in found[1].error  # type: ignore[union-attr]


def test_a_recipecache_run_directory_keeps_the_jobs_own_fields(tmp_path: Path) -> None:
    """recipecache-run's report.json gives what only the launcher knew (exit status, ranks it ended, which ranks
    it started); the figures are the metrics files' as they are now."""
    for rank in range(2):
        write(tmp_path, rank, metrics(rank, world_size=2, compiles=rank))
    launcher = {"exit_code": 0, "exit_grace_s": 5.0, "expected_ranks": [0, 1], "total": {"compiles": 99},
                "hung_ranks": [{"rank": 1, "pid": 7, "local_rank": 1}]}
    (tmp_path / "report.json").write_text(json.dumps(launcher))
    report = json.loads(cli("report", str(tmp_path), "--json").stdout)
    assert report["exit_code"] == 0 and report["hung_ranks"] == launcher["hung_ranks"]
    assert report["total"]["compiles"] == 1
    assert "WARNING: rank(s) 1 still running 5 s after" in cli("report", str(tmp_path)).stdout


def test_a_run_directory_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = cli("report", str(tmp_path / "nope"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"recipecache: error: {tmp_path / 'nope'}: no such run directory\n"


def test_compile_seconds_are_shown_per_rank_and_node_with_the_largest_over_the_mean(tmp_path: Path) -> None:
    """Issue 47: a cold job's wall is set by the rank with the most compile work, so the report says who that was."""
    for rank, (compiles, host) in enumerate(((4, "a"), (2, "a"), (1, "b"), (1, "b"))):
        write(tmp_path, rank, metrics(rank, compiles=compiles, world_size=4, host=host))
    found = load_metrics(tmp_path)
    report = build_report(found, world_ranks(found))
    balance = report["total"]["compile_balance"]
    assert balance["largest_rank"] == 0 and balance["largest_s"] == 10.0 and balance["mean_s"] == 5.0
    assert balance["largest_over_mean"] == 2.0
    assert balance["by_node"] == {"a": {"compile_s": 15.0, "ranks": [0, 1]}, "b": {"compile_s": 5.0, "ranks": [2, 3]}}
    assert balance["node_largest_over_mean"] == 1.5
    assert ("compile seconds: rank 0 compiled longest, 10.0 s, 2.00x the mean of 5.0 s per rank; by node: "
            "a 15.0 s (ranks 0, 1); b 5.0 s (ranks 2, 3) (largest 1.50x the mean)") in format_report(report)


def test_compile_seconds_count_the_compiles_a_rank_ran_behind_the_steps(tmp_path: Path) -> None:
    # no-stall: rank 0 compiled 2 graphs inline (5 s) and, with the compile pool, rank 1 ran 7.5 s behind its steps
    write(tmp_path, 0, metrics(0, compiles=2, world_size=2))
    write(tmp_path, 1, {**metrics(1, compiles=0, world_size=2), "no_stall": {"compiles": 2, "compile_s": 7.5}})
    found = load_metrics(tmp_path)
    balance = build_report(found, world_ranks(found))["total"]["compile_balance"]
    assert balance["largest_rank"] == 1 and balance["largest_s"] == 7.5 and balance["mean_s"] == 6.25


def test_no_balance_without_compiles_or_with_one_rank(tmp_path: Path) -> None:
    write(tmp_path, 0, metrics(0, world_size=1))
    found = load_metrics(tmp_path)
    assert build_report(found, world_ranks(found))["total"]["compile_balance"] is None
    write(tmp_path, 1, metrics(1, world_size=2, compiles=0))
    write(tmp_path, 0, metrics(0, world_size=2, compiles=0))
    found = load_metrics(tmp_path)
    assert build_report(found, world_ranks(found))["total"]["compile_balance"] is None
