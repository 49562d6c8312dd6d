"""Every number a user types into recipecache-run, fuzzed: one rule (ASCII digits, a point where fractions make
sense, bounds), and for anything else exit 2 with one line naming the option or variable, never a traceback.

Issue 44: ``--threads ²`` and the like ended in a traceback (``str.isdigit()`` takes ``²``, ``int()`` does not),
while ``٣``, ``+3``, ``1_0`` or `` 3`` were taken by one reader and read otherwise, or refused, by the next.
The fuzz runs the launcher's ``main`` in this process (torchrun is never started: a value it accepts is recorded
instead); a few representative cases run the installed ``recipecache-run`` as users do.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_launcher import script  # noqa: F401 - the fixture

from launcher import main as launcher_main
from launcher.launch_config import LaunchConfig

#: not a number by the rule, for any option or variable
NOT_NUMBERS = ["²", "٣", "３", "+3", "-3", "1e3", "1_0", " ", " 3", "3 ", "0x3", "9" * 400, "nan", "inf", "3,5"]
#: a whole-number option refuses a fraction too
NOT_WHOLE = [*NOT_NUMBERS, "3.5"]

WHOLE_OPTIONS = ["--nproc", "--threads", "--hpu-max-size-mb", "--nnodes", "--max-restarts", "--node-rank",
                 "--master-port", "--shutdown-timeout"]
SECONDS_OPTIONS = ["--exit-grace", "--monitor-interval"]
WHOLE_VARIABLES = ["RECIPECACHE_THREADS", "OMP_NUM_THREADS", "PET_NPROC_PER_NODE", "RECIPECACHE_HPU_MAX_SIZE_MB",
                   "PET_MAX_RESTARTS", "PET_MASTER_PORT", "PET_NODE_RANK"]
SECONDS_VARIABLES = ["RECIPECACHE_EXIT_GRACE", "RECIPECACHE_WAIT_TIMEOUT", "RECIPECACHE_LEASE_TTL",
                     "RECIPECACHE_NO_STALL_TIMEOUT", "RECIPECACHE_BEHIND_TIMEOUT", "PET_MONITOR_INTERVAL"]
SIZE_VARIABLES = ["RECIPECACHE_NODE_MAX_SIZE"]
#: numbers inside torchrun's forms (MIN:MAX, LOCAL_RANK:N)
FORMS = [("--nnodes", "1:٣"), ("--nnodes", "٣"), ("--tee", "٣:1"), ("--redirects", "1:1,٣:2")]
#: the spelling torchrun's errors name an option by, where it is not the long one
SHOWN_AS = {"--tee": "-t", "--redirects": "-r"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith(("RECIPECACHE_", "PET_")) or name == "OMP_NUM_THREADS":
            monkeypatch.delenv(name)
    monkeypatch.setenv("RECIPECACHE_DIR", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)


class Launched(Exception):
    """The launcher accepted the command line and would have started torchrun."""

    def __init__(self, config: LaunchConfig) -> None:
        super().__init__("accepted")
        self.config = config


def _launch(config: LaunchConfig) -> int:
    raise Launched(config)


def run(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str | LaunchConfig:
    """recipecache-run's ``main`` on ``argv``: the one error line, or the config it would have launched."""
    monkeypatch.setattr(launcher_main, "launch", _launch)
    try:
        status = launcher_main.main(argv)
    except Launched as accepted:
        return accepted.config
    captured = capsys.readouterr()
    assert status == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("recipecache-run: error: "), lines[0]
    return lines[0]


def with_hpu(name: str, tmp_path: Path) -> list[str]:
    return ["--hpu", "--hpu-dir", str(tmp_path / "recipes")] if "HPU" in name.upper() else []


def option_cases() -> list[tuple[str, str]]:
    return [(o, v) for o in WHOLE_OPTIONS for v in [*NOT_WHOLE, ""]] + [
        (o, v) for o in SECONDS_OPTIONS for v in [*NOT_NUMBERS, ""]] + FORMS


