"""The simulator's engine and synthetic schedules against closed forms and invariants."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from recipecache.errors import ConfigError
from recipecache.sim import POLICIES, Costs, Scenario, build_workload, compare, run_policy, simulate
from recipecache.sim.schedules import _fold_first_meetings, shape_weights

COMPILE, FETCH = 10.0, 0.25
#: the policies where a rank that meets a shape not in memory stalls until it has the artifact
STALLING = ("none", "shared", "singleflight", "prewarm")
FIXED = Costs(compile_s=COMPILE, compute_s=1.0, fetch_latency_s=FETCH, artifact_mb=0.0)


@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("shapes", [1, 2, 5, 17])
def test_adversarial_matches_the_closed_forms(ranks: int, shapes: int) -> None:
    reports = compare(schedule="adversarial", ranks=ranks, shapes=shapes, costs=FIXED)
    none, shared, single, prewarm = (reports[p] for p in STALLING)
    worst = ranks * (shapes - 1) + 1
    assert none.steps == worst and none.worst_case_delays == worst
    assert none.compile_delays == worst
    assert none.compile_events == ranks * shapes
    assert none.stall_s == pytest.approx(worst * COMPILE)

    assert shared.compile_delays == single.compile_delays == shapes
    # step 0: every rank meets shape 0 at once; shared compiles it N times, single-flight once
    assert shared.compile_events == ranks + shapes - 1
    assert shared.wasted_compile_s == pytest.approx((ranks - 1) * COMPILE)
    assert single.compile_events == shapes and single.wasted_compile_s == 0
    assert single.wait_events == ranks - 1
    later_fetches = (ranks - 1) * (shapes - 1)
    assert shared.stall_s == pytest.approx(shapes * COMPILE + later_fetches * FETCH)
    # the waiters of step 0 wait as long as the compile, then fetch: lockstep makes
    # single-flight no faster than shared, only cheaper in compile work
    assert single.stall_s == pytest.approx(shapes * COMPILE + later_fetches * FETCH + (FETCH if ranks > 1 else 0))

    assert prewarm.compile_delays == 0 and prewarm.compile_events == shapes
    assert prewarm.prewarm_s == pytest.approx(math.ceil(shapes / ranks) * COMPILE)
    for r in reports.values():
        assert r.stall_s == pytest.approx(r.wall_s - r.compute_s)
        assert r.compute_s == pytest.approx(r.steps * FIXED.compute_s)


def test_adversarial_steps_cut_the_schedule_or_pad_it_with_known_shapes() -> None:
    short = simulate("none", schedule="adversarial", ranks=4, shapes=5, steps=7, costs=FIXED)
    assert short.compile_delays == 7 and short.steps == 7
    long = simulate("none", schedule="adversarial", ranks=4, shapes=5, steps=100, costs=FIXED)
    assert long.compile_delays == 4 * 4 + 1
    assert long.wall_s == pytest.approx(100 * FIXED.compute_s + long.compile_delays * COMPILE)


@pytest.fixture(scope="module")
def iid() -> dict:
    costs = Costs(compile_s=10.0, compile_spread=0.5, compute_s=0.5, fetch_latency_s=0.05, artifact_mb=10.0)
    scenario = Scenario(ranks=16, shapes=50, steps=300, seed=7, costs=costs)
    workload = build_workload(scenario)
    return {"workload": workload, "reports": {p: run_policy(workload, p) for p in POLICIES}}


def test_iid_invariants(iid: dict) -> None:
    w, reports = iid["workload"], iid["reports"]
    none, shared, single, prewarm = (reports[p] for p in STALLING)
    met_shapes = len(set(w.shape.tolist()))
    assert none.compile_events == none.first_meetings == len(w.step)
    assert single.compile_events == met_shapes and single.wasted_compile_s == 0
    assert shared.compile_events > met_shapes and shared.wasted_compile_s > 0
    assert shared.compile_delays == single.compile_delays < none.compile_delays
    assert none.stall_s > 5 * single.stall_s
    # shared and single-flight differ only where ranks tie on a new shape: the waiter's fetch
    assert 0 < single.stall_s - shared.stall_s <= single.compile_delays * w.fetch_s + 1e-9
    assert prewarm.compile_delays == 0 and prewarm.compile_events == w.shapes
    for r in (reports[p] for p in STALLING):
        assert r.stall_s == pytest.approx(r.wall_s - r.compute_s)
        assert sum(x.compiles for x in r.per_rank) == r.compile_events
        assert sum(x.wait_s for x in r.per_rank) == pytest.approx(r.wait_s)
        assert r.rank_stall_s == pytest.approx(r.compile_s + r.wait_s)
    # every first meeting is a compile or a fetch (a waiter fetches after its wait); under
    # prewarm a rank already holds the shapes it compiled up front
    for r in (none, shared, single):
        assert r.compile_events + r.fetch_events == r.first_meetings
    owned = int(np.count_nonzero(w.shape % w.ranks == w.rank))
    assert prewarm.fetch_events == prewarm.first_meetings - owned


def test_iid_meets_shapes_in_first_meeting_order(iid: dict) -> None:
    w = iid["workload"]
    pairs = list(zip(w.rank.tolist(), w.shape.tolist()))
    assert len(pairs) == len(set(pairs))
    assert np.all(np.diff(w.step) >= 0)
    assert np.all((w.step >= 0) & (w.step < w.steps))
    same_step = np.diff(w.step) == 0
    assert np.all(np.diff(w.rank)[same_step] > 0)  # one shape per rank per step, in rank order


def test_iid_is_deterministic_per_seed() -> None:
    a = simulate(ranks=4, shapes=8, steps=50, seed=3, costs=Costs(compile_spread=0.3)).to_dict()
    b = simulate(ranks=4, shapes=8, steps=50, seed=3, costs=Costs(compile_spread=0.3)).to_dict()
    c = simulate(ranks=4, shapes=8, steps=50, seed=4, costs=Costs(compile_spread=0.3)).to_dict()
    assert a == b and a != c


def test_one_rank_gains_nothing_from_sharing() -> None:
    reports = compare(["none", "shared", "singleflight"], ranks=1, shapes=20, steps=200, seed=1)
    stalls = {r.stall_s for r in reports.values()}
    events = {r.compile_events for r in reports.values()}
    assert len(stalls) == 1 and len(events) == 1


def test_fold_first_meetings_matches_a_plain_loop() -> None:
    rng = np.random.default_rng(0)
    ranks, shapes, steps = 5, 7, 40
    draws = rng.integers(0, shapes, size=(steps, ranks))
    first = np.full(ranks * shapes, np.iinfo(np.int64).max)
    for start in range(0, steps, 13):  # in batches, as the schedule draws them
        _fold_first_meetings(draws[start:start + 13], first, start * ranks)
    expected: dict[int, int] = {}
    for t in range(steps):
        for r in range(ranks):
            expected.setdefault(r * shapes + int(draws[t, r]), t * ranks + r)
    got = {code: int(cell) for code, cell in enumerate(first) if cell != np.iinfo(np.int64).max}
    assert got == expected


def test_weights_choose_the_shapes() -> None:
    w = build_workload(Scenario(weights=(1.0, 0.0, 3.0), ranks=4, steps=100))
    assert w.shapes == 3 and set(w.shape.tolist()) == {0, 2}
    zipf = shape_weights(Scenario(), 5)
    assert zipf.sum() == pytest.approx(1.0) and np.all(np.diff(zipf) < 0)
    assert np.allclose(shape_weights(Scenario(distribution="uniform"), 4), 0.25)
    # issue 28: weights near the float limit summed to inf, and each became probability 0
    assert np.allclose(shape_weights(Scenario(weights=(1e308, 1e308, 0.0)), 3), [0.5, 0.5, 0.0])


def test_costs() -> None:
    assert Costs(fetch_latency_s=0.01, artifact_mb=50, bandwidth_mb_s=100).fetch_s == pytest.approx(0.51)
    spread = Costs(compile_s=30.0, compile_spread=0.4).compile_times(2001, np.random.default_rng(0))
    assert np.median(spread) == pytest.approx(30.0, rel=0.05) and spread.std() > 5
    # compile times come from their own random stream: the schedule does not move them
    iid = build_workload(Scenario(shapes=6, seed=2, costs=Costs(compile_spread=0.5)))
    adv = build_workload(Scenario(schedule="adversarial", shapes=6, seed=2, costs=Costs(compile_spread=0.5)))
    assert np.array_equal(iid.compile_s, adv.compile_s)


@pytest.mark.parametrize("make", [
    lambda: Scenario(ranks=0),
    lambda: Scenario(ranks=-2),
    lambda: Scenario(shapes=0),
    lambda: Scenario(steps=-1),
    lambda: Scenario(seed=-1),  # issue 34: numpy raised ValueError
    lambda: Scenario(schedule="trace"),
    lambda: Scenario(schedule="bogus"),
    lambda: Scenario(weights=(1.0, 2.0), shapes=3),
    lambda: Scenario(weights=(0.0, 0.0)),
    lambda: Scenario(schedule="adversarial", weights=(1.0,)),
    lambda: Costs(compile_s=-1.0),
    lambda: Costs(bandwidth_mb_s=0.0),
    lambda: Costs(compute_s=math.nan),
    lambda: Costs(compile_s=1e308),  # issue 34: sums overflowed to inf, and the engine raised IndexError
    lambda: simulate("bogus"),
])
def test_bad_input_is_a_config_error(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_report_is_json_serialisable() -> None:
    report = simulate("prewarm", ranks=3, shapes=4, steps=20)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["policy"] == "prewarm" and len(data["per_rank"]) == 3
    assert data["compile_events"] == report.compile_events


def test_sim_does_not_import_torch() -> None:
    code = ("import sys, recipecache.sim; recipecache.sim.simulate(ranks=2, shapes=2, steps=5); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- contention and the node tier ---------------------------------------------------------
HERD = Costs(compile_s=10.0, compute_s=0.0, fetch_latency_s=0.0, artifact_mb=100.0, bandwidth_mb_s=500.0,
             store_mb_s=1000.0, local_mb_s=2000.0)


def test_link_shares_its_bandwidth_among_transfers_in_flight() -> None:
    from recipecache.sim.parts import Link

    link = Link(100.0, math.inf)
    link.add(0.0, 100.0, 1)  # alone for 0.5 s (50 MB), then shares with the second
    link.add(0.5, 100.0, 2)
    assert link.next_end() == pytest.approx(1.5) and link.pop(1.5) == 1
    assert link.next_end() == pytest.approx(2.0) and link.pop(2.0) == 2
    capped = Link(1000.0, 10.0)
    capped.add(0.0, 5.0, 3)
    assert capped.next_end() == pytest.approx(0.5), "one transfer never exceeds its own cap"


@pytest.mark.parametrize("ranks", [1, 2, 16, 64])
def test_job_start_herd_is_bound_by_the_store(ranks: int) -> None:
    report = simulate("singleflight", schedule="startup", ranks=ranks, shapes=3, warm=True, costs=HERD)
    transfer = ranks * 3 * HERD.artifact_mb / min(HERD.store_mb_s, ranks * HERD.bandwidth_mb_s)
    assert report.stall_s == pytest.approx(transfer)
    assert report.compile_events == 0 and report.remote_fetches == report.fetch_events == ranks * 3
    assert report.remote_mb == pytest.approx(ranks * 3 * HERD.artifact_mb)


def test_node_tier_fetches_once_per_node_and_shape() -> None:
    ranks, per_node, shapes = 64, 8, 3
    without = simulate("singleflight", schedule="startup", ranks=ranks, shapes=shapes, warm=True, costs=HERD)
    tier = simulate("singleflight", schedule="startup", ranks=ranks, shapes=shapes, warm=True, costs=HERD,
                    node_tier=True, ranks_per_node=per_node)
    nodes = ranks // per_node
    assert tier.remote_fetches == nodes * shapes and tier.node_reads == (ranks - nodes) * shapes
    assert tier.fetch_events == without.fetch_events == ranks * shapes
    # the nodes' fetches share the store, then the last shape's copy is read
    assert tier.stall_s == pytest.approx(nodes * shapes * HERD.artifact_mb / HERD.store_mb_s
                                         + HERD.artifact_mb / HERD.local_mb_s)
    assert without.stall_s / tier.stall_s > 7


def test_node_tier_on_a_cold_store_compiles_once_and_never_fetches_what_the_node_built() -> None:
    report = simulate("singleflight", schedule="startup", ranks=16, shapes=2, costs=HERD, node_tier=True,
                      ranks_per_node=8)
    assert report.compile_events == 2 and report.wasted_compile_s == 0
    assert report.remote_fetches == 2, "the compiler's node reads its copy; the other node fetches each shape once"
    assert report.node_reads == 16 * 2 - 2 - 2


def test_colocated_nodes_share_the_hosts_bandwidth_with_the_store() -> None:
    report = simulate("singleflight", schedule="startup", ranks=16, shapes=2, warm=True, costs=HERD, node_tier=True,
                      ranks_per_node=8, colocated=True)
    work_mb = 2 * 2 * HERD.artifact_mb + 14 * 2 * HERD.artifact_mb * HERD.store_mb_s / HERD.local_mb_s
    assert report.stall_s == pytest.approx(work_mb / HERD.store_mb_s)


# -- policy no_stall: ranks keep training while a graph compiles behind them -----------------
def no_stall_costs(**changes: float) -> Costs:
    fields = dict(compile_s=10.0, trace_s=2.0, compute_s=1.0, eager_slowdown=1.5, fetch_latency_s=FETCH,
                  artifact_mb=0.0)
    return Costs(**{**fields, **changes})


@pytest.mark.parametrize(("compile_s", "trace_s", "slowdown", "eager_steps"), [
    (10.0, 2.0, 1.5, 6),   # the compile lands 8 s after the trace, during step 5 (steps 1.5 s each)
    (10.0, 0.5, 2.0, 5),
    (3.0, 3.0, 1.2, 1),    # all trace: compiled from the next step on
    (40.0, 2.0, 1.0, 38),  # eager as fast as compiled: only the trace costs
])
def test_behind_runs_eager_until_the_compile_lands(compile_s: float, trace_s: float, slowdown: float,
                                                   eager_steps: int) -> None:
    """Every rank calls one shape each step: step 0 traces it, the lower rank compiles the
    rest behind the steps, every step until it lands runs eager, then each rank switches
    (one fetch) and runs compiled."""
    ranks, steps = 3, 60
    costs = no_stall_costs(compile_s=compile_s, trace_s=trace_s, eager_slowdown=slowdown)
    r = simulate("no_stall", weights=(1.0,), ranks=ranks, steps=steps, costs=costs)
    assert r.eager_steps == ranks * eager_steps
    assert r.compile_events == 1 and r.per_rank[0].compiles == 1 and r.compile_s == pytest.approx(compile_s - trace_s)
    assert r.fetch_events == ranks and r.trace_s == pytest.approx(ranks * trace_s)
    wall = trace_s + eager_steps * slowdown + FETCH + (steps - eager_steps) * 1.0
    assert r.wall_s == pytest.approx(wall) and r.stall_s == pytest.approx(wall - steps)
    assert r.worst_step_s == pytest.approx(max(trace_s + slowdown, 1.0 + FETCH))


def test_behind_stalls_no_rank_for_a_compile() -> None:
    costs = no_stall_costs(compile_spread=0.5, compute_s=0.5)
    workload = build_workload(Scenario(ranks=16, shapes=50, steps=300, seed=7, costs=costs))
    no_stall, single = run_policy(workload, "no_stall"), run_policy(workload, "singleflight")
    assert no_stall.wait_events == 0 and no_stall.wait_s == 0 and no_stall.compile_delays == 0
    assert no_stall.compile_events == len(set(workload.shape.tolist())) and no_stall.wasted_compile_s == 0
    assert no_stall.rank_stall_s == pytest.approx(no_stall.trace_s)
    assert no_stall.trace_s < single.rank_stall_s
    # one shape per rank per step: a step costs at most one trace (or one fetch) and an eager compute
    longest_trace = float(costs.trace_times(workload.compile_s).max())
    assert no_stall.worst_step_s <= max(longest_trace, FETCH) + costs.compute_s * costs.eager_slowdown + 1e-9
    assert single.worst_step_s >= float(workload.compile_s.min()) + costs.compute_s
    assert no_stall.stall_s < single.stall_s
    assert no_stall.stall_s == pytest.approx(no_stall.wall_s - no_stall.compute_s)
    assert sum(x.compiles for x in no_stall.per_rank) == no_stall.compile_events


def test_behind_with_a_cpu_share_slows_the_steps_while_it_compiles() -> None:
    """Half the CPU to the compile over [2, 10]: step 0 computes 1.5 s of eager work in 3 s,
    step 1 in 3 s, step 2 does 1 s of it by 10 (in 2 s) and the rest at full speed."""
    free = simulate("no_stall", weights=(1.0,), ranks=2, steps=20, costs=no_stall_costs())
    shared = simulate("no_stall", weights=(1.0,), ranks=2, steps=20, costs=no_stall_costs(no_stall_cpu_share=0.5))
    assert shared.wall_s == pytest.approx(2.0 + 3.0 + 3.0 + 2.5 + (1.0 + FETCH) + 16 * 1.0)
    assert shared.wall_s > free.wall_s and shared.eager_steps == 2 * 3
    assert shared.compile_events == free.compile_events == 1 and shared.wait_events == 0


def test_behind_on_a_warm_store_only_fetches_as_single_flight_does() -> None:
    costs = no_stall_costs(artifact_mb=50.0, bandwidth_mb_s=200.0, store_mb_s=400.0)
    reports = compare(["singleflight", "no_stall"], ranks=8, shapes=12, steps=100, warm=True, costs=costs)
    single, no_stall = reports["singleflight"], reports["no_stall"]
    assert no_stall.compile_events == no_stall.eager_steps == 0 and no_stall.trace_s == 0
    assert no_stall.fetch_events == single.fetch_events
    assert no_stall.stall_s == pytest.approx(single.stall_s)


def test_behind_at_job_start_compiles_each_shape_once_and_traces_it_everywhere() -> None:
    """Schedule startup: every rank meets all shapes in step 0 and calls them every step."""
    shapes, ranks = 3, 4
    r = simulate("no_stall", schedule="startup", ranks=ranks, shapes=shapes, steps=30, costs=no_stall_costs())
    assert r.compile_events == shapes and r.trace_s == pytest.approx(ranks * shapes * 2.0)
    # rank 0's traces end at 2, 4, 6 s, so it leads all three; its one worker compiles them one after
    # the other: they land at 10, 18, 26 s. Step 0 lasts 6 + 1.5 s, steps 1-2 1.5 s, step 3 (10.5 s)
    # switches shape 0 (+ a fetch), steps 4-7 eager, step 8 (18.25 s) switches shape 1, steps 9-12
    # eager, step 13 begins at 26 s and switches the last
    assert r.eager_steps == ranks * 13 and r.fetch_events == ranks * shapes
    assert r.per_rank[0].compiles == shapes and r.handoffs == 0 and r.compile_balance == pytest.approx(ranks)
    assert r.wall_s == pytest.approx(7.5 + 2 * 1.5 + (FETCH + 1.5) + 4 * 1.5 + (FETCH + 1.5) + 4 * 1.5
                                     + (FETCH + 1.0) + 16 * 1.0)
    assert r.worst_step_s == pytest.approx(shapes * 2.0 + 1.5) and r.first_step_s == pytest.approx(7.5)
    assert r.tail_s == 0


def test_pool_at_job_start_hands_the_queued_compiles_to_idle_workers() -> None:
    """The same job under pool: shape 0 goes to rank 0's own worker at 2 s; shapes 1 and 2, offered at 4 and
    6 s while it is busy, go to ranks 1 and 2, which start them a hand-off (poll + fetch) later and land them
    at 12.75 and 14.75 s. Steps 3 and 5 switch shapes 0 and 1 (+ a fetch each), step 6 (15.5 s) the last."""
    shapes, ranks = 3, 4
    r = simulate("pool", schedule="startup", ranks=ranks, shapes=shapes, steps=30, costs=no_stall_costs())
    handoff = no_stall_costs().pool_poll_s + FETCH
    assert handoff == pytest.approx(0.75)
    assert r.policy == "pool" and r.compile_events == shapes and r.handoffs == 2
    assert [x.compiles for x in r.per_rank] == [1, 1, 1, 0]
    assert [x.compile_s for x in r.per_rank] == pytest.approx([8.0, 8.0, 8.0, 0.0])
    assert r.compile_balance == pytest.approx(8.0 / (24.0 / ranks))
    assert r.eager_steps == ranks * 6 and r.fetch_events == ranks * shapes
    assert r.wall_s == pytest.approx(7.5 + 2 * 1.5 + (FETCH + 1.5) + 1.5 + (FETCH + 1.5) + (FETCH + 1.0) + 23 * 1.0)


def test_worst_step_of_the_stalling_policies() -> None:
    reports = compare(STALLING, schedule="adversarial", ranks=3, shapes=4, costs=FIXED)
    assert reports["none"].worst_step_s == pytest.approx(COMPILE + FIXED.compute_s)
    assert reports["singleflight"].worst_step_s == pytest.approx(COMPILE + FETCH + FIXED.compute_s)
    assert reports["prewarm"].worst_step_s == pytest.approx(FETCH + FIXED.compute_s)


@pytest.mark.parametrize("make", [
    lambda: Costs(eager_slowdown=0.9),
    lambda: Costs(no_stall_cpu_share=1.0),
    lambda: Costs(no_stall_cpu_share=-0.5),
    lambda: Costs(trace_s=math.inf),
])
def test_bad_behind_costs_are_config_errors(make) -> None:
    with pytest.raises(ConfigError):
        make()
