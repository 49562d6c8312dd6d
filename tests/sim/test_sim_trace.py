"""Trace replay (recorded event logs -> workload) and the fidelity comparison, on synthetic logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from recipecache.errors import ConfigError
from recipecache.sim import Costs, Scenario, build_workload, compare, simulate
from recipecache.sim.fidelity import measured_stall, replay

FETCH = 0.1
COSTS = Costs(fetch_latency_s=FETCH, artifact_mb=0.0)


def ev(rank: int, event: str, end: float, key: str = "", duration: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"time": end, "rank": rank, "key": key, "event": event, "duration": duration, **extra}


def write_trace(directory: Path, records: list[dict[str, Any]]) -> Path:
    """One file per rank, as ``EventLog.from_env`` names them."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in {r["rank"] for r in records}:
        lines = [json.dumps(r) for r in records if r["rank"] == rank]
        (directory / f"events-rank{rank}-{100 + rank}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def two_rank_run(directory: Path) -> Path:
    """A cold single-flight run of 3 steps: step 0 meets K1 (rank 0 compiles 2 s, rank 1
    waits), step 1 meets K2 (rank 1 compiles 1 s, rank 0 waits), step 2 meets nothing
    new; 0.5 s of compute per step; step events at the same instants on both ranks."""
    return write_trace(directory, [
        ev(0, "miss", 100.01, "K1", 0.01), ev(0, "compile", 102.01, "K1", 2.0), ev(0, "put", 102.02, "K1", 0.01),
        ev(0, "step", 102.52, step=0),
        ev(0, "miss", 102.53, "K2", 0.01), ev(0, "wait", 103.53, "K2", 1.0), ev(0, "step", 104.03, step=1),
        ev(0, "hit", 104.04, "K1", 0.01), ev(0, "step", 104.54, step=2),
        ev(1, "miss", 100.01, "K1", 0.01), ev(1, "wait", 102.02, "K1", 2.01), ev(1, "step", 102.52, step=0),
        ev(1, "miss", 102.53, "K2", 0.01), ev(1, "compile", 103.53, "K2", 1.0), ev(1, "put", 103.53, "K2", 0.0),
        ev(1, "step", 104.03, step=1),
        ev(1, "step", 104.54, step=2),
    ])


def test_step_events_group_keys_and_price_them_from_the_trace(tmp_path: Path) -> None:
    w = build_workload(Scenario(schedule="trace", trace=two_rank_run(tmp_path / "ev")))
    assert (w.ranks, w.steps, w.shapes) == (2, 3, 2)
    assert list(zip(w.step.tolist(), w.rank.tolist(), w.shape.tolist())) == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert w.compile_s.tolist() == pytest.approx([2.0, 1.0])
    assert w.fetch_s == pytest.approx(0.01)  # the median hit
    # each step: its span minus its store events, the least over ranks
    assert w.compute_s.tolist() == pytest.approx([0.5, 0.5, 0.5])


def test_replay_under_single_flight_reproduces_the_run(tmp_path: Path) -> None:
    report = simulate("singleflight", schedule="trace", trace=two_rank_run(tmp_path / "ev"))
    assert report.compile_events == 2 and report.wait_events == 2 and report.compile_delays == 2
    assert report.rank_stall_s == pytest.approx(2 * (2.0 + 1.0))
    assert report.stall_s == pytest.approx(2.0 + 1.0 + 2 * 0.01)  # each step: compile, the waiter fetches
    assert report.wall_s == pytest.approx(report.stall_s + 1.5)


def test_a_collective_wait_is_not_taken_for_compute(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "ev", [
        ev(0, "compile", 13.0, "A", 3.0), ev(0, "step", 13.5, step=0),
        ev(1, "hit", 10.0, "B", 0.0), ev(1, "step", 13.5, step=0),  # idle in the allreduce for 3 s
    ])
    w = build_workload(Scenario(schedule="trace", trace=trace))
    assert w.compute_s.tolist() == pytest.approx([0.5])


def test_a_rank_waits_mid_step_for_a_compile_in_flight(tmp_path: Path) -> None:
    """Rank 0 meets A then B in one step, rank 1 meets B at the start: costs A 2 s, B 3 s."""
    trace = write_trace(tmp_path / "ev", [
        ev(0, "compile", 2.0, "A", 2.0), ev(0, "compile", 5.0, "B", 3.0), ev(0, "step", 5.5, step=0),
        ev(1, "compile", 3.0, "B", 3.0), ev(1, "step", 5.5, step=0),
    ])
    reports = compare(scenario=Scenario(schedule="trace", trace=trace, costs=COSTS))
    # single-flight: rank 1 compiles B over [0, 3]; rank 0 reaches B at 2 and waits 1 s
    assert reports["singleflight"].stall_s == pytest.approx(3.0 + FETCH)
    assert reports["singleflight"].wait_s == pytest.approx(1.0)
    # shared: rank 0 compiles B again over [2, 5]
    assert reports["shared"].stall_s == pytest.approx(5.0)
    assert reports["shared"].wasted_compile_s == pytest.approx(3.0)
    assert reports["none"].stall_s == pytest.approx(5.0)
    assert reports["prewarm"].compile_delays == 0


def test_without_step_events_each_meeting_is_a_step(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "ev", [
        ev(0, "miss", 1.0, "A", 0.0), ev(0, "compile", 3.0, "A", 2.0), ev(0, "put", 3.0, "A", 0.0),
        ev(0, "miss", 4.0, "B", 0.0), ev(0, "compile", 5.0, "B", 1.0), ev(0, "hit", 7.0, "A", 0.5),
        ev(1, "miss", 1.0, "A", 0.0), ev(1, "wait", 3.0, "A", 2.0),
        ev(1, "miss", 4.0, "B", 0.0), ev(1, "wait", 5.0, "B", 1.0), ev(1, "hit", 7.0, "A", 0.5),
    ])
    w = build_workload(Scenario(schedule="trace", trace=trace))
    assert (w.steps, w.shapes) == (3, 2)
    assert w.compute_s.tolist() == pytest.approx([1.0, 1.5, 0.0])  # gaps between meetings; the last is unknown
    assert w.step.tolist() == [0, 0, 1, 1]  # the hit of A in step 2 is not a first meeting


def test_replication_predicts_more_ranks_from_a_small_run(tmp_path: Path) -> None:
    trace = two_rank_run(tmp_path / "ev")
    small = simulate("singleflight", schedule="trace", trace=trace)
    big = simulate("singleflight", schedule="trace", trace=trace, ranks=6)
    assert big.ranks == 6 and big.first_meetings == 3 * small.first_meetings
    assert big.compile_events == small.compile_events and big.wait_events == 5 * 2
    assert big.stall_s == pytest.approx(small.stall_s)
    assert simulate("none", schedule="trace", trace=trace, ranks=6).compile_events == 12


def test_steps_cut_the_replay_and_repeated_step_numbers_keep_counting(tmp_path: Path) -> None:
    cut = simulate(schedule="trace", trace=two_rank_run(tmp_path / "a"), steps=1)
    assert cut.compile_events == 1 and cut.shapes == 1  # keys met only later are not in the shape set
    trace = write_trace(tmp_path / "b", [
        ev(0, "compile", 1.0, "A", 1.0), ev(0, "step", 1.5, step=0),
        ev(0, "compile", 3.0, "B", 1.0), ev(0, "step", 3.5, step=0),  # a counter reset, e.g. per epoch
    ])
    assert build_workload(Scenario(schedule="trace", trace=trace)).steps == 2


def test_unusable_lines_are_skipped(tmp_path: Path) -> None:
    trace = two_rank_run(tmp_path / "ev")
    with open(trace / "events-rank0-100.jsonl", "a") as fh:
        fh.write(json.dumps({"event": "compile", "rank": 0, "key": "X"}) + "\n")  # no time
        fh.write('{"time": 105.0, "rank": 0, "key": "Y", "ev')  # torn last line
    assert build_workload(Scenario(schedule="trace", trace=trace)).shapes == 2


@pytest.mark.parametrize("setup", ["missing", "empty"])
def test_a_trace_without_events_is_a_config_error(tmp_path: Path, setup: str) -> None:
    if setup == "empty":
        (tmp_path / "ev").mkdir()
    with pytest.raises(ConfigError):
        simulate(schedule="trace", trace=tmp_path / "ev")


def test_fidelity_compares_the_report_with_the_replay(tmp_path: Path) -> None:
    trace = two_rank_run(tmp_path / "ev")
    (tmp_path / "report.json").write_text(json.dumps({"total": {"stall_s": 6.6}}))
    result = replay(trace, tmp_path / "report.json")
    assert result.measured_s == 6.6 and result.predicted_s == pytest.approx(6.0)
    assert result.relative_error == pytest.approx(0.6 / 6.6)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"total": {}}), json.dumps({"total": {"stall_s": "x"}})])
