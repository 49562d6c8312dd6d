"""Policy pool (issue 47): a busy rank's queued compiles go to whichever rank's worker is free first; and the
scenario that needs it, shapes only rank 0 meets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recipecache.errors import ConfigError
from recipecache.sim import Costs, Scenario, build_workload, compare, simulate
from recipecache.sim.background import Workers
from recipecache.tools.cli import main

FETCH = 0.25
#: compiles of 10 s with nothing traced, so each is 10 s of a worker's time; a hand-off costs 0.5 + 0.25 s
TEN = Costs(compile_s=10.0, trace_s=0.0, compute_s=1.0, fetch_latency_s=FETCH, artifact_mb=0.0)
HANDOFF = TEN.pool_poll_s + FETCH


def test_rank_0s_four_compiles_are_split_between_the_two_workers() -> None:
    """2 ranks; rank 0 leads the shared shape and meets 3 of its own, all offered at 0 s: under no_stall its
    worker runs all 4 (40 s). Under pool rank 0's worker takes the first at 0 s, rank 1's the second at 0.75 s;
    the third goes to rank 0's (free at 10 s, before rank 1's at 10.75 + 0.75) and the fourth to rank 1's (free
    at 10.75, + 0.75 before rank 0's at 20): 20 s each, the last landing at 21.5 s, not 40."""
    reports = compare(("no_stall", "pool"), schedule="startup", ranks=2, shapes=1, rank0_shapes=3, steps=30,
                      costs=TEN)
    no_stall, pool = reports["no_stall"], reports["pool"]
    assert [x.compile_s for x in no_stall.per_rank] == [40.0, 0.0] and no_stall.compile_balance == 2.0
    assert [x.compile_s for x in pool.per_rank] == [20.0, 20.0] and pool.compile_balance == 1.0
    assert [x.compiles for x in pool.per_rank] == [2, 2] and pool.handoffs == 2 and no_stall.handoffs == 0
    assert pool.compile_s == no_stall.compile_s == 40.0
    # rank 0 runs eager until its last graph lands (step t lasts 1.5 s until then): 40 s against 21.5 s
    assert pool.eager_steps < no_stall.eager_steps and pool.wall_s < no_stall.wall_s


def test_a_job_of_one_rank_has_nobody_to_hand_to() -> None:
    reports = compare(("no_stall", "pool"), schedule="startup", ranks=1, shapes=4, rank0_shapes=2, steps=20,
                      costs=TEN)
    no_stall, pool = (reports[p].to_dict() for p in ("no_stall", "pool"))
    assert pool.pop("policy") == "pool" and no_stall.pop("policy") == "no_stall"
    assert pool == no_stall and pool["handoffs"] == 0


def test_on_a_warm_store_pool_is_no_stall() -> None:
    reports = compare(("no_stall", "pool"), ranks=8, shapes=12, steps=50, warm=True, costs=TEN)
    assert reports["pool"].compile_events == 0 and reports["pool"].wall_s == reports["no_stall"].wall_s
    assert reports["pool"].compile_balance is None and reports["pool"].tail_s == 0


