"""Every number a user types into ``recipecache`` (options, the store URL's parts and options, the settings a store
reads from the environment), fuzzed: by the one rule of :mod:`recipecache.quantities`, else exit 2 and one line.

Issue 44: ``redis://host/²`` silently used database 0, ``--max-size`` of 400 nines was a traceback, and ``sim`` read
``٣``, ``+3`` and ``1_0`` as numbers. The fuzz runs the CLI's ``main`` in this process; two cases run the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.ports import free_port

from recipecache.backends import open_backend
from recipecache.sim.cli import scenario_from_args
from recipecache.tools import cli

NOT_NUMBERS = ["²", "٣", "３", "+3", "-3", "1e3", "1_0", "", " ", " 3", "3 ", "0x3", "9" * 400, "nan", "inf"]
NOT_WHOLE = [*NOT_NUMBERS, "3.5"]
SIM_WHOLE = ["--ranks", "--shapes", "--steps", "--seed", "--ranks-per-node"]
SIM_NUMBERS = ["--compile-s", "--compute-s", "--fetch-latency-s", "--bandwidth", "--artifact-mb", "--eager-slowdown"]
SETTINGS = ["RECIPECACHE_WAIT_TIMEOUT", "RECIPECACHE_LEASE_TTL", "RECIPECACHE_NODE_MAX_SIZE"]


def url_cases(port: int) -> list[str]:
    """Store URLs whose numbers are no numbers by the rule (nothing listens at ``port``: none is reached)."""
    urls = []
    for value in [v for v in NOT_WHOLE if v]:  # no database is database 0, no port the default one
        quoted = value.replace(" ", "%20")
        urls += [f"redis://127.0.0.1:{port}/{quoted}", f"redis+sentinel://127.0.0.1:{port}/svc/{quoted}",
                 f"redis+cluster://127.0.0.1:{port},127.0.0.1:{quoted}"]
    for value in NOT_NUMBERS:
        quoted = value.replace(" ", "%20").replace("+", "%2B")
        urls += [f"redis://127.0.0.1:{port}/0?timeout={quoted}", f"redis://127.0.0.1:{port}/0?ttl={quoted}",
                 f"redis://127.0.0.1:{port}/0?chunk_size={quoted}", f"file:///tmp/x?max_size={quoted}"]
    return urls


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("RECIPECACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RECIPECACHE_DIR", str(tmp_path / "store"))


def one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        status = int(exc.code or 0)
    captured = capsys.readouterr()
    assert status == 2, captured
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("recipecache"), lines[0]
    return lines[0]


@pytest.mark.parametrize("url", url_cases(free_port()), ids=repr)
def test_a_url_whose_number_is_no_number_is_one_line(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "bad cache URL" in one_line(["stats", "--url", url], capsys)


@pytest.mark.parametrize(("option", "value"), [(o, v) for o in SIM_WHOLE for v in NOT_WHOLE]
                         + [(o, v) for o in SIM_NUMBERS for v in NOT_NUMBERS]
                         + [("--weights", f"1,{v}") for v in NOT_NUMBERS] + [("--max-size", v) for v in NOT_NUMBERS],
                         ids=repr)
def test_an_option_whose_number_is_no_number_is_one_line(option: str, value: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    command = ["prune", "--url", f"file://{tmp_path}/c"] if option == "--max-size" else ["sim"]
    assert option in one_line([*command, f"{option}={value}"], capsys)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n in SETTINGS for v in NOT_NUMBERS if v], ids=repr)
def test_a_setting_whose_number_is_no_number_is_one_line(name: str, value: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(name, value)
    assert name in one_line(["stats", "--url", f"file://{tmp_path}/c"], capsys)


def test_numbers_by_the_rule_are_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    scenario = scenario_from_args(cli.build_parser().parse_args(["sim", "--ranks=0003", "--compile-s=2.5",
                                                                 "--weights=1,0.5"]))
    assert (scenario.ranks, scenario.costs.compile_s, scenario.weights) == (3, 2.5, (1.0, 0.5))
    monkeypatch.setenv("RECIPECACHE_LEASE_TTL", "2.5")
    monkeypatch.setenv("RECIPECACHE_NODE_MAX_SIZE", "2.5 GiB")
    assert cli.main(["prune", "--url", f"file://{tmp_path}/c?max_size=0.5KiB", "--max-size", "1.5KB", "--json"]) == 0
    assert '"max_size": 1500' in capsys.readouterr().out
    for url in ("redis://127.0.0.1:1/15?timeout=0.5", "redis+sentinel://127.0.0.1:1/svc/007?timeout=0.5",
                "redis+cluster://127.0.0.1:1,127.0.0.1:0002?chunk_size=2.5KiB"):
        open_backend(url).close()  # parsed, never reached


@pytest.mark.parametrize("argv", [["prune", "--max-size", "9" * 400], ["stats", "--url", "redis://127.0.0.1:1/²"]])
def test_the_real_command_says_one_line(argv: list[str], tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "recipecache.tools.cli", *argv], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "RECIPECACHE_DIR": str(tmp_path / "c")}, timeout=120,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
