"""``recipecache sim`` through the real ``recipecache`` main."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sim_trace import two_rank_run

from recipecache.tools.cli import main


def sim(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["sim", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_of_one_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = sim(capsys, "--schedule", "adversarial", "--ranks", "3", "--shapes", "4", "--policy", "none",
                       "--json")
    data = json.loads(out)
    assert code == 0
    assert data["policy"] == "none" and data["compile_delays"] == 3 * 3 + 1 == data["worst_case_delays"]


def test_compare_runs_every_policy_with_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = sim(capsys, "--ranks", "4", "--shapes", "6", "--steps", "60", "--compare", "--json",
                       "--compile-s", "5", "--compile-spread", "0.3", "--bandwidth", "100", "--artifact-mb", "5")
    data = json.loads(out)
    assert code == 0 and list(data["policies"]) == ["none", "shared", "singleflight", "prewarm", "no_stall", "pool"]
    assert data["vs_none"]["none"]["stall_s"] == 1.0
    assert data["vs_none"]["singleflight"]["stall_s"] < 1.0
    no_stall = data["policies"]["no_stall"]
    assert no_stall["wait_events"] == 0 and no_stall["compile_delays"] == 0 and no_stall["eager_steps"] > 0
    assert no_stall["worst_step_s"] < data["policies"]["singleflight"]["worst_step_s"]
    assert data["policies"]["shared"]["first_meetings"] == data["policies"]["none"]["first_meetings"]  # one workload


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = sim(capsys, "--schedule", "adversarial", "--ranks", "2", "--shapes", "3", "--compare")
    lines = out.splitlines()
    assert code == 0 and "worst case N*(S-1)+1 = 5" in lines[0]
    assert lines[1].split()[0] == "policy" and lines[1].split()[-1] == "stall/none"
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"none", "shared", "singleflight", "prewarm", "no_stall", "pool"}
    assert rows["none"][2] == "5" and rows["shared"][2] == "3" and rows["none"][-1] == "1.000"
    assert rows["no_stall"][2] == "0", "no-stall delays no step for a compile"
    assert lines[1].split()[9:11] == ["worst_s", "eager"]


def test_trace_replay(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = two_rank_run(tmp_path / "ev")
    code, out, _ = sim(capsys, "--schedule", "trace", "--trace", str(trace), "--json")
    assert code == 0 and json.loads(out)["compile_events"] == 2


def test_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "stall.png"
    code, out, _ = sim(capsys, "--ranks", "4", "--shapes", "4", "--steps", "30", "--plot", str(target))
    assert code == 0 and f"plot: {target}" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [
    ["--ranks", "-1"],
    ["--steps", "-5"],
    ["--schedule", "trace"],
    ["--schedule", "trace", "--trace", "/no/such/dir"],
    ["--weights", "1,x"],
    ["--bandwidth", "0"],
    ["--weights", "1,2", "--plot", "x.png"],
    ["--policy", "no_stall", "--eager-slowdown", "0.5"],
    ["--policy", "no_stall", "--no-stall-cpu-share", "1"],
    ["--policy", "no_stall", "--no-stall-cpu-share", "-0.1"],
    ["--policy", "no_stall", "--trace-s", "inf"],
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = sim(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("recipecache: error: ") and err.count("\n") == 1


def test_plot_refuses_a_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = two_rank_run(tmp_path / "ev")
    code, _, err = sim(capsys, "--schedule", "trace", "--trace", str(trace), "--plot", str(tmp_path / "p.png"))
    assert code == 2 and "trace fixes" in err


def test_the_old_names_of_the_no_stall_policy_still_work_and_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    """``behind`` and ``--behind-cpu-share``, its names before it was named after the feature, run ``no_stall``."""
    code, out, err = sim(capsys, "--schedule", "adversarial", "--ranks", "2", "--shapes", "3", "--policy", "behind",
                         "--behind-cpu-share", "0.5", "--json")
    new_code, new_out, _ = sim(capsys, "--schedule", "adversarial", "--ranks", "2", "--shapes", "3", "--policy",
                               "no_stall", "--no-stall-cpu-share", "0.5", "--json")
    assert code == new_code == 0 and json.loads(out) == json.loads(new_out)
    assert json.loads(out)["policy"] == "no_stall"
    assert "--policy behind is deprecated; use no_stall" in err
