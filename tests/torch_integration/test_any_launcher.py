"""recipecache without recipecache-run: ``RECIPECACHE_ENABLE=1`` and the start-up hook, in 2-rank gloo jobs (CPU)
of a script that knows nothing of recipecache (``tests/workers/plain_ranks.py``), started

* by plain torchrun (its run id names the run directory), and
* one process per rank as ``srun python`` starts them: plain ``python`` with RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT set and no job identity, so rank 0 names the run directory through the group's store;
  these ranks end as Ray ends its workers, without exit handlers once their process group is destroyed (their
  metrics are written then).

For each: a cold job fills a fresh store, a fresh job (each rank its own empty torch caches) compiles nothing, and
``recipecache report RUN_DIR --json`` gives the figures of the ranks' metrics files. Then the same, fewer checks,
with the frameworks' own launchers (``tests/workers/framework_ranks.py``, skipped without the framework):
``accelerate launch`` and Lightning's DDP launcher (``python script.py``, which re-runs the script for rank 1;
both ranks share one fresh torch cache per job there: the hook gives rank directories only to processes started
as ranks). And with one process (``tests/workers/compile_first.py``, the eager backend: no compile to wait for):
a rank enables at its first ``torch.compile`` when its launcher names the job, and neither a process that is no
rank nor a rank's multiprocessing child enables. The hook is installed as a wheel installs it
(:mod:`harness.hook_env`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness.hook_env import hook_environ, make_hook_env
from harness.paths import REPO, WORKERS
from harness.ports import free_port

pytestmark = [pytest.mark.multirank, pytest.mark.torch, pytest.mark.timeout(1800)]

WORKER = WORKERS / "plain_ranks.py"
FRAMEWORK_WORKER = WORKERS / "framework_ranks.py"
RANKS = 2
#: a hang guard for one job (a cold one compiles one tiny graph on each of 2 loaded cores)
JOB_TIMEOUT_S = 900


@dataclass
class Job:
    run_dir: Path
    #: what each rank's script saw, by rank
    ranks: list[dict[str, Any]]
    #: each rank's metrics file, by rank
    metrics: list[dict[str, Any]]
    #: ``recipecache report RUN_DIR --json``
    report: dict[str, Any]


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hook_env(tmp_path_factory.mktemp("hook-env") / "venv")


def finish(run_dir: Path, out: Path) -> Job:
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    metrics = [json.loads((run_dir / f"metrics-rank{rank}.json").read_text()) for rank in range(RANKS)]
    proc = subprocess.run([sys.executable, "-m", "recipecache.tools.cli", "report", str(run_dir), "--json"],
                          capture_output=True, text=True, env=hook_environ(), timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return Job(run_dir, ranks, metrics, json.loads(proc.stdout))


def only_run_dir(runs: Path) -> Path:
    found = [path for path in runs.iterdir() if path.is_dir()]
    assert len(found) == 1, f"one run directory per job, got {found}"
    return found[0]


def torchrun_job(python: Path, tmp: Path, name: str, store: str) -> Job:
    """``torchrun --nproc-per-node 2 plain_ranks.py``, each rank with empty torch caches of its own."""
    runs, out = tmp / f"{name}-runs", tmp / f"{name}-out"
    environ = hook_environ(RECIPECACHE_ENABLE="1", RECIPECACHE_URL=store, RECIPECACHE_RUNS_DIR=str(runs),
                           RECIPECACHE_RANK_DIRS=str(tmp / f"{name}-dirs"))
    proc = subprocess.run([str(python), "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), str(WORKER),
                           str(out)], capture_output=True, text=True, env=environ, cwd=tmp, timeout=JOB_TIMEOUT_S,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run_dir(runs)
    assert run_dir.name.startswith("torchelastic-"), run_dir
    return finish(run_dir, out)


def srun_job(python: Path, tmp: Path, name: str, store: str) -> Job:
    """One ``python plain_ranks.py`` per rank, wired by the environment alone, as ``srun`` starts ranks."""
    runs, out = tmp / f"{name}-runs", tmp / f"{name}-out"
    port = str(free_port())
    procs = []
    for rank in range(RANKS):
        local = tmp / f"{name}-rank{rank}"
        (local / "tmp").mkdir(parents=True)
        environ = hook_environ(
            RECIPECACHE_ENABLE="1", RECIPECACHE_URL=store, RECIPECACHE_RUNS_DIR=str(runs), RANK=str(rank),
            LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, TORCHINDUCTOR_CACHE_DIR=str(local / "inductor"), TMPDIR=str(local / "tmp"),
        )
        procs.append(subprocess.Popen([str(python), str(WORKER), str(out), "--no-exit-handlers"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=environ, cwd=tmp))
    for proc in procs:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        assert proc.returncode == 0, output
    run_dir = only_run_dir(runs)
    assert run_dir.name.startswith("127.0.0.1-"), run_dir
    return finish(run_dir, out)


@pytest.fixture(scope="module")
def jobs(python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    tmp = tmp_path_factory.mktemp("any-launcher")
    found = {}
    for launcher, start in (("torchrun", torchrun_job), ("srun", srun_job)):
        store = f"file://{tmp / f'{launcher}-store'}"
        found[f"{launcher}-cold"] = start(python, tmp, f"{launcher}-cold", store)
        found[f"{launcher}-warm"] = start(python, tmp, f"{launcher}-warm", store)
    yield found


LAUNCHERS = ("torchrun", "srun")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_hook_enables_every_rank_and_a_cold_job_fills_the_store(jobs: dict[str, Job], launcher: str) -> None:
    cold = jobs[f"{launcher}-cold"]
    assert all(rank["enabled"] for rank in cold.ranks), cold.ranks
    assert [m["rank"] for m in cold.metrics] == list(range(RANKS))
    assert sum(m["graph_compilation"]["TotalNumber"] for m in cold.metrics) >= 1
    assert sum(m["store"]["puts"] for m in cold.metrics) >= 1
    # the settings recipecache-run would give: the script's name as namespace, torchrun's thread count
    assert {m["settings"]["namespace"] for m in cold.metrics} == {"plain_ranks"}
    assert {m["settings"]["threads"] for m in cold.metrics} == {1}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_fresh_job_compiles_nothing(jobs: dict[str, Job], launcher: str) -> None:
    cold, warm = jobs[f"{launcher}-cold"], jobs[f"{launcher}-warm"]
    assert warm.run_dir != cold.run_dir, "each job its own run directory"
    assert [m["graph_compilation"]["TotalNumber"] for m in warm.metrics] == [0] * RANKS
    assert [rank["result"] for rank in warm.ranks] == [rank["result"] for rank in cold.ranks]
    assert all(m["cache"]["TotalHit"] >= 1 for m in warm.metrics), [m["cache"] for m in warm.metrics]


@pytest.mark.parametrize("job", [f"{launcher}-{kind}" for launcher in LAUNCHERS for kind in ("cold", "warm")])
def test_the_report_gives_the_figures_of_the_ranks_metrics(jobs: dict[str, Job], job: str) -> None:
    found = jobs[job]
    report = found.report
    assert report["expected_ranks"] == list(range(RANKS)) and report["missing_ranks"] == []
    for row, metrics in zip(report["ranks"], found.metrics, strict=True):
        assert row["compiles"] == metrics["graph_compilation"]["TotalNumber"]
        assert row["hits"] == metrics["cache"]["TotalHit"]
        assert row["misses"] == metrics["cache"]["TotalMiss"]
        assert row["puts"] == metrics["store"]["puts"]
    assert report["total"]["compiles"] == sum(m["graph_compilation"]["TotalNumber"] for m in found.metrics)
    assert report["total"]["settings_differ"] == {}
    assert (found.run_dir / "events").is_dir() and any((found.run_dir / "events").glob("events-rank*.jsonl"))


def test_the_report_prints_what_recipecache_run_prints(jobs: dict[str, Job]) -> None:
    """The table is :func:`recipecache.runs.report.format_report`'s, the one recipecache-run prints."""
    from recipecache.runs.report import format_report

    found = jobs["srun-cold"]
    proc = subprocess.run([sys.executable, "-m", "recipecache.tools.cli", "report", str(found.run_dir)],
                          capture_output=True, text=True, env=hook_environ(), timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    # line for line, but for the order of the kinds on the by-kind line (JSON sorted them)
    assert list(map(kinds_unordered, proc.stdout.splitlines())) == list(
        map(kinds_unordered, format_report(found.report).splitlines())
    )
    assert proc.stdout.splitlines()[0].split()[:3] == ["rank", "compiles", "hits"]


def kinds_unordered(line: str) -> str | frozenset[str]:
    if not line.startswith("by kind"):
        return line
    head, _, tail = line.partition(": ")
    kinds, _, note = tail.partition(" (")
    return frozenset([head, note, *kinds.split(", ")])


def test_a_process_that_is_no_rank_is_left_alone(python: Path, tmp_path: Path) -> None:
    """A script that compiles without a rank nor a group (and its multiprocessing child): nothing enabled, no run
    directory, no store, not a word from recipecache."""
    out = tmp_path / "out"
    out.mkdir()
    environ = hook_environ(RECIPECACHE_ENABLE="1", RECIPECACHE_URL=f"file://{tmp_path / 'store'}",
                           RECIPECACHE_RUNS_DIR=str(tmp_path / "runs"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"))
    proc = subprocess.run([str(python), str(WORKERS / "compile_first.py"), str(out)], capture_output=True, text=True,
                          env=environ, cwd=tmp_path, timeout=JOB_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads((out / f"{who}.json").read_text()) for who in ("rank", "child")] == [{"enabled": False}] * 2
    assert not (tmp_path / "runs").exists() and not (tmp_path / "store").exists()
    assert "recipecache" not in proc.stderr


def test_a_rank_enables_at_its_first_compile_and_its_workers_stay_out(python: Path, tmp_path: Path) -> None:
    """A global rank and a job identity in the environment: enabled at the first torch.compile, before any group
    (the run directory is named without one); a multiprocessing child that inherits the rank and compiles too is
    no rank of its own, and writes no rank's metrics."""
    out = tmp_path / "out"
    out.mkdir()
    environ = hook_environ(RECIPECACHE_ENABLE="1", RECIPECACHE_URL=f"file://{tmp_path / 'store'}",
                           RECIPECACHE_RUNS_DIR=str(tmp_path / "runs"), RANK="0", WORLD_SIZE="1",
                           TORCHELASTIC_RUN_ID="job-7", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run([str(python), str(WORKERS / "compile_first.py"), str(out)], capture_output=True, text=True,
                          env=environ, cwd=tmp_path, timeout=JOB_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "rank.json").read_text()) == {"enabled": True}
    assert json.loads((out / "child.json").read_text()) == {"enabled": False}
    metrics = json.loads((tmp_path / "runs" / "torchelastic-job-7" / "metrics-rank0.json").read_text())
    assert metrics["world_size"] == 1 and metrics["settings"]["namespace"] == "compile_first"


def framework_job(python: Path, tmp: Path, framework: str, name: str, store: str) -> Job:
    runs, out = tmp / f"{name}-runs", tmp / f"{name}-out"
    local = tmp / f"{name}-local"
    (local / "tmp").mkdir(parents=True)
    environ = hook_environ(RECIPECACHE_ENABLE="1", RECIPECACHE_URL=store, RECIPECACHE_RUNS_DIR=str(runs),
                           TORCHINDUCTOR_CACHE_DIR=str(local / "inductor"), TMPDIR=str(local / "tmp"),
                           RECIPECACHE_RANK_DIRS=str(tmp / f"{name}-dirs"))
    if framework == "accelerate":  # its multi-process launch is torchrun's (no --multi_gpu: one process on a CPU)
        argv = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(RANKS), "--num_machines",
                "1", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no"]
    else:
        argv = []
    proc = subprocess.run([str(python), *argv, str(FRAMEWORK_WORKER), framework, str(out)], capture_output=True,
                          text=True, env=environ, cwd=tmp, timeout=JOB_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return finish(only_run_dir(runs), out)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["accelerate", "lightning"])
def test_a_frameworks_own_launcher(python: Path, tmp_path: Path, framework: str) -> None:
    pytest.importorskip({"accelerate": "accelerate", "lightning": "pytorch_lightning"}[framework])
    store = f"file://{tmp_path / 'store'}"
    cold = framework_job(python, tmp_path, framework, "cold", store)
    warm = framework_job(python, tmp_path, framework, "warm", store)
    for job in (cold, warm):
        assert all(rank["enabled"] for rank in job.ranks), job.ranks
        assert job.report["expected_ranks"] == list(range(RANKS)) and job.report["missing_ranks"] == []
        assert job.report["total"]["settings_differ"] == {}
    assert cold.report["total"]["compiles"] >= 1 and cold.report["total"]["puts"] >= 1
    assert warm.report["total"]["compiles"] == 0 and warm.report["total"]["hits"] >= 1
    assert [rank["result"] for rank in warm.ranks] == [rank["result"] for rank in cold.ranks]
