"""Real torchrun jobs (2 ranks, gloo, CPU) of ``examples/train.py`` through ``recipecache-run``.

Compiles are the expensive part (tens of seconds each on 2 cores), so the module runs
three jobs once and every test asserts on them:

1. cold: an empty file store, each rank in its own empty local dirs (``--rank-dirs``,
   as on separate nodes), so ranks can share only through recipecache;
2. warm: the same store, fresh empty local dirs again: everything must come from the store;
3. plain: the same script under plain torchrun, no recipecache, for the losses;
4. prewarm: a cold store again, with ``--prewarm``: the declared bucket shapes are
   compiled (spread over the ranks) before the first step, so training meets no compile;
5. one node: a cold store, private torch dirs per rank again, but one node directory for
   both ranks (``--node-dir``): a rank reads the other's artifacts from the node
   directory, never from the store. (The cold job, by contrast, gives each rank its own
   node directory under ``--rank-dirs``: two nodes, which must fetch from the store.)

The example's schedule puts rank 1 one bucket ahead of rank 0, so at step 0 each rank
compiles the length the other meets at step 1: every rank must hit an artifact it
never compiled itself.

One more job (``tests/workers/pgo_ranks.py``, no inductor) has both ranks write their
automatic-dynamic decisions to the store at the same moment, round after round, and then
checks that both ranks decide alike and that no rank's decision was lost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from recipecache.runs.events import read_events
from harness.paths import REPO, WORKERS

#: the three jobs run in the first test's fixture; generous because other work may share the 2 cores
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1200)]

EXAMPLE = REPO / "examples" / "train.py"
PGO_WORKER = WORKERS / "pgo_ranks.py"
PROBE_WORKER = WORKERS / "isa_probe_ranks.py"
#: rounds of simultaneous PGO writes (each rank adds one decision per round)
PGO_ROUNDS = 6
BUCKETS = (16, 32)
STEPS = 4
RANKS = 2
JOB_ARGS = ["--buckets", ",".join(map(str, BUCKETS)), "--steps", str(STEPS)]


@dataclass
class Job:
    losses: list[list[float]]
    output: dict[str, Any]
    report: dict[str, Any] | None = None
    events: list[dict[str, Any]] | None = None
    #: each rank's metrics file, by rank
    metrics: list[dict[str, Any]] | None = None
    #: each rank's store counters, from its metrics file
    store_stats: list[dict[str, Any]] | None = None

    def rank_events(self, event: str) -> list[dict[str, Any]]:
        assert self.events is not None
        return [e for e in self.events if e["event"] == event]

    def keys(self, event: str, rank: int | None = None) -> set[str]:
        return {e["key"] for e in self.rank_events(event) if rank is None or e["rank"] == rank}


def _env_without_recipecache() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}


def run_cached(tmp: Path, name: str, store_url: str, *launcher_args: str) -> Job:
    run_dir = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--url", store_url, "--namespace", "multirank",
         "--run-dir", str(run_dir), "--rank-dirs", str(tmp / f"{name}-dirs"), *launcher_args,
         str(EXAMPLE), *JOB_ARGS, "--losses", str(run_dir / "losses.json")],
        check=False, capture_output=True, text=True, env=_env_without_recipecache(), timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = json.loads((run_dir / "losses.json").read_text())
    metrics = [json.loads((run_dir / f"metrics-rank{rank}.json").read_text()) for rank in range(RANKS)]
    return Job(
        losses=output["losses"],
        output=output,
        report=json.loads((run_dir / "report.json").read_text()),
        events=list(read_events(run_dir / "events")),
        metrics=metrics,
        store_stats=[m["store"] for m in metrics],
    )


def run_plain(tmp: Path) -> Job:
    """The job without recipecache: torchrun straight, both ranks sharing one fresh local torch cache."""
    local = tmp / "plain-local"
    (local / "tmp").mkdir(parents=True)
    env = _env_without_recipecache() | {"TMPDIR": str(local / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(local / "inductor"),
                                        "OMP_NUM_THREADS": "1"}
    out = tmp / "plain-losses.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), str(EXAMPLE), *JOB_ARGS,
         "--losses", str(out)],
        check=False, capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = json.loads(out.read_text())
    return Job(losses=output["losses"], output=output)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    tmp = tmp_path_factory.mktemp("multirank")
    store = f"file://{tmp / 'store'}"
    cold = run_cached(tmp, "cold", store)
    warm = run_cached(tmp, "warm", store)
    prewarmed = run_cached(tmp, "prewarm", f"file://{tmp / 'prewarm-store'}", "--prewarm")
    one_node = run_cached(tmp, "one-node", f"file://{tmp / 'one-node-store'}", "--node-dir", str(tmp / "node"))
    yield {"cold": cold, "warm": warm, "plain": run_plain(tmp), "prewarm": prewarmed, "one-node": one_node}


def ranks(job: Job) -> list[dict[str, Any]]:
    assert job.report is not None
    assert job.report["missing_ranks"] == []
    assert [r["rank"] for r in job.report["ranks"]] == list(range(RANKS))
    return job.report["ranks"]


def test_cold_job_compiles_each_key_once(jobs: dict[str, Job]) -> None:
    cold = jobs["cold"]
    compiles = Counter(e["key"] for e in cold.rank_events("compile"))
    assert compiles, "nothing was compiled"
    assert max(compiles.values()) == 1, f"keys compiled more than once: {compiles}"
    assert len(compiles) >= len(BUCKETS)  # every bucket length is at least one graph of its own
    assert cold.report is not None
    assert cold.report["total"]["compiles"] == len(compiles)
    for row in ranks(cold):
        assert row["compiles"] == len(cold.keys("compile", row["rank"]))
    # every compiled artifact was published exactly once, by its compiler
    puts = Counter((e["key"], e["rank"]) for e in cold.rank_events("put") if e["key"] in compiles)
    assert {key for key, _ in puts} == set(compiles)
    assert all(n == 1 for n in puts.values())
    assert cold.report["total"]["puts"] >= len(compiles)


def test_fresh_rank_hits_the_other_ranks_artifact(jobs: dict[str, Job]) -> None:
    """Each rank, in its own empty local dirs, loads at least one artifact only the other rank compiled."""
    cold = jobs["cold"]
    for rank in range(RANKS):
        others = set().union(*(cold.keys("compile", r) for r in range(RANKS) if r != rank))
        borrowed = (cold.keys("hit", rank) & others) - cold.keys("compile", rank)
        assert borrowed, f"rank {rank} hit nothing another rank built"
        row = ranks(cold)[rank]
        assert row["hits"] >= len(borrowed)
        assert row["saved_s"] > 0  # the producer's compile time, carried with the artifact


def test_cold_ranks_share_the_cpu_probes(jobs: dict[str, Job]) -> None:
    """Both ranks compile their first graph at once, so both probe the CPU: each starts at its own share
    of torch's probes and installs the probe libraries the other rank built instead of building them too.

    On any CPU: each probe is single-flighted, so on a CPU with one ISA to probe one rank builds it and the
    other installs it (a rank that comes later installs the complete set)."""
    cold = jobs["cold"]
    assert cold.metrics is not None
    assert sum(m["lookups"]["isa"]["hit"] for m in cold.metrics) >= 1, [m["lookups"]["isa"] for m in cold.metrics]
    assert all(m["fallbacks"] == {} for m in cold.metrics)


def test_ranks_probing_the_same_isa_at_once_build_it_once(tmp_path: Path) -> None:
    """Issue 18 item 17: on a CPU with one vector ISA to probe (AVX2, no AVX-512: a Zen 3) both ranks of a
    cold job start with the same probe; one builds it, the other waits for it and installs it."""
    import torch

    if not torch.cpu._is_avx2_supported():
        pytest.skip("the job restricts torch's view of the CPU to AVX2, which this CPU lacks")
    out = tmp_path / "probes"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--url", f"file://{tmp_path / 'store'}",
         "--namespace", "probes", "--run-dir", str(tmp_path / "run"), "--rank-dirs", str(tmp_path / "dirs"),
         str(PROBE_WORKER), str(out)],
        check=False, capture_output=True, text=True, env=_env_without_recipecache(), timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    assert all(r["valid"] == ["avx2"] and r["fallbacks"] == {} for r in reports), reports
    lookups = [r["isa"] for r in reports]
    assert sum(n["put"] for n in lookups) == 1, f"the probe was built and published by one rank only: {lookups}"
    assert sum(n["hit"] for n in lookups) == RANKS - 1, f"the other rank installed it: {lookups}"


def test_warm_job_compiles_nothing(jobs: dict[str, Job]) -> None:
    warm = jobs["warm"]
    for row in ranks(warm):
        assert (row["compiles"], row["misses"], row["fallbacks"]) == (0, 0, {}), row
        assert row["hits"] > 0
    assert warm.rank_events("compile") == []
    assert warm.keys("hit") >= jobs["cold"].keys("compile")  # every artifact the cold job built, from the store


def test_losses_equal_the_job_without_cache(jobs: dict[str, Job]) -> None:
    """Bitwise: a hit loads the very kernels a local compile would build, and one thread per rank is deterministic."""
    plain = jobs["plain"].losses
    assert len(plain) == STEPS and all(len(step) == RANKS for step in plain)
    assert jobs["cold"].losses == plain
    assert jobs["warm"].losses == plain


def test_every_step_is_in_the_trace(jobs: dict[str, Job]) -> None:
    for name in ("cold", "warm"):
        steps = sorted((e["rank"], e["step"]) for e in jobs[name].rank_events("step"))
        assert steps == [(rank, step) for rank in range(RANKS) for step in range(STEPS)], name


def test_prewarm_leaves_no_compile_stall_in_training(jobs: dict[str, Job]) -> None:
    job = jobs["prewarm"]
    assert job.output["prewarmed"] is True
    assert job.report is not None and job.report["total"]["compiles"] > 0, "prewarm compiled the shapes"
    for rank, during in enumerate(job.output["in_training"]):
        assert (during["compiles"], during["waits"]) == (0, 0), f"rank {rank} met a compile in training: {during}"
    # each rank compiled only its share; the other shapes came from the store
    compiles = Counter(e["key"] for e in job.rank_events("compile"))
    assert max(compiles.values()) == 1
    assert all(row["compiles"] < job.report["total"]["compiles"] for row in ranks(job))
    assert job.losses == jobs["plain"].losses, "prewarming changes no training state"
    assert jobs["plain"].output["prewarmed"] is False


def test_ranks_of_one_node_share_its_directory_and_two_nodes_fetch(jobs: dict[str, Job]) -> None:
    one_node = jobs["one-node"]
    assert one_node.losses == jobs["plain"].losses
    assert max(Counter(e["key"] for e in one_node.rank_events("compile")).values()) == 1
    assert one_node.store_stats is not None and jobs["cold"].store_stats is not None
    for rank, stats in enumerate(one_node.store_stats):
        assert stats["node_hits"] >= 1, f"rank {rank} read the other rank's artifact from the node directory"
    assert sum(s["node_fetched_bytes"] for s in one_node.store_stats) == 0, "one node never reads back what it has"
    for rank, stats in enumerate(jobs["cold"].store_stats):  # --rank-dirs: each rank is a node of its own
        assert stats["node_dir"].endswith(f"/rank{rank}/node")
        assert stats["node_fetched_bytes"] > 0, f"node {rank} fetched the other node's artifact from the store"


def test_ranks_writing_pgo_decisions_at_once_lose_none_and_decide_alike(tmp_path: Path) -> None:
    """Issue 15 item 15: PGO state is merged with a compare-and-set, so concurrent writers lose nothing."""
    out = tmp_path / "decisions"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--url", f"file://{tmp_path / 'store'}",
         "--namespace", "pgo", "--run-dir", str(tmp_path / "run"), "--rank-dirs", str(tmp_path / "dirs"),
         str(PGO_WORKER), str(out), str(PGO_ROUNDS)],
        check=False, capture_output=True, text=True, env=_env_without_recipecache(), timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    decisions = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    assert decisions[0] == decisions[1], "both ranks make the same dynamic/static decision for every function"
    lost = sorted(int(index) for index, dynamic in decisions[0].items() if not dynamic)
    assert len(decisions[0]) == RANKS * PGO_ROUNDS and lost == [], f"decisions lost to concurrent writes: {lost}"


OVERLAP_WORKER = WORKERS / "overlap_ranks.py"
#: the overlap jobs' environment: one compile thread, one OMP thread (2 ranks on a busy 2-core machine)
OVERLAP_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _overlap_job(tmp_path: Path, *worker_args: str) -> tuple[Path, Path]:
    """The overlap worker under recipecache-run (2 ranks, a fresh file store) with ``worker_args``; its run
    directory and output directory, once it succeeded."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.main", "--nproc", "2", "--url", f"file://{tmp_path / 'store'}",
         "--namespace", "overlap", "--run-dir", str(run_dir), "--rank-dirs", str(tmp_path / "dirs"),
         str(OVERLAP_WORKER), str(out), *worker_args],
        check=False, capture_output=True, text=True, env=_env_without_recipecache() | OVERLAP_ENV, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir, out