def test_a_bad_run_report_is_a_config_error(tmp_path: Path, content: str) -> None:
    (tmp_path / "report.json").write_text(content)
    with pytest.raises(ConfigError):
        measured_stall(tmp_path / "report.json")


def test_events_of_other_kinds_are_not_replayed(tmp_path: Path) -> None:
    """An HPU sync agent logs into the same directory under rank 0; its records must not become keys."""
    base = build_workload(Scenario(schedule="trace", trace=two_rank_run(tmp_path / "a")))
    noisy = two_rank_run(tmp_path / "b")
    with open(noisy / "events-rank0-100.jsonl", "a") as f:
        for t in (100.5, 101.5, 103.0):
            f.write(json.dumps(ev(0, "hpu_publish", t, "recipe-x", 0.2)) + "\n")
    w = build_workload(Scenario(schedule="trace", trace=noisy))
    assert (w.ranks, w.steps, w.shapes) == (base.ranks, base.steps, base.shapes)
    assert w.compute_s.tolist() == pytest.approx(base.compute_s.tolist())


# -- a run with --no-stall (policy no_stall) --------------------------------------------------
EAGER_CALL, COMPILED_STEP, SWITCH = 0.75, 0.5, 0.05


def no_stall_run(directory: Path, ranks: int = 2) -> Path:
    """A cold --no-stall run of 7 steps in the contract's records. Every step calls graph K.
    Step 0: each rank misses K, traces it (0.3 s, no record), runs it eager; rank 0 compiles
    it behind the steps (2.9 s, from 100.31 to 103.21, in step 3). Steps 1-3 run K eager
    (0.75 s a call, the whole step), step 4 switches (0.05 s) and runs compiled (0.5 s), as
    do steps 5-6."""
    records = []
    for rank in range(ranks):
        t = 100.0
        records += [ev(rank, "miss", t + 0.01, "K", 0.01)]
        if rank == 0:
            records += [ev(0, "compile_start", t + 0.31, "K", 0.0, behind=True),
                        ev(0, "compile", 103.21, "K", 2.9, behind=True), ev(0, "put", 103.21, "K", 0.0)]
        t += 0.31
        for step in range(4):
            t += EAGER_CALL
            records += [ev(rank, "eager", t, "K", EAGER_CALL), ev(rank, "step", t, step=step)]
        t += SWITCH
        records += [ev(rank, "switch", t, "K", SWITCH)]
        for step in range(4, 7):
            t += COMPILED_STEP
            records += [ev(rank, "step", t, step=step)]
    return write_trace(directory, records)