def variable_cases() -> list[tuple[str, str]]:
    return ([(n, v) for n in WHOLE_VARIABLES for v in NOT_WHOLE]
            + [(n, v) for n in [*SECONDS_VARIABLES, *SIZE_VARIABLES] for v in NOT_NUMBERS])


@pytest.mark.parametrize(("option", "value"), option_cases(), ids=repr)
def test_an_option_that_is_no_number_by_the_rule_is_one_line(option: str, value: str, script: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    line = run([*with_hpu(option, tmp_path), f"{option}={value}", str(script)], monkeypatch, capsys)
    assert isinstance(line, str), f"{option}={value!r} was accepted"
    assert SHOWN_AS.get(option, option) in line


@pytest.mark.parametrize(("name", "value"), variable_cases(), ids=repr)
def test_a_variable_that_is_no_number_by_the_rule_is_one_line(name: str, value: str, script: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(name, value)
    line = run([*with_hpu(name, tmp_path), str(script)], monkeypatch, capsys)
    assert isinstance(line, str), f"{name}={value!r} was accepted"
    assert name in line


@pytest.mark.parametrize("name", [*WHOLE_OPTIONS, *SECONDS_OPTIONS, *WHOLE_VARIABLES, *SECONDS_VARIABLES,
                                  *SIZE_VARIABLES])
def test_a_number_by_the_rule_is_taken_as_an_option_and_as_a_variable(name: str, script: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The same digits pass wherever they are valid: a whole number everywhere, a fraction where seconds go, and
    an empty variable is one not set (torchrun's reading too)."""
    values = {**dict.fromkeys([*SECONDS_OPTIONS, *SECONDS_VARIABLES], ["3", "2.5"]),
              **dict.fromkeys(SIZE_VARIABLES, ["3", "2.5KB", "2.5 GiB"])}.get(name, ["3", "0003"])
    for value in values:
        if name.startswith("-"):
            argv = [f"{name}={value}", str(script)]
        else:
            monkeypatch.setenv(name, value)
            argv = [str(script)]
        config = run([*with_hpu(name, tmp_path), *argv], monkeypatch, capsys)
        assert isinstance(config, LaunchConfig), config
    if not name.startswith("-"):
        monkeypatch.setenv(name, "")
        assert isinstance(run([*with_hpu(name, tmp_path), str(script)], monkeypatch, capsys), LaunchConfig)


def test_the_numbers_reach_the_ranks_as_given(script: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "007")
    config = run(["--nproc=2", "--exit-grace=2.5", str(script)], monkeypatch, capsys)
    assert isinstance(config, LaunchConfig)
    assert (config.nproc, config.threads, config.exit_grace_s) == ("2", 7, 2.5)


@pytest.mark.parametrize(("argv", "environ", "named"), [
    (["--threads", "²"], {}, "--threads='²'"),
    (["--nproc", "²"], {}, "--nproc must be"),
    ([], {"RECIPECACHE_THREADS": "²"}, "RECIPECACHE_THREADS='²'"),
    ([], {"OMP_NUM_THREADS": "²"}, "OMP_NUM_THREADS='²'"),
    ([], {"RECIPECACHE_HPU": "1", "RECIPECACHE_HPU_MAX_SIZE_MB": "²"}, "RECIPECACHE_HPU_MAX_SIZE_MB='²'"),
])
def test_the_installed_command_says_one_line_for_a_superscript(argv: list[str], environ: dict[str, str],
                                                               named: str, script: Path, tmp_path: Path) -> None:
    """As users run it: the real process, which fails before it starts torchrun."""
    environ = {**os.environ, **environ, "RECIPECACHE_HPU_DIR": str(tmp_path / "recipes")}
    proc = subprocess.run(["recipecache-run", *argv, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env=environ, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("recipecache-run: error: ") and named in lines[0], lines[0]
    assert not (tmp_path / "recipecache-runs").exists(), "nothing started"
