"""What an operator sees of real jobs: 2-rank torchrun + gloo runs of examples/train.py through recipecache-run.

Three small jobs (one bucket length, two steps), run once for the module:

1. cold: an empty store, each rank in its own empty local dirs (``--rank-dirs``);
2. warm: the same store and the same local dirs: torch's local cache answers first, so the
   report must show local hits where the store counts nothing;
3. skewed: rank 1 runs on one more thread (``workers/skewed_threads.py``), which is in every
   CPU graph key, so it compiles rank 0's graphs again: the report must list the duplicate
   compiles and ``recipecache explain`` must name the thread count. Run with ``--quiet``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness.paths import REPO

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

ROOT = REPO
EXAMPLE = ROOT / "examples" / "train.py"
SKEWED = ROOT / "tests" / "workers" / "skewed_threads.py"
JOB_ARGS = ["--buckets", "16", "--steps", "2"]


@dataclass
class Job:
    run_dir: Path
    stderr: str
    report: dict[str, Any]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}


def launch(tmp: Path, name: str, store: str, dirs: str, script: Path, *extra: str) -> Job:
    run_dir = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.main", "--nproc", "2", "--url", f"file://{tmp / store}", "--namespace", "op",
         "--run-dir", str(run_dir), "--rank-dirs", str(tmp / dirs), *extra, str(script), *JOB_ARGS],
        capture_output=True, text=True, env=_env(), timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Job(run_dir, proc.stderr, json.loads((run_dir / "report.json").read_text()))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recipecache.tools.cli", *args], capture_output=True, text=True,
                          env=_env(), timeout=300, check=False)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    tmp = tmp_path_factory.mktemp("operator")
    return {
        "cold": launch(tmp, "cold", "store", "dirs", EXAMPLE),
        "warm": launch(tmp, "warm", "store", "dirs", EXAMPLE),
        "skewed": launch(tmp, "skewed", "skewed-store", "skewed-dirs", SKEWED, "--quiet"),
    }


def progress_lines(job: Job) -> list[str]:
    """The launcher's progress lines. Each is one write to the stderr it shares with torchrun and the ranks,
    so it stays whole, but a rank's line written in pieces (C++ warnings) may have begun before it."""
    prefix = "recipecache-run: rank "
    return [line[line.index(prefix) :] for line in job.stderr.splitlines() if prefix in line]


def test_cold_job_prints_each_compile_as_it_starts_and_ends(jobs: dict[str, Job]) -> None:
    cold = jobs["cold"]
    lines = progress_lines(cold)
    started = [line for line in lines if " compiling TinyLM.forward" in line]
    finished = [line for line in lines if " compiled TinyLM.forward" in line and line.endswith(" s")]
    assert len(started) == len(finished) == cold.report["total"]["compiles"] > 0, lines
    for line in started:  # each start comes before its own finish
        done = line.replace(" compiling ", " compiled ", 1) + " in "
        assert any(end.startswith(done) and lines.index(end) > lines.index(line) for end in finished), line
    assert (cold.report["duplicates"], cold.report["missed"]) == ([], []), "single flight: each graph compiled once"


def test_warm_rerun_reports_torchs_local_hits(jobs: dict[str, Job]) -> None:
    """A rank that compiled a graph finds it in torch's own cache next time, and the store is not asked; a rank
    that loaded it from the store asks the store again (torch does not write remote hits to its local cache)."""
    warm, cold = jobs["warm"], jobs["cold"]
    for before, row in zip(cold.report["ranks"], warm.report["ranks"], strict=True):
        assert row["compiles"] == 0 and row["misses"] == 0, row
        assert row["local_hits"] >= before["compiles"], row  # forward and backward of what it compiled
        assert row["hits"] + row["local_hits"] >= 2, row
    assert warm.report["total"]["local_hits"] >= 2
    assert warm.report["total"]["local_hits"] == sum(r["local_hits"] for r in warm.report["ranks"])
    head, *rows = warm.stderr.split("recipecache-run: job exited", 1)[1].splitlines()[1:4]
    assert head.split()[3] == "local" and [r.split()[3] for r in rows] == [
        str(r["local_hits"]) for r in warm.report["ranks"]]
    assert progress_lines(warm) == [], "nothing compiled, nothing to report while running"


def test_trace_of_a_job_has_two_rank_tracks_with_compiles(jobs: dict[str, Job], tmp_path: Path) -> None:
    out, png = tmp_path / "trace.json", tmp_path / "trace.png"
    proc = cli("trace", str(jobs["cold"].run_dir), "-o", str(out), "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    events = json.loads(out.read_text())["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(tracks) == [0, 1] and all(name.startswith(f"rank {pid}") for pid, name in tracks.items())
    compiles = [e for e in events if e["ph"] == "X" and e["cat"] == "compile"]
    assert len(compiles) == jobs["cold"].report["total"]["compiles"]
    assert all(e["name"].startswith("compile TinyLM.forward") and e["dur"] > 0 for e in compiles)
    assert {e["pid"] for e in events if e["ph"] == "i" and e["cat"] == "step"} == {0, 1}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_ls_says_what_the_job_stored(jobs: dict[str, Job]) -> None:
    store = f"file://{jobs['cold'].run_dir.parent / 'store'}"
    entries = json.loads(cli("ls", "--url", store, "--namespace", "op", "--json").stdout)
    kinds = {e["meta"].get("kind") for e in entries}
    assert {"graph", "aot", "cpu_probe"} <= kinds
    graphs = [e["meta"] for e in entries if e["meta"].get("kind") == "graph"]
    assert {m["name"] for m in graphs} == {"TinyLM.forward", "TinyLM.forward backward"}
    assert all("i64[4,16]" in m["shapes"] and m["compile_s"] > 0 for m in graphs)


def test_a_rank_on_another_thread_count_is_a_named_duplicate(jobs: dict[str, Job]) -> None:
    skewed = jobs["skewed"]
    duplicates = skewed.report["duplicates"]
    assert sorted("backward" in d["label"] for d in duplicates) == [False, True], "forward and backward"
    assert all(d["label"].startswith("TinyLM.forward ") and "i64[4,16]" in d["label"] for d in duplicates)
    for dup in duplicates:
        assert sorted(c["rank"] for c in dup["compiles"]) == [0, 1]
        assert dup["compiles"][1]["reason"] == "different key: cpp_runtime_thread_count"
    assert "compiled by more than one rank (2 graph(s)" in skewed.stderr
    assert progress_lines(skewed) == [], "--quiet prints no progress"
    proc = cli("explain", str(skewed.run_dir))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("cpp_runtime_thread_count")]
    assert rows == [["cpp_runtime_thread_count", "1", "2"]] * 2, proc.stdout
    key = duplicates[0]["compiles"][1]["key"]
    only = json.loads(cli("explain", str(skewed.run_dir), "--key", key, "--json").stdout)
    assert len(only) == 1 and key in [k["key"] for k in only[0]["keys"]]
