"""Graphs that carry collectives, compiled once per job (issue 27): 4 ranks, gloo, CPU, a dp=2 x tp=2 mesh.

``tests/workers/tp_ranks.py`` compiles tensor parallel (all_reduce), sequence parallel
(all_gather / reduce_scatter), an expert-parallel all_to_all and a graph that all-reduces
over both the tp and the dp group. torch bakes each rank's group names into these graphs
and pickles the rank's device mesh into their keys, so before recipecache bound them per
rank every rank compiled every graph. Six jobs, run once for the module (:func:`jobs`):

1. cold: an empty store, every rank in its own empty local dirs (as on separate nodes);
2. fresh: the same store, fresh empty dirs again: nothing may be compiled;
3. plain: the same script under plain torchrun (one shared local cache), for the losses;
4. nostall: a no-stall job on an empty store of its own: the graphs with collectives are compiled
   by a rank of their groups, never by a worker process (which has no process groups);
5. and 6. tier-cold, tier-fresh: the precompiled tier, cold then fresh on a store of its own, on a
   function all-reducing over the tp mesh it is passed (the same call on every rank, whose compiled
   code names the rank's tp group), then on the tensor-parallel MLP as TorchTitan builds it
   (``parallelize_module``: DTensor parameters, the plan's hooks), trained.

No two of them can be one job: each is a different configuration (no-stall and the precompiled tier change
which path compiles, a fresh job needs fresh processes, plain torchrun none of recipecache). They run in
two lanes side by side, each lane's jobs in order (a fresh job after its cold one), every job on a
rendezvous port of its own (``--standalone``): a rank waiting for another's compile leaves a core to the
other lane.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.processes import failed_job_output

from harness.paths import WORKERS
from recipecache.runs.events import read_events
from recipecache.runs.explain import analyse_run

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1500)]

WORKER = WORKERS / "tp_ranks.py"
RANKS = 4
#: each rank's (tp sum, dp sum) of ``rank + 1``: tp groups {0,1} {2,3} (x2), dp groups {0,2} {1,3} (x3)
GROUP_SUMS = [[6.0, 12.0], [6.0, 18.0], [14.0, 12.0], [14.0, 18.0]]


def _env_without_recipecache() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "TORCHINDUCTOR_"))}


def _run(tmp: Path, name: str, store: str | None, *options: str, mode: str = "all") -> dict[str, Any]:
    out = tmp / f"{name}.json"
    env = _env_without_recipecache() | {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    if store is None:
        local = tmp / "plain-local"
        (local / "tmp").mkdir(parents=True)
        env |= {"TMPDIR": str(local / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(local / "inductor"), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
                   str(WORKER), str(out), "--mode", mode]
    else:
        command = [sys.executable, "-m", "launcher.main", "--nproc", str(RANKS), "--url", store, "--namespace",
                   "collectives", "--run-dir", str(tmp / name), "--rank-dirs", str(tmp / f"{name}-dirs"), "--quiet",
                   "--standalone", *options, str(WORKER), str(out), "--mode", mode]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, failed_job_output(proc.stdout + proc.stderr)
    job = json.loads(out.read_text())
    if store is not None:
        job["events"] = list(read_events(tmp / name / "events"))
        job["report"] = json.loads((tmp / name / "report.json").read_text())
        job["metrics"] = [json.loads((tmp / name / f"metrics-rank{rank}.json").read_text()) for rank in range(RANKS)]
        job["run_dir"] = tmp / name
    return job


def _graph_store_lane(tmp: Path) -> dict[str, dict[str, Any]]:
    """cold, then fresh on its store; then the no-stall job on a store of its own."""
    store = f"file://{tmp / 'store'}"
    cold = _run(tmp, "cold", store)
    fresh = _run(tmp, "fresh", store)
    return {"cold": cold, "fresh": fresh, "nostall": _run(tmp, "nostall", f"file://{tmp / 'nostall-store'}",
                                                          "--no-stall")}


def _plain_and_tier_lane(tmp: Path) -> dict[str, dict[str, Any]]:
    """plain torchrun; then the precompiled tier, cold and then fresh, on a store of its own."""
    plain = _run(tmp, "plain", None)
    store = f"file://{tmp / 'tier-store'}"
    cold = _run(tmp, "tier-cold", store, "--precompile", mode="tier")
    return {"plain": plain, "tier-cold": cold, "tier-fresh": _run(tmp, "tier-fresh", store, "--precompile",
                                                                   mode="tier")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The module's six jobs by name, run in two lanes side by side."""
    tmp = tmp_path_factory.mktemp("collectives")
    with ThreadPoolExecutor(2) as lanes:
        running = [lanes.submit(lane, tmp) for lane in (_graph_store_lane, _plain_and_tier_lane)]
        return {name: job for lane in running for name, job in lane.result().items()}