@pytest.fixture(scope="module")
def plain_overlap_losses(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    """Both ranks' losses of the overlap worker under plain torchrun (no recipecache)."""
    plain = tmp_path_factory.mktemp("plain")
    (plain / "tmp").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(OVERLAP_WORKER), str(plain)],
        check=False, capture_output=True, text=True, timeout=900,
        env=_env_without_recipecache() | OVERLAP_ENV | {"TMPDIR": str(plain / "tmp"),
                                                         "TORCHINDUCTOR_CACHE_DIR": str(plain / "inductor")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((plain / "losses.json").read_text())


def test_a_rank_whose_forward_another_compiles_compiles_the_backward_meanwhile(
        tmp_path: Path, plain_overlap_losses: list[list[str]]) -> None:
    """Overlap: rank 1 finds the forward's lease held by rank 0, leaves that graph for its first call and leads the
    backward while rank 0 still compiles the forward (the worker holds rank 0's forward compile until rank 1 has
    lowered the backward: without overlap rank 1 waits for the forward instead, and rank 0 gives up waiting).
    Each graph is compiled once, by a different rank; losses equal plain torchrun's bit for bit."""
    run_dir, out = _overlap_job(tmp_path, "--sync")
    assert json.loads((out / "overlapped.json").read_text()) is True, "rank 1 did not lead the backward meanwhile"
    events = list(read_events(run_dir / "events"))
    compiles = {e["rank"]: e for e in events if e["event"] == "compile"}
    starts = {e["rank"]: e for e in events if e["event"] == "compile_start"}
    assert len([e for e in events if e["event"] == "compile"]) == 2, events
    assert set(compiles) == {0, 1} and compiles[0]["key"] != compiles[1]["key"]
    # rank 1 began the backward before rank 0's forward compile ended: the two compiles overlapped
    assert starts[1]["time"] < compiles[0]["time"]
    # each rank saved its AOTAutograd entry once the graph it waited for was loaded (a fresh rank skips the trace)
    metrics = [json.loads((run_dir / f"metrics-rank{rank}.json").read_text()) for rank in range(2)]
    assert [m["store"]["by_kind"]["aot"]["put"] for m in metrics] == [1, 1], [m["store"]["by_kind"] for m in metrics]
    assert json.loads((out / "losses.json").read_text()) == plain_overlap_losses


@pytest.mark.parametrize("forge", ["zeros", "short"])
def test_a_forged_output_strides_record_is_a_counted_fallback_and_the_losses_stand(
        tmp_path: Path, forge: str, plain_overlap_losses: list[list[str]]) -> None:
    """Issue 44: the record a waiting rank hands to AOTAutograd was checked for its type only. Rank 0 leads the
    forward and replaces the strides it published in the unsigned store with every stride "0" (the step then
    stopped on torch's stride assertion) or one output short; rank 1 refuses the record (one counted fallback),
    waits for the forward in its compile, and the job's losses are plain torchrun's bit for bit."""
    run_dir, out = _overlap_job(tmp_path, "--sync", "--forge", forge)
    metrics = [json.loads((run_dir / f"metrics-rank{rank}.json").read_text()) for rank in range(2)]
    assert metrics[1]["fallbacks"] == {"bad_artifact": 1}, metrics[1]["fallbacks"]
    assert json.loads((out / "losses.json").read_text()) == plain_overlap_losses