def test_a_no_stall_run_is_priced_as_compiled_steps_and_a_background_compile(tmp_path: Path) -> None:
    w = build_workload(Scenario(schedule="trace", trace=no_stall_run(tmp_path / "ev")))
    assert (w.ranks, w.steps, w.shapes) == (2, 7, 1)
    assert w.compile_s.tolist() == pytest.approx([2.9])  # the background compile's own seconds
    assert w.fetch_s == pytest.approx(SWITCH)
    assert w.eager_slowdown == pytest.approx(EAGER_CALL / COMPILED_STEP)  # eager-only steps over plain ones
    # eager steps count at what they would cost compiled; the background compile covers no step
    # (step 3 would lose the compile's 0.65 s in it otherwise); step 0 holds the trace, slowed too
    assert w.compute_s.tolist() == pytest.approx([(0.3 + EAGER_CALL) / 1.5] + [COMPILED_STEP] * 6)
    assert w.trace_s is not None and w.trace_s.tolist() == [0.0]  # dynamo's trace is inside step 0's compute
    calls = [(t, rank.tolist(), shape.tolist()) for t, rank, shape in w.calls()]
    assert calls == [(t, [0, 1], [0, 0]) for t in range(5)]  # met, run eager, switched


def test_behind_replays_a_no_stall_run(tmp_path: Path) -> None:
    trace = no_stall_run(tmp_path / "ev")
    r = simulate("no_stall", schedule="trace", trace=trace)
    # the compile lands 2.9 s after step 0 begins: steps 0-3 (1.05 + 3 * 0.75 s) run eager
    assert r.eager_steps == 2 * 4 and r.compile_events == 1 and r.wait_events == 0
    assert r.wall_s == pytest.approx(0.3 + 4 * EAGER_CALL + SWITCH + 3 * COMPILED_STEP)
    assert r.worst_step_s == pytest.approx(0.3 + EAGER_CALL)
    # single-flight on the same workload: rank 0 compiles K in step 0, rank 1 waits for it
    single = simulate("singleflight", schedule="trace", trace=trace)
    assert single.compile_events == 1 and single.wait_events == 1 and single.eager_steps == 0
    assert single.worst_step_s > r.worst_step_s


def test_fidelity_of_behind_counts_the_runs_eager_steps(tmp_path: Path) -> None:
    result = replay(no_stall_run(tmp_path / "ev"), policy="no_stall")
    assert result.measured_s == result.predicted_s == 8
    assert result.relative_error == 0 and "eager steps" in result.figure
    # with the compile pool: one graph, compiled by the rank that met it (nothing queued to hand): the same
    assert replay(tmp_path / "ev", policy="pool").predicted_s == 8
    with pytest.raises(ConfigError):
        replay(tmp_path / "ev", policy="none")
    with pytest.raises(ConfigError):
        replay(tmp_path / "ev")  # single-flight compares with the report, which is not named


def test_a_behind_field_that_is_no_boolean_is_a_damaged_record(tmp_path: Path) -> None:
    from recipecache.runs.events import Skipped, read_events

    trace = no_stall_run(tmp_path / "ev")
    with open(trace / "events-rank0-100.jsonl", "a") as fh:
        fh.write(json.dumps(ev(0, "compile", 105.0, "K", 50.0, behind="yes")) + "\n")
    skipped = Skipped()
    assert not any(r.get("behind") == "yes" for r in read_events(trace, skipped=skipped))
    assert skipped.records == 1
    assert build_workload(Scenario(schedule="trace", trace=trace)).compile_s.tolist() == pytest.approx([2.9])