def _keys(job: dict[str, Any], event: str, rank: int | None = None) -> set[str]:
    return {e["key"] for e in job["events"] if e["event"] == event and (rank is None or e["rank"] == rank)}


def test_every_rank_looks_up_the_same_graph_keys(jobs: dict[str, dict[str, Any]]) -> None:
    """Ranks of both tp groups, on both tp positions, trace their graphs under one key each."""
    cold = jobs["cold"]
    looked_up = [_keys(cold, "miss", rank) | _keys(cold, "hit", rank) for rank in range(RANKS)]
    assert looked_up[0], "no graph was looked up"
    assert all(keys == looked_up[0] for keys in looked_up), looked_up


def test_cold_job_compiles_each_distinct_graph_once(jobs: dict[str, dict[str, Any]]) -> None:
    cold = jobs["cold"]
    compiles = Counter(e["key"] for e in cold["events"] if e["event"] == "compile")
    distinct = _keys(cold, "miss", 0) | _keys(cold, "hit", 0)
    assert max(compiles.values()) == 1, f"graphs compiled more than once: {compiles}"
    # forward and backward of tp, sp and the all_to_all, and the group sums: 7 graphs, not 4 x 7
    assert set(compiles) == distinct and len(distinct) == 7, (compiles, distinct)
    assert cold["report"]["total"]["compiles"] == len(distinct)
    assert all(row["fallbacks"] == {} for row in cold["report"]["ranks"]), cold["report"]["ranks"]


def test_fresh_job_compiles_nothing(jobs: dict[str, dict[str, Any]]) -> None:
    fresh = jobs["fresh"]
    assert _keys(fresh, "compile") == set()
    assert [(row["compiles"], row["misses"]) for row in fresh["report"]["ranks"]] == [(0, 0)] * RANKS
    assert _keys(fresh, "hit") == _keys(jobs["cold"], "compile")


def test_fresh_job_traces_no_autograd_graph(jobs: dict[str, dict[str, Any]]) -> None:
    """Every rank's AOTAutograd entries are in the store: a fresh rank skips AOTAutograd's trace too. Their keys
    and the FX keys they name are each rank's own; the entries say under which shared key each graph is."""
    aot = [metrics["lookups"]["aot"] for metrics in jobs["fresh"]["metrics"]]
    assert all(lookups["miss"] == 0 and lookups["hit"] > 0 for lookups in aot), aot


def test_each_rank_runs_its_own_groups_collectives(jobs: dict[str, dict[str, Any]]) -> None:
    """The group-sum graph is compiled by one rank and loaded by the other three: each must all-reduce over its
    own tp and dp group (a rank bound to another group's collective, or to its dp group in place of its tp
    group, gets other sums or fails)."""
    for name in ("plain", "cold", "fresh"):
        assert jobs[name]["sums"] == GROUP_SUMS, name


def test_losses_equal_plain_torchrun(jobs: dict[str, dict[str, Any]]) -> None:
    plain = jobs["plain"]["losses"]
    assert len(plain) == RANKS and all(len(steps) == 2 for steps in plain)
    assert jobs["cold"]["losses"] == plain
    assert jobs["fresh"]["losses"] == plain


def test_report_lists_no_duplicate(jobs: dict[str, dict[str, Any]]) -> None:
    analysis = analyse_run(jobs["cold"]["run_dir"])
    assert analysis.duplicates == [], analysis.duplicates