@pytest.mark.parametrize("schedule", ["iid", "startup", "adversarial"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("ranks", "extra"), [(2, 0), (3, 3), (8, 2)])
def test_pool_costs_the_job_at_most_its_handoffs(schedule: str, seed: int, ranks: int, extra: int) -> None:
    """A compile is taken only when the taker starts it before its own worker could, so the job's steps and its
    last landing are never later than no_stall's by more than the hand-offs it paid (on these workloads)."""
    costs = Costs(compile_s=10.0, compile_spread=0.5, trace_s=2.0, compute_s=1.0, fetch_latency_s=FETCH,
                  artifact_mb=0.0)
    reports = compare(("no_stall", "pool"), schedule=schedule, ranks=ranks, shapes=6, seed=seed, costs=costs,
                      steps=None if schedule == "adversarial" else 40, rank0_shapes=extra)
    no_stall, pool = reports["no_stall"], reports["pool"]
    slack = pool.handoffs * (costs.pool_poll_s + costs.fetch_s) + 1e-9
    assert pool.wall_s <= no_stall.wall_s + slack
    assert pool.wall_s + pool.tail_s <= no_stall.wall_s + no_stall.tail_s + slack
    assert pool.compile_events == no_stall.compile_events and pool.compile_s == pytest.approx(no_stall.compile_s)
    assert pool.first_step_s == no_stall.first_step_s  # step 0's traces and eager compute: no compile lands in it


def test_the_worker_choice() -> None:
    """Own worker when it is free; else the one that starts first, another rank's paying the hand-off."""
    workers = Workers(3, handoff_s=1.0)
    assert workers.take(0, 0.0, 10.0) == 10.0  # rank 0's own, free
    assert workers.take(0, 2.0, 10.0) == 13.0  # rank 0 busy until 10: rank 1 starts at 2 + 1
    assert workers.take(0, 2.0, 10.0) == 13.0  # rank 2 likewise
    assert workers.take(0, 9.5, 5.0) == 15.0  # own free at 10, before any other (13 + 1)
    assert workers.compile_s.tolist() == [15.0, 10.0, 10.0] and workers.handoffs == 2
    alone = Workers(3, handoff_s=None)  # no_stall: a queue per rank
    assert [alone.take(0, 0.0, 10.0) for _ in range(3)] == [10.0, 20.0, 30.0]
    assert alone.compile_s.tolist() == [30.0, 0.0, 0.0]


def test_shapes_only_rank_0_meets() -> None:
    """They come after the schedule's shapes, met by rank 0 at step 0 and called by it every step; the schedule's
    shapes keep their compile times."""
    costs = Costs(compile_spread=0.5)
    plain = build_workload(Scenario(schedule="startup", ranks=3, shapes=4, steps=5, costs=costs))
    w = build_workload(Scenario(schedule="startup", ranks=3, shapes=4, steps=5, costs=costs, rank0_shapes=2))
    assert w.shapes == 6 and np.array_equal(w.compile_s[:4], plain.compile_s) and len(w.compile_s) == 6
    own = (w.shape >= 4)
    assert w.rank[own].tolist() == [0, 0] and w.step[own].tolist() == [0, 0] and w.shape[own].tolist() == [4, 5]
    assert w.rank.tolist() == sorted(w.rank.tolist()) and len(w.step) == len(plain.step) + 2
    assert w.calls is not None
    steps = list(w.calls())
    assert [t for t, _, _ in steps] == [0, 1, 2, 3, 4]
    for _, rank, shape in steps:
        assert rank.tolist() == [0] * 6 + [1] * 4 + [2] * 4 and shape[:6].tolist() == [0, 1, 2, 3, 4, 5]
    iid = build_workload(Scenario(ranks=4, shapes=5, steps=30, seed=3, rank0_shapes=1))
    assert iid.shapes == 6 and set(iid.rank[iid.shape == 5].tolist()) == {0}
    assert simulate("singleflight", ranks=4, shapes=5, steps=30, seed=3, rank0_shapes=1).compile_events == 6


@pytest.mark.parametrize("make", [
    lambda: Scenario(rank0_shapes=-1),
    lambda: Scenario(rank0_shapes=(1 << 20) + 1),
    lambda: Scenario(schedule="trace", trace="events", rank0_shapes=2),
    lambda: Costs(pool_poll_s=-0.5),
    lambda: Costs(pool_poll_s=float("nan")),
])
def test_bad_pool_scenarios_are_one_line_config_errors(make) -> None:
    with pytest.raises(ConfigError) as raised:
        make()
    assert "\n" not in str(raised.value)


def test_the_cli_runs_pool(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sim", "--schedule", "startup", "--ranks", "2", "--shapes", "1", "--rank0-shapes", "3", "--steps", "30",
                 "--compile-s", "10", "--trace-s", "0", "--artifact-mb", "0", "--fetch-latency-s", "0.25",
                 "--pool-poll-s", "0.5", "--policy", "pool", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["policy"] == "pool" and data["handoffs"] == 2 and data["compile_balance"] == 1.0
    assert [x["compile_s"] for x in data["per_rank"]] == [20.0, 20.0]
    assert main(["sim", "--rank0-shapes", "-1"]) == 2
    assert "--rank0-shapes" in capsys.readouterr().err