@pytest.fixture(scope="module")
def nostall(jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return jobs["nostall"]


def test_no_stall_runs_each_ranks_own_collectives(nostall: dict[str, Any]) -> None:
    """Eager while another rank compiles, then compiled: every rank all-reduces over its own groups."""
    assert nostall["sums"] == GROUP_SUMS


def test_no_stall_compiles_graphs_with_collectives_in_a_rank(nostall: dict[str, Any]) -> None:
    """A worker process has no process groups: it can neither compile a graph with collectives nor compute the
    FX key of one taking the mesh (torch's wire format sends it as None). A rank compiles each, once, and
    publishes it under the key every rank shares: no rank looks a graph up under a key of its own, not even at exit,
    after the script destroyed its process groups (a rank whose graph was published after its last step may never
    look it up at all)."""
    assert [metrics["no_stall"]["key_mismatches"] for metrics in nostall["metrics"]] == [0] * RANKS
    distinct = _keys(nostall, "miss") | _keys(nostall, "hit")
    published = nostall["report"]["total"]["lookups"]["fx"]["put"]
    assert len(distinct) == 7 and published == len(distinct), (distinct, published)


def test_no_stall_trains_the_dtensor_modules_on_each_ranks_own_group(nostall: dict[str, Any],
                                                                     jobs: dict[str, dict[str, Any]]) -> None:
    """The tensor-parallel MLP as TorchTitan builds it (``parallelize_module``), under no-stall: its graphs carry the
    tp group's collectives, so a rank of the group compiles them while the other runs them without inductor. The
    MLP's output is all-reduced over the group, so both ranks of a group see one loss, bit for bit, whichever ran
    what; the groups draw other inputs, so their losses differ; and they are plain torchrun's (close: eager and
    inductor may round differently)."""
    losses = nostall["tp_losses"]
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2], losses
    for ours, theirs in zip(losses, jobs["plain"]["tp_losses"], strict=True):
        assert all(math.isclose(float.fromhex(a), float.fromhex(b), rel_tol=1e-5) for a, b in zip(ours, theirs,
                                                                                                  strict=True))


@pytest.fixture(scope="module")
def tier(jobs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {"cold": jobs["tier-cold"], "fresh": jobs["tier-fresh"]}


def test_precompiled_tier_serves_each_rank_its_own_groups_code(tier: dict[str, dict[str, Any]]) -> None:
    """One key for every rank, but torch bakes the tp group's name into the code: built once per tp group (the
    artifact names the groups it was built for; a rank of another group looks under the key naming its own), and a
    fresh job loads them all, compiling nothing, each rank all-reducing over its own tp group (x2: 6 and 14).
    The mesh function and the DTensor module alike: two functions, each built once per tp group."""
    for name in ("cold", "fresh"):
        job = tier[name]
        assert job["sums"] == [[6.0], [6.0], [14.0], [14.0]], name
        assert [metrics["precompile_fallbacks"] for metrics in job["metrics"]] == [{}] * RANKS, name
    assert tier["cold"]["report"]["total"]["lookups"]["precompiled"]["put"] == 4
    fresh = [metrics["lookups"] for metrics in tier["fresh"]["metrics"]]
    assert [(lookups["precompiled"]["miss"], lookups["fx"]["miss"] + lookups["fx"]["hit"]) for lookups in fresh] \
        == [(0, 0)] * RANKS, fresh
    assert [row["compiles"] for row in tier["fresh"]["report"]["ranks"]] == [0] * RANKS


def test_precompiled_tier_trains_a_dtensor_module_as_torch_does(
    tier: dict[str, dict[str, Any]], jobs: dict[str, dict[str, Any]]
) -> None:
    """A module parallelised as TorchTitan does it (``parallelize_module``, DTensor parameters): its losses in the
    tier's jobs are plain torchrun's, bit for bit, and differ between the tp groups (each dp rank draws its own
    inputs), so a rank running another group's code would not match (were it not to hang on that group)."""
    plain = jobs["plain"]["tp_losses"]
    assert plain[0] == plain[1] and plain[2] == plain[3] and plain[0] != plain[2], plain
    for name in ("cold", "fresh"):
        assert tier[name]["tp_losses"] == plain, name
