"""recipecache-run without torch.compile: parsing, pass-through, wiring, bad input, the report, signals.

The tests marked ``multirank`` start real torchrun jobs of a few lines of Python (no
compile), so they check what the ranks really see, not what the launcher meant to set.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from harness.ports import free_port

import recipecache
from recipecache.errors import ConfigError
from launcher import bootstrap
from launcher import main as launcher_main
from launcher.exit_watch import ExitWatch, FinishedRank, mark_finished, read_finished, running_child
from launcher.launch_config import LaunchConfig
from recipecache.autoenable import use_rank_dirs
from recipecache.settings import namespace_for
from launcher.main import build_parser, main
from recipecache.runs.report import build_report, format_report, load_metrics, write_report
from launcher import torchrun_options
from launcher.torchrun_options import REFUSED_REASONS
from harness.paths import REPO


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing from the developer's shell leaks into what the launcher resolves."""
    for name in ("RECIPECACHE_URL", "RECIPECACHE_NAMESPACE", "RECIPECACHE_SECRET", "RECIPECACHE_SECRET_FILE",
                 "OMP_NUM_THREADS", "PET_NPROC_PER_NODE", "RECIPECACHE_AUTO_ENABLE", "RECIPECACHE_RANK_DIRS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RECIPECACHE_DIR", str(tmp_path / "store"))


def config_for(*argv: str) -> LaunchConfig:
    return LaunchConfig.from_args(build_parser().parse_args(list(argv)))


# -- torchrun's options ----------------------------------------------------------------
@pytest.mark.internals
def test_every_torchrun_option_is_passed_through_or_refused(script: Path) -> None:
    """The installed torchrun's parser against the launcher's: every option torchrun has reaches
    torchrun as given (its own parser reads back what torchrun alone would read), or is refused.

    torch 2.14 added --log-line-prefix-template and --print-completion to torchrun; a table
    written for 2.13 rejected the first as an unknown option.
    """
    from torch.distributed.run import get_args_parser

    theirs = [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]
    assert all(a.nargs in (None, 0) for a in theirs), "an option with another nargs needs the launcher taught"
    given: list[str] = []
    for action in theirs:
        if action.dest in REFUSED_REASONS:
            with pytest.raises(SystemExit):
                build_parser().parse_args([action.option_strings[-1], "bash", str(script)])
        elif action.dest != "nproc_per_node":
            # a value torchrun takes: "1" for all but its KEY=VALUE options
            value = [] if action.nargs == 0 else [str(action.choices[0]) if action.choices
                                                  else "timeout=1" if action.dest == "rdzv_conf" else "1"]
            given += [action.option_strings[-1], *value]  # the underscore spelling where there is one
    passed = config_for("--nproc", "2", *given, str(script)).torchrun_argv()
    assert passed[:2] == ["-m", "torch.distributed.run"]
    direct = [*given, "--nproc-per-node", "2", "-m", "launcher.bootstrap", str(script)]
    assert vars(get_args_parser().parse_args(passed[2:])) == vars(get_args_parser().parse_args(direct))


def test_torchrun_options_pass_through_in_dash_spelling(script: Path) -> None:
    config = config_for(
        "--nproc", "2", "--nnodes", "2", "--node_rank", "1", "--master-addr", "10.0.0.1", "--master_port", "29511",
        "--max-restarts", "3", "--rdzv-conf", "timeout=5", "-t", "3", "--standalone",
        str(script), "--lr", "0.1", "--nproc", "9", "--standalone",
    )
    assert config.torchrun_argv() == [
        "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--nnodes", "2", "--rdzv-conf", "timeout=5", "--standalone", "--max-restarts", "3", "-t", "3",
        "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29511",
        "-m", "launcher.bootstrap", str(script), "--lr", "0.1", "--nproc", "9", "--standalone",
    ]


def test_launcher_parses_without_importing_torch_once_the_options_are_kept(script: Path, tmp_path: Path) -> None:
    """The first launcher on a torch installation reads torchrun's parser (importing torch) and keeps its
    options; the next parses the same command line without importing torch, to the same result.

    Importing torch in the launcher cost every job 2-9 s before torchrun (which imports it again) started.
    """
    probe = (
        "import json, sys\n"
        "from launcher.main import build_parser\n"
        "from launcher.launch_config import LaunchConfig\n"
        "config = LaunchConfig.from_args(build_parser().parse_args(sys.argv[1:]))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'argv': config.torchrun_argv()}))\n"
    )
    argv = ["--nproc", "2", "--max_restarts", "1", "--standalone", str(script), "--nproc", "9"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe, *argv], env=env, check=True, capture_output=True,
                                      text=True).stdout) for _ in range(2)]
    assert [run["torch"] for run in runs] == [True, False]
    assert runs[0]["argv"] == runs[1]["argv"] == config_for(*argv).torchrun_argv()
    assert len(list((tmp_path / "xdg" / "recipecache-run").iterdir())) == 1


def test_kept_torchrun_options_are_torchruns_and_a_damaged_file_is_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = torchrun_options.cache_file()
    assert path is not None and path.parent == tmp_path / "recipecache-run"
    # the last: a table an older launcher kept (no value kinds, no choices), well-formed then
    for damage in (None, b"[[[\"--x\"], 1, \"x\"]]", b"{", b"[]x", b"[[[\"--x\"], true, \"x\"]]"):
        if damage is not None:
            path.write_bytes(damage)
        torchrun_options.torchrun_rows.cache_clear()
        try:
            assert list(torchrun_options.torchrun_rows()) == torchrun_options.parser_rows()
        finally:
            torchrun_options.torchrun_rows.cache_clear()
        assert json.loads(path.read_bytes()) == [
            [list(names), value, dest, kind, None if choices is None else list(choices)]
            for names, value, dest, kind, choices in torchrun_options.parser_rows()]


def test_kept_torchrun_options_are_named_by_the_parsers_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another torch (or the same one patched) must not read this one's options: the file's name digests them."""
    import importlib.machinery

    package = tmp_path / "torch"
    for name in torchrun_options.PARSER_SOURCES:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("# one\n")
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(torchrun_options.importlib.util, "find_spec", lambda name: spec)
    first = torchrun_options.cache_file()
    (package / "distributed/run.py").write_text("# two\n")
    assert torchrun_options.cache_file() not in (first, None)
    (package / "distributed/run.py").unlink()
    assert torchrun_options.cache_file() is None


@pytest.mark.parametrize("spelling", ["--nproc", "--nproc-per-node", "--nproc_per_node"])
def test_nproc_spellings(script: Path, spelling: str) -> None:
    assert config_for(spelling, "3", str(script)).nproc == "3"


def test_nproc_from_torchrun_env(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    assert config_for(str(script)).nproc == "4"


@pytest.mark.parametrize(("argv", "ranks"), [
    (["--nproc", "2"], (0, 1)),
    (["--nproc", "2", "--nnodes", "1:1", "--rdzv-backend", "c10d"], (0, 1)),
    (["--nproc", "2", "--nnodes", "3", "--node-rank", "2"], (4, 5)),
    (["--nproc", "2", "--nnodes", "3", "--node-rank", "2", "--rdzv-backend", "c10d"], None),
    (["--nproc", "auto"], None),
])
def test_local_ranks(script: Path, argv: list[str], ranks: tuple[int, ...] | None) -> None:
    assert config_for(*argv, str(script)).local_ranks == ranks


# -- wiring ------------------------------------------------------------------------------
def test_rank_env_wiring(script: Path, tmp_path: Path) -> None:
    config = config_for("--nproc", "2", "--url", f"file://{tmp_path}/s", "--run-dir", str(tmp_path / "run"),
                        "--rank-dirs", str(tmp_path / "dirs"), str(script))
    env = config.rank_env({"PATH": "/bin", "RECIPECACHE_AUTO_ENABLE": "0"})
    assert env == {
        "PATH": "/bin",
        "RECIPECACHE_URL": f"file://{tmp_path}/s",
        "RECIPECACHE_NAMESPACE": "train",
        "RECIPECACHE_METRICS_FILE": f"{tmp_path}/run/metrics-rank{{rank}}.json",
        "RECIPECACHE_EVENT_LOG": f"{tmp_path}/run/events",
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "1",
        "OMP_NUM_THREADS": "1",
        "RECIPECACHE_AUTO_ENABLE": "1",
        "RECIPECACHE_RANK_DIRS": f"{tmp_path}/dirs",
        "RECIPECACHE_NODE_DIR": f"{tmp_path}/dirs/rank{{rank}}/node",
        # torchrun's log directory, which it would otherwise make in $TMPDIR for every job and leave there
        "PET_LOG_DIR": f"{tmp_path}/run/torchrun",
        # what a rank may spend finishing no-stall compiles at exit: 80% of the default --exit-grace
        "RECIPECACHE_EXIT_GRACE": "96",
    }
    assert config.report_path == tmp_path / "run" / "report.json"


def test_an_inherited_rank_dirs_is_not_this_jobs(script: Path, tmp_path: Path) -> None:
    """Issue 28: RECIPECACHE_RANK_DIRS=/dev/null in the user's environment reached every rank, whose bootstrap
    raised (a traceback per rank and the job failed): the variable is --rank-dirs' wiring, not a setting."""
    assert "RECIPECACHE_RANK_DIRS" not in config_for(str(script)).rank_env({"RECIPECACHE_RANK_DIRS": "/dev/null"})
    given = config_for("--rank-dirs", str(tmp_path / "d"), str(script)).rank_env({"RECIPECACHE_RANK_DIRS": "/x"})
    assert given["RECIPECACHE_RANK_DIRS"] == str(tmp_path / "d")


def test_a_rank_dirs_a_rank_cannot_create_is_one_line(script: Path, tmp_path: Path) -> None:
    """The bootstrap started by hand (or by an outer job) with a RECIPECACHE_RANK_DIRS it cannot create under."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RECIPECACHE_")}
    proc = subprocess.run([sys.executable, "-m", "launcher.bootstrap", str(script)], capture_output=True, text=True,
                          env={**environ, "RECIPECACHE_RANK_DIRS": "/dev/null", "RANK": "3"}, cwd=tmp_path,
                          timeout=600, check=False)  # a hang guard
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "", "the script did not run"
    assert proc.stderr.count("\n") == 1 and "rank 3: RECIPECACHE_RANK_DIRS='/dev/null': cannot create" in proc.stderr


def test_no_stall_wiring(script: Path, tmp_path: Path) -> None:
    config = config_for("--no-stall", "--exit-grace", "50", str(script))
    env = config.rank_env({})
    assert env["RECIPECACHE_NO_STALL"] == "1" and env["RECIPECACHE_EXIT_GRACE"] == "40"
    assert "RECIPECACHE_NO_STALL" not in config_for(str(script)).rank_env({})


def test_node_tier_wiring(script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(mode=0o700)
    inherited = {"RECIPECACHE_NODE_DIR": "/elsewhere"}
    default = config_for(str(script)).rank_env(inherited)["RECIPECACHE_NODE_DIR"]
    assert default == str(tmp_path / "tmp" / f"recipecache-node-{os.getuid()}") and Path(default).is_dir()
    shared = config_for("--rank-dirs", str(tmp_path / "d"), "--node-dir", str(tmp_path / "n"), str(script))
    assert shared.rank_env(inherited)["RECIPECACHE_NODE_DIR"] == str(tmp_path / "n"), "one node, private torch dirs"
    assert "RECIPECACHE_NODE_DIR" not in config_for("--no-node-tier", str(script)).rank_env(inherited)
    with pytest.raises(ConfigError, match="contradict"):
        config_for("--no-node-tier", "--node-dir", str(tmp_path / "n"), str(script))
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        config_for("--node-dir", str(tmp_path / "open"), str(script))


def test_default_cache_and_run_dir(script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = config_for(str(script))
    assert config.url == f"file://{tmp_path}/store"
    assert config.run_dir.parent == tmp_path / "recipecache-runs"
    monkeypatch.setenv("RECIPECACHE_URL", "redis://cache:6379/0")
    assert config_for(str(script)).url == "redis://cache:6379/0"


def test_recipecache_run_enables_its_ranks_itself_not_the_start_up_hook(script: Path) -> None:
    """An exported RECIPECACHE_ENABLE=1 would enable the ranks past --no-enable: recipecache-run decides."""
    for argv in ([str(script)], ["--no-enable", str(script)]):
        assert "RECIPECACHE_ENABLE" not in config_for(*argv).rank_env({"RECIPECACHE_ENABLE": "1"})


def test_no_enable_drops_auto_enable(script: Path) -> None:
    env = config_for("--no-enable", str(script)).rank_env({"RECIPECACHE_AUTO_ENABLE": "1"})
    assert "RECIPECACHE_AUTO_ENABLE" not in env


def test_secret_file_wins_over_inherited_secret(script: Path, tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text("s3cret-of-16-bytes\n")
    env = config_for("--secret-file", str(secret), str(script)).rank_env({"RECIPECACHE_SECRET": "other"})
    assert env["RECIPECACHE_SECRET_FILE"] == str(secret)
    assert "RECIPECACHE_SECRET" not in env
    assert config_for(str(script)).rank_env({"RECIPECACHE_SECRET": "other"})["RECIPECACHE_SECRET"] == "other"


@pytest.mark.parametrize(("argv", "omp", "threads"), [
    (["--nproc", "2"], None, 1),
    (["--nproc", "1"], None, None),
    (["--nproc", "auto"], None, 1),
    (["--nproc", "2"], "3", 3),
    (["--nproc", "2", "--threads", "4"], "3", 4),
])
def test_threads_default_like_torchrun(script: Path, monkeypatch: pytest.MonkeyPatch,
                                       argv: list[str], omp: str | None, threads: int | None) -> None:
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    config = config_for(*argv, str(script))
    assert config.threads == threads
    env = config.rank_env({})
    assert env.get("OMP_NUM_THREADS") == (None if threads is None else str(threads))


def test_namespace_precedence(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_for(str(script)).namespace == "train"
    monkeypatch.setenv("RECIPECACHE_NAMESPACE", "from-env")
    assert config_for(str(script)).namespace == "from-env"
    assert config_for("--namespace", "given", str(script)).namespace == "given"


@pytest.mark.parametrize(("name", "namespace"), [
    ("train.py", "train"), ("my train (v2).py", "my-train-v2-"), ("_private.py", "private"), ("___.py", "default"),
    ("x" * 80 + ".py", "x" * 64),
])
def test_namespace_for_script(name: str, namespace: str) -> None:
    assert namespace_for(Path(name)) == namespace


# -- bad input ---------------------------------------------------------------------------
def bad_inputs(tmp_path: Path, script: Path) -> dict[str, list[str]]:
    return {
        "unknown option": ["--bogus", str(script)],
        "no script": ["--nproc", "2"],
        "missing script": [str(tmp_path / "nope.py")],
        "nproc 0": ["--nproc", "0", str(script)],
        "nproc negative": ["--nproc=-1", str(script)],
        "nproc word": ["--nproc", "lots", str(script)],
        "threads 0": ["--threads", "0", str(script)],
        "threads not a number": ["--threads", "x", str(script)],
        # issue 28: --nproc 10**20 hung the launcher; --threads 10**400 reached every rank's OMP_NUM_THREADS
        "nproc huge": ["--nproc", "9" * 20, str(script)],
        "threads huge": ["--threads", "9" * 400, str(script)],
        "rank dirs a device": ["--rank-dirs", "/dev/null", str(script)],
        "rank dirs too long a name": ["--rank-dirs", str(tmp_path / ("d" * 300)), str(script)],
        "unknown scheme": ["--url", "foo://bar", str(script)],
        "bad redis port": ["--url", "redis://127.0.0.1:notaport/0", str(script)],
        "unknown url option": ["--url", "redis://127.0.0.1:6379/0?bogus=1", str(script)],
        "memory store": ["--url", "memory://", str(script)],
        "unreachable redis": ["--url", f"redis://127.0.0.1:{free_port()}/0", str(script)],
        "bad namespace": ["--namespace", "no/slash", str(script)],
        # issue 28: torchrun's own options, unchecked, failed in torchrun after it started, under a traceback
        "nnodes nan": ["--nnodes", "nan", str(script)],
        "nnodes min above max": ["--nnodes", "3:2", str(script)],
        "max restarts huge": ["--max-restarts", "9" * 20, str(script)],
        "max restarts negative": ["--max-restarts=-1", str(script)],
        "monitor interval 0": ["--monitor-interval", "0", str(script)],
        "monitor interval nan": ["--monitor-interval", "nan", str(script)],
        "master port past 65535": ["--master-port", "70000", str(script)],
        "node rank not a number": ["--node-rank", "x", str(script)],
        "tee 7": ["-t", "7", str(script)],
        "rdzv conf without a value": ["--rdzv-conf", "timeout", str(script)],
        "start method not torchrun's": ["--start-method", "thread", str(script)],
        "missing secret file": ["--secret-file", str(tmp_path / "none"), str(script)],
        "exit grace nan": ["--exit-grace", "nan", str(script)],
        "exit grace 0": ["--exit-grace", "0", str(script)],
        # issue 34: a grace no job means (a rank's share of it overflowed a timeout), and report paths the job
        # would have run an hour for, then failed to write
        "exit grace 1e10": ["--exit-grace", "1e10", str(script)],
        "exit grace -inf": ["--exit-grace=-inf", str(script)],
        "report is a directory": ["--run-dir", str(tmp_path / "recipecache-runs"), "--report", str(tmp_path), str(script)],
        "report under a file": ["--run-dir", str(tmp_path / "recipecache-runs"), "--report", str(script / "r.json"),
                                str(script)],
        "torchrun -m": ["-m", str(script)],
        "torchrun --no-python": ["--no-python", str(script)],
    }


@pytest.mark.parametrize("case", list(bad_inputs(Path("/x"), Path("/x/s.py"))))
def test_bad_input_is_one_line_and_exit_2(case: str, script: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = bad_inputs(tmp_path, script)[case]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("recipecache-run: error: ")
    assert not (tmp_path / "recipecache-runs").exists()


def test_a_report_path_swapped_for_a_symlink_during_the_job_is_left_alone(tmp_path: Path) -> None:
    """The launcher checks --report before the job; the write checks again, and never replaces a symlink."""
    (tmp_path / "mine").write_text("mine")
    (tmp_path / "report.json").symlink_to(tmp_path / "mine")
    with pytest.raises(ConfigError, match="is a symlink, not a regular file"):
        write_report({"exit_code": 0}, tmp_path / "report.json")
    assert (tmp_path / "report.json").is_symlink() and (tmp_path / "mine").read_text() == "mine"
    write_report({"exit_code": 0}, tmp_path / "new" / "report.json")
    assert json.loads((tmp_path / "new" / "report.json").read_text()) == {"exit_code": 0}


def test_password_in_cache_option_is_warned_about_and_redacted(script: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--url is visible to every user (ps): a password in it earns a warning; no output shows it."""
    assert main(["--url", f"redis://u:hunter2-secret@127.0.0.1:{free_port()}/0", str(script)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("recipecache-run: warning: the password in --url redis://u:***@")
    assert lines[1].startswith("recipecache-run: error: ")
    assert not any("hunter2-secret" in line for line in lines)


def test_console_script_bad_input_has_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, as users run it: exit 2 and one line, from a real process."""
    proc = subprocess.run(["recipecache-run", "--nproc", "0", "x.py"], capture_output=True, text=True, cwd=tmp_path,
                          check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["recipecache-run: error: script 'x.py' not found"]


def store_environments(tmp_path: Path) -> dict[str, dict[str, str]]:
    return {
        "missing secret file": {"RECIPECACHE_SECRET_FILE": str(tmp_path / "no-such-secret")},
        "empty secret file": {"RECIPECACHE_SECRET_FILE": str(tmp_path / "empty-secret")},
        "nan wait timeout": {"RECIPECACHE_WAIT_TIMEOUT": "nan"},
        "infinite lease ttl": {"RECIPECACHE_LEASE_TTL": "inf"},
        "lease ttl under a millisecond": {"RECIPECACHE_LEASE_TTL": "0.0001"},
        "node directory cap not a size": {"RECIPECACHE_NODE_MAX_SIZE": "abc"},
        "cpu fingerprint not a key part": {"RECIPECACHE_CPU_FINGERPRINT": "two words"},
        # issue 34: a FIFO blocked the launcher (and every rank) forever, /dev/zero was read until memory ran out
        "secret file a fifo": {"RECIPECACHE_SECRET_FILE": str(tmp_path / "fifo-secret")},
        "secret file a device": {"RECIPECACHE_SECRET_FILE": "/dev/zero"},
        # issue 34: these switches read anything but 1 as off, silently (RECIPECACHE_NO_STALL=yes was an error)
        "precompile switch yes": {"RECIPECACHE_PRECOMPILE": "yes"},
        "no-stall switch yes": {"RECIPECACHE_NO_STALL": "yes"},
        "prewarm switch true": {"RECIPECACHE_PREWARM": "true"},
        "metrics flush on": {"RECIPECACHE_METRICS_FLUSH": "on"},
    }


@pytest.mark.parametrize("case", list(store_environments(Path("/x"))))
def test_bad_store_environment_is_one_line_before_any_rank_starts(case: str, script: Path, tmp_path: Path) -> None:
    """What every rank would read from the environment is checked by the real command, up front."""
    (tmp_path / "empty-secret").write_text("\n")
    os.mkfifo(tmp_path / "fifo-secret")
    (name, value), = store_environments(tmp_path)[case].items()
    proc = subprocess.run([sys.executable, "-m", "launcher.main", "--nproc", "2", str(script)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, name: value}, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"recipecache-run: error: {name}")
    assert not (tmp_path / "recipecache-runs").exists(), "nothing started"


@pytest.mark.parametrize(("name", "value", "error"), [
    ("RECIPECACHE_NODE_MAX_SIZE", "abc", "RECIPECACHE_NODE_MAX_SIZE: bad size 'abc': use a number with an optional "
                                         "unit such as 512MB, 10GiB or 1000000"),
    # issue 34: read as off, silently, while RECIPECACHE_NO_STALL=yes was an error
    ("RECIPECACHE_PRECOMPILE", "yes", "RECIPECACHE_PRECOMPILE='yes': use 1 (on) or 0 (off)"),
])
def test_a_rank_whose_environment_is_bad_input_says_so_in_one_line(name: str, value: str, error: str, script: Path,
                                                                   tmp_path: Path) -> None:
    """Where the up-front check cannot see it (a rank started otherwise), enable() in the rank's bootstrap
    stops on the same bad input with one line and exit 2, not a traceback, and the script never runs."""
    environ = {**os.environ, "RECIPECACHE_AUTO_ENABLE": "1", name: value, "RANK": "3",
               "RECIPECACHE_DIR": str(tmp_path / "store")}
    proc = subprocess.run([sys.executable, "-m", "launcher.bootstrap", str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=environ, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stdout == "", "the script did not run"
    assert proc.stderr.splitlines() == [f"recipecache: error: rank 3: {error}"]


def test_secret_in_the_environment_wins_over_a_missing_secret_file(script: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks read RECIPECACHE_SECRET first and never open the file then: neither does the check."""
    monkeypatch.setenv("RECIPECACHE_SECRET_FILE", str(tmp_path / "no-such-secret"))
    monkeypatch.setenv("RECIPECACHE_SECRET", "a-secret-of-sixteen-bytes-or-more")
    assert config_for(str(script)).secret_file is None


def test_help_lists_our_options_and_points_to_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--nproc", "--url", "--namespace", "--secret-file", "--run-dir", "--report", "--no-enable",
                   "--threads", "--rank-dirs", "--exit-grace", "--rdzv-endpoint", "--master-port"):
        assert option in out
    assert "passed to torch.distributed.run unchanged" in " ".join(out.split())
    assert "pass such a URL in $RECIPECACHE_URL" in " ".join(out.split())


# -- the report --------------------------------------------------------------------------
def metrics(rank: int, **fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "rank": rank, "host": "h", "pid": 100 + rank, "wall_s": 10.0,
        "graph_compilation": {"TotalNumber": 2, "TotalTime": 12.5, "AvgTime": 6.25},
        "cache": {"TotalHit": 1, "TotalMiss": 2},
        "waits": 1, "wait_s": 3.0, "stall_s": 99.0, "saved_s": 4.0,
        "refused": 0, "fallbacks": {"backend_down": 1}, "store": {"puts": 2},
    }
    data.update(fields)
    return data


def write_metrics(run_dir: Path, rank: int, data: Any) -> Path:
    path = run_dir / f"metrics-rank{rank}.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_report_aggregates_ranks_and_lists_missing_ones(tmp_path: Path) -> None:
    write_metrics(tmp_path, 0, metrics(0))
    write_metrics(tmp_path, 1, metrics(1, saved_s=None, waits=0, wait_s=0.0,
                                       refused=2, store={"puts": 0},
                                       fallbacks={"backend_down": 2, "wait_timeout": 1}))
    write_metrics(tmp_path, 3, "{torn")
    (tmp_path / "metrics-rankX.json").write_text("{}")  # not a rank's file
    report = build_report(load_metrics(tmp_path), range(4), exit_code=1)

    assert [r["status"] for r in report["ranks"]] == ["ok", "ok", "missing", "unreadable"]
    assert report["missing_ranks"] == [2, 3]
    assert report["exit_code"] == 1
    r0, r1 = report["ranks"][:2]
    assert r0["stall_s"] == 15.5  # compile 12.5 + wait 3.0, not the file's own stall_s
    assert r1["stall_s"] == 12.5
    assert r1["saved_s"] == 0.0
    total = report["total"]
    assert (total["compiles"], total["hits"], total["misses"], total["puts"], total["waits"]) == (4, 2, 4, 2, 1)
    assert (total["compile_s"], total["wait_s"], total["stall_s"], total["saved_s"]) == (25.0, 3.0, 28.0, 4.0)
    assert total["fallbacks"] == {"backend_down": 3, "wait_timeout": 1}
    assert (r0["refused"], r1["refused"], total["refused"]) == (0, 2, 2)
    assert total["ranks_reported"] == 2
    text = format_report(report)
    assert "2  no metrics file" in text
    assert "3  unreadable metrics: metrics-rank3.json" in text
    assert "WARNING: no usable metrics from rank(s) 2, 3" in text


def test_report_says_which_graphs_were_keyed_per_rank_and_why(tmp_path: Path) -> None:
    """Issue 27: graphs that use the ranks' process groups but could not be shared (fallback rank_bound) are
    summed up in one line naming the ranks and the first rank's reason; none when every such graph was shared."""
    why = "graph 1a2b uses this rank's process groups and is compiled by every rank that traces it: compile_on_one_rank"
    for rank in (0, 1):
        write_metrics(tmp_path, rank, metrics(rank, fallbacks={"rank_bound": 2}, fallback_details={"rank_bound": why}))
    write_metrics(tmp_path, 2, metrics(2))
    write_metrics(tmp_path, 3, metrics(3, fallback_details={"rank_bound": ["not", "text"]}))
    report = build_report(load_metrics(tmp_path), range(4), exit_code=0)
    assert report["ranks"][3]["error"] == "metrics-rank3.json: fallback_details is not a map of texts"
    assert report["total"]["per_rank_graphs"] == {"graphs": 4, "ranks": [0, 1], "why": why}
    assert f"keyed per rank, not shared between ranks (rank_bound: 4 graph lookup(s) on rank(s) 0, 1): {why}" \
        in format_report(report)
    shared = build_report({0: metrics(0)}, range(1), exit_code=0)
    assert shared["total"]["per_rank_graphs"] is None and "keyed per rank" not in format_report(shared)


def test_launcher_warns_at_startup_when_torch_compiles_mesh_graphs_per_rank() -> None:
    """Issue 27: torch's compile_on_one_rank set in the environment (2.14's name, read as torch reads it; 2.13's,
    any value) is named before the job starts; unset or off, nothing is said."""
    note = launcher_main.per_rank_graphs_note
    assert "TORCH_COMPILE_ON_ONE_RANK=1: torch's compile_on_one_rank is on" in note({"TORCH_COMPILE_ON_ONE_RANK": "1"})
    assert "compiled by every rank" in note({"TORCH_DISTRIBUTED_COMPILE_ON_ONE_RANK": "true"})
    assert note({}) is None and note({"TORCH_COMPILE_ON_ONE_RANK": "0"}) is None


def test_report_gives_hits_misses_and_puts_of_each_kind_side_by_side(tmp_path: Path) -> None:
    """Issue 19: hits and misses count graph lookups, puts every kind; the report says so and shows each kind's
    figures side by side (a rank whose lookups are no counts is unreadable)."""
    fx = {"hit": 1, "miss": 2, "put": 2}
    write_metrics(tmp_path, 0, metrics(0, lookups={"fx": fx, "aot": {"hit": 0, "miss": 1, "put": 1}}))
    write_metrics(tmp_path, 1, metrics(1, lookups={"fx": fx, "precompiled": {"hit": 1, "miss": 0, "put": 0}}))
    write_metrics(tmp_path, 2, metrics(2, lookups={"fx": {"hit": -1}}))
    report = build_report(load_metrics(tmp_path), range(3))
    assert report["ranks"][0]["lookups"]["aot"] == {"hit": 0, "miss": 1, "put": 1}
    assert report["ranks"][2]["status"] == "unreadable"
    assert report["total"]["lookups"] == {"fx": {"hit": 2, "miss": 4, "put": 4}, "aot": {"hit": 0, "miss": 1, "put": 1},
                                          "precompiled": {"hit": 1, "miss": 0, "put": 0}}
    assert "by kind, hits/misses/puts: fx 2/4/4, aot 0/1/1, precompiled 1/0/0" in format_report(report)


def test_report_without_known_ranks_covers_what_it_finds(tmp_path: Path) -> None:
    write_metrics(tmp_path, 5, metrics(5))
    report = build_report(load_metrics(tmp_path), None)
    assert [r["rank"] for r in report["ranks"]] == [5]
    assert report["expected_ranks"] is None and report["missing_ranks"] == []
    assert "1 rank(s) reported" in format_report(report)


def test_report_ignores_metrics_older_than_the_job(tmp_path: Path) -> None:
    old = write_metrics(tmp_path, 0, metrics(0))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    write_metrics(tmp_path, 1, metrics(1))
    assert sorted(load_metrics(tmp_path, since=time.time() - 60)) == [1]


# -- bootstrap ---------------------------------------------------------------------------
@pytest.fixture
def probe_script(tmp_path: Path) -> Path:
    """A script that records how it was run and whether recipecache.enable() ran before it."""
    path = tmp_path / "sub" / "probe.py"
    path.parent.mkdir()
    path.write_text(
        "import json, os, sys\n"
        "import recipecache\n"
        "out = {'name': __name__, 'argv': sys.argv, 'path0': sys.path[0], 'enabled': getattr(recipecache, 'ENABLED', False),\n"
        "       'env': {k: os.environ.get(k) for k in ('TORCHINDUCTOR_CACHE_DIR', 'TMPDIR', 'OMP_NUM_THREADS',\n"
        "               'RECIPECACHE_URL', 'RECIPECACHE_NAMESPACE', 'RECIPECACHE_METRICS_FILE', 'RECIPECACHE_EVENT_LOG',\n"
        "               'TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS', 'RECIPECACHE_AUTO_ENABLE')}}\n"
        "with open(sys.argv[1] + os.environ.get('RANK', '0'), 'w') as f:\n"
        "    json.dump(out, f)\n"
        "if len(sys.argv) > 2 and os.environ.get('RANK') == '1':\n"
        "    sys.exit(int(sys.argv[2]))\n"
    )
    return path


@pytest.mark.parametrize("auto_enable", [True, False])
def test_bootstrap_enables_then_runs_script_as_main(probe_script: Path, tmp_path: Path, auto_enable: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_enable() -> None:
        monkeypatch.setitem(vars(recipecache), "ENABLED", True)

    # setitem, not setattr: reading the old value would import the real (torch) integration
    monkeypatch.setitem(vars(recipecache), "enable", fake_enable)
    monkeypatch.setattr(sys, "argv", ["bootstrap"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])  # the script becomes __main__ for good
    if auto_enable:
        monkeypatch.setenv("RECIPECACHE_AUTO_ENABLE", "1")
    out = tmp_path / "out"
    bootstrap.main([str(probe_script), str(out)])
    seen = json.loads((tmp_path / "out0").read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(probe_script), str(out)]
    assert seen["path0"] == str(probe_script.parent)
    assert seen["enabled"] is auto_enable
    assert sys.modules["__main__"].out["argv"] == seen["argv"], "as under python script.py, it stays __main__"


@pytest.mark.parametrize(("body", "status"), [("pass", 0), ("raise SystemExit(3)", 3), ("raise SystemExit('bye')", 1),
                                              ("raise ValueError('bug')", 1)])
def test_bootstrap_marks_the_finished_script_with_its_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            body: str, status: int) -> None:
    script = tmp_path / "train.py"
    script.write_text(body + "\n")
    monkeypatch.setattr(sys, "argv", ["bootstrap"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    for name, value in (("RECIPECACHE_FINISHED_DIR", str(tmp_path)), ("RANK", "3"), ("LOCAL_RANK", "1"),
                        ("LOCAL_WORLD_SIZE", "2"), ("TORCHELASTIC_RESTART_COUNT", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises((SystemExit, ValueError)) if status else contextlib.nullcontext():
        bootstrap.main([str(script)])
    assert read_finished(tmp_path) == [FinishedRank(rank=3, local_rank=1, local_world_size=2, restart=0,
                                                    pid=os.getpid(), status=status)]


def test_exit_watch_waits_for_every_local_rank_then_the_grace(tmp_path: Path) -> None:
    """Only processes that are still this parent's children are overdue; a new torchrun round starts over."""
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = [0.0]
    watch = ExitWatch(tmp_path, grace_s=5.0, clock=lambda: now[0])

    def finish(local_rank: int, pid: int, restart: int = 0) -> None:
        mark_finished(0, {"RECIPECACHE_FINISHED_DIR": str(tmp_path), "RANK": str(local_rank),
                          "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2",
                          "TORCHELASTIC_RESTART_COUNT": str(restart)})
        path = tmp_path / f"round{restart}-local{local_rank}.json"
        path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {pid}'))

    try:
        finish(0, gone.pid)
        now[0] = 100.0
        assert watch.overdue(os.getpid()) == [], "rank 1 is still working"
        finish(1, running.pid)
        assert watch.overdue(os.getpid()) == [], "the grace starts now"
        now[0] = 104.0
        assert watch.overdue(os.getpid()) == []
        now[0] = 105.0
        assert [r.pid for r in watch.overdue(os.getpid())] == [running.pid]
        assert watch.overdue(running.pid) == [], "not a child of that process"
        finish(0, running.pid, restart=1)
        assert watch.overdue(os.getpid()) == [], "a restarted round is judged on its own markers"
    finally:
        running.kill()
        running.wait()
    assert not running_child(running.pid, os.getpid()), "reaped"


def test_use_rank_dirs_gives_each_rank_its_own_dirs(tmp_path: Path) -> None:
    env = {"RECIPECACHE_RANK_DIRS": str(tmp_path), "RANK": "3"}
    use_rank_dirs(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "rank3" / "inductor")
    assert env["TMPDIR"] == str(tmp_path / "rank3" / "tmp")
    assert Path(env["TMPDIR"]).is_dir()
    untouched = {"RANK": "0"}
    use_rank_dirs(untouched)
    assert untouched == {"RANK": "0"}


# -- real torchrun jobs ------------------------------------------------------------------
def run_launcher(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launcher.main", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300, check=False)


@pytest.mark.multirank
@pytest.mark.internals
def test_ranks_see_the_wiring(probe_script: Path, tmp_path: Path) -> None:
    launched = time.time()
    proc = run_launcher("--nproc", "2", "--master-port", str(free_port()), "--no-enable", "--run-dir",
                        str(tmp_path / "run"), "--rank-dirs", str(tmp_path / "dirs"), "--namespace", "wired",
                        str(probe_script), str(tmp_path / "seen"), cwd=tmp_path)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen{rank}").read_text())
        assert seen["name"] == "__main__" and seen["argv"] == [str(probe_script), str(tmp_path / "seen")]
        assert seen["path0"] == str(probe_script.parent)
        assert seen["enabled"] is False
        assert seen["env"] == {
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "dirs" / f"rank{rank}" / "inductor"),
            "TMPDIR": str(tmp_path / "dirs" / f"rank{rank}" / "tmp"),
            "OMP_NUM_THREADS": "1",
            "RECIPECACHE_URL": f"file://{tmp_path}/store",
            "RECIPECACHE_NAMESPACE": "wired",
            "RECIPECACHE_METRICS_FILE": str(tmp_path / "run" / "metrics-rank{rank}.json"),
            "RECIPECACHE_EVENT_LOG": str(tmp_path / "run" / "events"),
            "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "1",
            "RECIPECACHE_AUTO_ENABLE": None,
        }
    # --no-enable and a script that never enables: no rank writes metrics, and the report says so
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["exit_code"] == 0 and report["missing_ranks"] == [0, 1]
    assert "WARNING: no usable metrics from rank(s) 0, 1" in proc.stderr
    # when the job started, for its timeline (cold_bench): within the launcher's life, the job's wall after it
    assert launched <= report["started"] <= report["started"] + report["wall_s"] <= ended


@pytest.mark.multirank
def test_exit_status_is_the_jobs(probe_script: Path, tmp_path: Path) -> None:
    proc = run_launcher("--nproc", "2", "--no-enable", "--run-dir", str(tmp_path / "run"), str(probe_script),
                        str(tmp_path / "seen"), "3", cwd=tmp_path)
    assert proc.returncode == 1  # torchrun's status for a failed worker group
    assert json.loads((tmp_path / "run" / "report.json").read_text())["exit_code"] == 1


@pytest.mark.multirank
def test_a_job_leaves_nothing_in_its_tmpdir(probe_script: Path, tmp_path: Path) -> None:
    """Issue 28 (benchmarks/repeat_jobs_bench.py found it): torchrun makes a ``torchelastic_*`` log directory in
    ``$TMPDIR`` for every job when it is given no ``--log-dir``, and never removes it; one more per job. The
    launcher gives it one in the run directory (``PET_LOG_DIR``: a ``--log-dir`` of the user's own wins)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    environ = {**os.environ, "TMPDIR": str(tmp)}
    proc = run_launcher("--nproc", "2", "--no-enable", "--no-node-tier", "--run-dir", str(tmp_path / "run"),
                        str(probe_script), str(tmp_path / "seen"), cwd=tmp_path, env=environ)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp)) == [], "the job left nothing in its TMPDIR"
    assert (tmp_path / "run" / "torchrun").is_dir()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_ranks_stop_with_the_launcher(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGINT/SIGTERM/SIGHUP (the launcher's terminal closed) are forwarded to torchrun; a SIGKILLed launcher
    takes torchrun down with it (Linux)."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(
        "import os, sys, time\n"
        f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-m", "launcher.main", "--nproc", "2", "--no-enable", "--run-dir",
                                 str(tmp_path / "run"), str(sleeper)], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text() for p in pid_files):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in pid_files]
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=120)
        deadline = time.monotonic() + 60
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # after a SIGKILL the ranks stop after the launcher, not before
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert not any(pid_alive(pid) for pid in pids)
    if sig != signal.SIGKILL:
        assert "Traceback" not in err.split("recipecache-run: job exited")[-1]
        assert (tmp_path / "run" / "report.json").exists()


def test_prewarm_and_hpu_wiring(script: Path, tmp_path: Path) -> None:
    from recipecache.hpu import parse_config

    config = config_for("--prewarm", "--hpu", "--hpu-dir", str(tmp_path / "recipes"), "--hpu-max-size-mb", "64",
                        "--namespace", "job", str(script))
    env = config.rank_env({})
    assert env["RECIPECACHE_PREWARM"] == "1"
    hpu = parse_config(env["PT_HPU_RECIPE_CACHE_CONFIG"])
    assert (hpu.path, hpu.delete, hpu.max_size_mb) == (str(tmp_path / "recipes"), False, 64)
    assert (tmp_path / "recipes").is_dir()
    plain = config_for(str(script)).rank_env({})
    assert "RECIPECACHE_PREWARM" not in plain and "PT_HPU_RECIPE_CACHE_CONFIG" not in plain


@pytest.mark.parametrize(("argv", "message"), [
    (["--hpu-dir", "/tmp/x"], "needs --hpu"),
    (["--hpu", "--hpu-max-size-mb", "0"], "--hpu-max-size-mb=.0. must be a whole number from 1 to"),
])
def test_bad_hpu_options(script: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_for(*argv, str(script))


# -- ranks that outlive their script -------------------------------------------------------
HANG_AFTER_WORK = (
    "import atexit, os, signal, sys, time\n"
    "open(os.path.join(sys.argv[1], 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
    "if os.environ['RANK'] == '1':\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it, as a rank stuck holding the GIL\n"
    "    atexit.register(time.sleep, 3600)  # the work is done; the exit hangs\n"
    "    sys.exit(int(sys.argv[2]))\n"
)


@pytest.mark.multirank
@pytest.mark.parametrize(("script_status", "job_status"), [(0, 0), (3, 1)])
def test_rank_hanging_after_its_work_is_reported_and_ended(tmp_path: Path, script_status: int,
                                                           job_status: int) -> None:
    """Rank 1 hangs after its script ended with ``script_status``; the job's status is the scripts' (torchrun's
    1 when one failed), not the kill's."""
    script = tmp_path / "hangs_at_exit.py"
    script.write_text(HANG_AFTER_WORK)
    proc = run_launcher("--nproc", "2", "--master-port", str(free_port()), "--no-enable", "--exit-grace", "1",
                        "--run-dir", str(tmp_path / "run"),
                        str(script), str(tmp_path), str(script_status), cwd=tmp_path)
    assert proc.returncode == job_status, proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["exit_code"] == job_status
    hung_pid = int((tmp_path / "pid1").read_text())
    assert report["hung_ranks"] == [{"rank": 1, "local_rank": 1, "local_world_size": 2, "restart": 0,
                                     "pid": hung_pid, "status": script_status}]
    assert not pid_alive(hung_pid)
    assert "WARNING: rank(s) 1 still running 1 s after the script finished on every rank" in proc.stderr
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".finished")] == []


ABORT_AFTER_WORK = (
    "import atexit, glob, os, sys, time\n"
    "def abort_once_rank_0_finished():\n"
    "    deadline = time.monotonic() + 120\n"
    "    marker = os.path.join(os.environ['RECIPECACHE_FINISHED_DIR'], '*-local0.json')\n"
    "    while not glob.glob(marker) and time.monotonic() < deadline:\n"
    "        time.sleep(0.05)\n"
    "    os.abort()\n"
    "if os.environ['RANK'] == '1':\n"
    "    atexit.register(abort_once_rank_0_finished)  # the work is done; the process dies shutting down\n"
    "sys.exit(int(sys.argv[1]))\n"
)


@pytest.mark.multirank
@pytest.mark.parametrize(("script_status", "job_status"), [(0, 0), (3, 1)])
def test_rank_dying_at_exit_after_its_work_gives_the_scripts_status(tmp_path: Path, script_status: int,
                                                                   job_status: int) -> None:
    """Rank 1 dies of SIGABRT while its process shuts down, after every script ended with ``script_status``
    (torch 2.14.1's gloo teardown can): the job's status is the scripts', as for a rank ended for hanging."""
    script = tmp_path / "aborts_at_exit.py"
    script.write_text(ABORT_AFTER_WORK)
    proc = run_launcher("--nproc", "2", "--master-port", str(free_port()), "--no-enable",
                        "--run-dir", str(tmp_path / "run"), str(script), str(script_status), cwd=tmp_path)
    assert proc.returncode == job_status, proc.stderr
    assert json.loads((tmp_path / "run" / "report.json").read_text())["exit_code"] == job_status
    said = "every rank's script completed, but a rank then died while its process shut down" in proc.stderr
    assert said == (script_status == 0), proc.stderr


HANG_AFTER_METRICS = (
    "import atexit, os, signal, time\n"
    "import recipecache\n"
    "store = recipecache.enable()  # already enabled by the bootstrap: the same store\n"
    "for i in range(5):\n"
    "    store.get(f'never-put-{i}')  # figures only this script makes: five not_found misses\n"
    "if os.environ['RANK'] == '1':\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    atexit.register(time.sleep, 3600)  # registered after enable(): it runs before recipecache's handler\n"
)


@pytest.mark.multirank
def test_rank_ended_for_hanging_at_exit_still_reports_its_metrics(tmp_path: Path) -> None:
    """Issue 18, item 15: the metrics were written by an atexit handler that a hung handler kept from running,
    so the report said "no usable metrics from rank(s) 1" for the rank the launcher had to end."""
    script = tmp_path / "hangs_after_metrics.py"
    script.write_text(HANG_AFTER_METRICS)
    proc = run_launcher("--nproc", "2", "--master-port", str(free_port()), "--exit-grace", "10",
                        "--run-dir", str(tmp_path / "run"), str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert 1 in [r["rank"] for r in report["hung_ranks"]]  # (rank 0 too if its exit took longer, on a busy machine)
    assert report["missing_ranks"] == [] and "no usable metrics" not in proc.stderr, proc.stderr
    assert [r["status"] for r in report["ranks"]] == ["ok", "ok"]
    for rank in (0, 1):
        metrics = json.loads((tmp_path / "run" / f"metrics-rank{rank}.json").read_text())
        assert metrics["store"]["misses_by_reason"]["not_found"] >= 5, metrics["store"]


def test_metrics_are_rewritten_at_exit_only_when_a_figure_changed(tmp_path: Path) -> None:
    """The bootstrap writes the metrics when the script returns; the exit handler rewrites them only if changed."""
    from recipecache.torch_integration.metrics import Metrics

    store = recipecache.open_store("memory://", namespace="m")
    path = tmp_path / "metrics-rank0.json"
    metrics = Metrics(store, path, flush=False)
    metrics.write()
    path.unlink()
    metrics.write(if_changed=True)
    assert not path.exists(), "nothing changed: not rewritten"
    store.get("absent")
    metrics.write(if_changed=True)
    assert json.loads(path.read_text())["store"]["misses_by_reason"] == {"not_found": 1}


def test_a_metrics_write_that_fails_is_warned_once_and_never_raised(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The bootstrap writes the metrics as the script returns: a figure that fails there (here a no-stall snapshot
    that raises) must not turn a rank that trained to its end into a failed one; the warning says why, once."""
    from recipecache.torch_integration.metrics import Metrics

    store = recipecache.open_store("memory://", namespace="m")
    path = tmp_path / "metrics-rank0.json"
    metrics = Metrics(store, path, flush=False)

    def broken_snapshot() -> dict[str, Any]:
        raise RuntimeError("dictionary changed size during iteration")

    metrics.follow_no_stall(broken_snapshot)
    with caplog.at_level("WARNING", logger="recipecache"):
        metrics.write()
        metrics.write(if_changed=True)
    warnings = [r for r in caplog.records if "cannot write metrics" in r.getMessage()]
    assert len(warnings) == 1 and "RuntimeError: dictionary changed size" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None and not path.exists()


@pytest.mark.multirank
def test_job_status_and_report_survive_an_agent_that_will_not_stop(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An HPU agent stuck in its last pass is killed after its timeout; the job's status and report stay."""
    stubborn: list[subprocess.Popen[bytes]] = []

    def start_stubborn_agent(_config: LaunchConfig) -> subprocess.Popen[bytes]:
        agent = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(flush=True)\ntime.sleep(600)\n"],
                                 stdout=subprocess.PIPE)
        assert agent.stdout is not None
        agent.stdout.readline()  # it ignores SIGTERM from here on
        stubborn.append(agent)
        return agent

    monkeypatch.setattr(launcher_main, "start_hpu_agent", start_stubborn_agent)
    monkeypatch.setattr(launcher_main, "AGENT_STOP_TIMEOUT_S", 0.5, raising=False)
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(5)\n")
    config = config_for("--nproc", "1", "--no-enable", "--run-dir", str(tmp_path / "run"), str(script))
    try:
        assert launcher_main.launch(config) == 1  # torchrun's status for the failed rank
    finally:
        for agent in stubborn:
            agent.kill()
            agent.wait()
    assert stubborn[0].returncode == -signal.SIGKILL, "the launcher killed it"
    assert json.loads((tmp_path / "run" / "report.json").read_text())["exit_code"] == 1


def test_hpu_agent_gets_the_store_url_in_its_environment_not_its_arguments(script: Path, tmp_path: Path) -> None:
    """Any user can read a process's arguments (ps); the password must not be among them."""
    password = "s3cret-" + os.urandom(4).hex()
    config = config_for("--hpu", "--hpu-dir", str(tmp_path / "recipes"), "--url",
                        f"redis://recipecache:{password}@127.0.0.1:{free_port()}/0", str(script))
    config.run_dir.mkdir(parents=True)
    agent = launcher_main.start_hpu_agent(config)
    assert agent is not None
    try:
        deadline = time.monotonic() + 60  # a hang guard
        # /proc/PID/cmdline reads empty for a moment while the new process image settles
        while not (cmdline := Path(f"/proc/{agent.pid}/cmdline").read_bytes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        environ = Path(f"/proc/{agent.pid}/environ").read_bytes().split(b"\0")
    finally:
        agent.kill()
        agent.wait()
    assert b"recipecache.hpu.agent" in cmdline
    assert password.encode() not in cmdline
    assert f"RECIPECACHE_URL={config.url}".encode() in environ


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(("parent", "status"), [("os.getppid()", 0), ("os.getppid() + 1", 1)])
def test_die_with_parent_ends_a_process_whose_parent_is_not_the_one_that_started_it(parent: str, status: int) -> None:
    """The race where the parent died before the request took effect: the process then has another parent."""
    code = ("import os, signal\nfrom recipecache.parent_death import die_with_parent\n"
            f"assert die_with_parent(signal.SIGKILL, {parent})\n")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == status


# -- one rule for every option's environment fallback (issue 30) ---------------------------
def test_every_option_of_ours_falls_back_to_its_recipecache_variable() -> None:
    """torchrun's model: ``--foo-bar`` not given reads ``RECIPECACHE_FOO_BAR``, for every option of our own."""
    parser = build_parser(environ={})
    assert {fallback.option: fallback.variable for fallback in parser.fallbacks} == {
        option: "RECIPECACHE_" + option[2:].replace("-", "_").upper()
        for option in ("--url", "--namespace", "--secret-file", "--run-dir", "--report", "--no-enable", "--threads",
                       "--rank-dirs", "--node-dir", "--no-node-tier", "--quiet", "--exit-grace", "--prewarm",
                       "--precompile", "--no-stall", "--hpu", "--hpu-dir", "--hpu-max-size-mb", "--hpu-clear")}


def test_an_option_not_given_is_read_from_its_variable_and_the_command_line_wins(script: Path,
                                                                                tmp_path: Path) -> None:
    environ = {"RECIPECACHE_EXIT_GRACE": "30", "RECIPECACHE_NO_STALL": "1", "RECIPECACHE_THREADS": "3",
               "RECIPECACHE_QUIET": "1", "RECIPECACHE_RUN_DIR": str(tmp_path / "runs"),
               "RECIPECACHE_NODE_DIR": str(tmp_path / "node-{rank}")}
    args = build_parser(environ=environ).parse_args(["--nproc", "2", str(script)])
    config = LaunchConfig.from_args(args)
    assert (config.exit_grace_s, config.no_stall, config.threads, config.quiet) == (30.0, True, 3, True)
    assert config.run_dir == tmp_path / "runs"
    assert config.rank_env({})["RECIPECACHE_NODE_DIR"] == str(tmp_path / "node-{rank}"), "each rank makes its own"
    given = LaunchConfig.from_args(build_parser(environ=environ).parse_args(
        ["--exit-grace", "50", "--threads", "2", str(script)]))
    assert (given.exit_grace_s, given.threads) == (50.0, 2)


@pytest.mark.parametrize(("variable", "value", "error"), [
    ("RECIPECACHE_EXIT_GRACE", "nan", "RECIPECACHE_EXIT_GRACE='nan' must be a positive, finite number of seconds"),
    ("RECIPECACHE_THREADS", "x", "RECIPECACHE_THREADS='x' must be a whole number from 1 to 4096"),
    ("RECIPECACHE_HPU_MAX_SIZE_MB", "0", "RECIPECACHE_HPU_MAX_SIZE_MB='0' must be a whole number from 1 to 1073741824"),
    ("RECIPECACHE_QUIET", "yes", "RECIPECACHE_QUIET='yes': use 1 (on) or 0 (off)"),
    ("RECIPECACHE_NO_STALL", "true", "RECIPECACHE_NO_STALL='true': use 1 (on) or 0 (off)"),
])
def test_a_bad_value_is_one_line_under_the_name_it_came_by(script: Path, tmp_path: Path, variable: str, value: str,
                                                          error: str) -> None:
    """The same check and sentence for the option and its variable, from the real command."""
    environ = {**os.environ, variable: value}
    if variable.startswith("RECIPECACHE_HPU_"):
        environ["RECIPECACHE_HPU"] = "1"
        environ["RECIPECACHE_HPU_DIR"] = str(tmp_path / "recipes")
    proc = subprocess.run([sys.executable, "-m", "launcher.main", str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=environ, timeout=120, check=False)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert error in proc.stderr
    option = "--" + variable.removeprefix("RECIPECACHE_").lower().replace("_", "-")
    on_the_command_line = [option] if value in ("yes", "true") else [option, value]
    if value not in ("yes", "true"):  # a switch on the command line takes no value
        proc = subprocess.run([sys.executable, "-m", "launcher.main", *on_the_command_line, str(script)],
                              capture_output=True, text=True, cwd=tmp_path,
                              env={**environ, variable: ""}, timeout=120, check=False)
        assert proc.returncode == 2
        assert error.replace(variable, option) in proc.stderr


def test_the_old_spelling_of_the_url_option_still_works_and_says_so(script: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser(environ={}).parse_args(["--cache", f"file://{tmp_path}/old", str(script)])
    assert LaunchConfig.from_args(args).url == f"file://{tmp_path}/old"
    assert args.deprecations == ["--cache is deprecated; use --url"]
    assert main(["--cache", "foo://bar", str(script)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "recipecache-run: warning: --cache is deprecated; use --url"
    assert lines[1].startswith("recipecache-run: error: ")


@pytest.mark.parametrize("argv", [["--url", "file:///x/a", "--cache", "file:///x/b"],
                                  ["--cache", "file:///x/b", "--url", "file:///x/a"]])
def test_the_url_and_its_old_spelling_both_given_is_bad_input(argv: list[str], script: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: ``--url A --cache B`` used B, silently; which one the user meant is a guess."""
    assert main([*argv, str(script)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "recipecache-run: error: --cache and --url both given: use --url only (see --help)"]


@pytest.mark.parametrize(("argv", "environ", "named"), [
    (["--run-dir", "/dev/null"], {}, "--run-dir /dev/null: it is a device, not a directory"),
    # the report's own path is fine: the launcher's mkdir of the run directory was a traceback, after the checks
    (["--run-dir", "/dev/null", "--report", "{tmp}/r.json"], {}, "--run-dir /dev/null: it is a device"),
    (["--run-dir", "{tmp}/train.py/runs"], {}, "--run-dir {tmp}/train.py/runs: {tmp}/train.py is a regular file"),
    ([], {"RECIPECACHE_RUN_DIR": "/dev/null"}, "RECIPECACHE_RUN_DIR /dev/null: it is a device"),
])
def test_a_run_dir_that_cannot_be_one_is_named_as_the_user_gave_it(argv: list[str], environ: dict[str, str],
                                                                   named: str, script: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: ``--run-dir /dev/null`` blamed RECIPECACHE_REPORT, a variable nobody set."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RECIPECACHE_REPORT", raising=False)
    assert main([arg.format(tmp=tmp_path) for arg in argv] + [str(script)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"recipecache-run: error: {named.format(tmp=tmp_path)}"), lines
    assert "RECIPECACHE_REPORT" not in lines[0]


def test_torchruns_options_with_values_it_takes_pass_the_check(script: Path) -> None:
    argv = ["--nnodes", "1:2", "--max-restarts", "3", "--monitor-interval", "0.5", "-t", "3", "--redirects", "0:1,1:2",
            "--rdzv-conf", "timeout=30,is_host=1", "--master-port", "29500", "--start-method", "fork", str(script)]
    options = dict(config_for(*argv).torchrun_options)
    assert (options["--nnodes"], options["--monitor-interval"], options["--rdzv-conf"]) == (
        "1:2", "0.5", "timeout=30,is_host=1")


@pytest.mark.torch
def test_the_bootstrap_freezes_the_imports_not_the_scripts_objects(tmp_path: Path) -> None:
    """After enable() (torch imported) the bootstrap freezes what is alive: full collections, and the interpreter's
    shutdown, no longer walk torch's modules. What the script makes is still collected: a cycle it drops is
    finalized by a collection, as under ``python script``."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import gc, weakref\n"
        "frozen = gc.get_freeze_count()\n"
        "class Node:\n"
        "    pass\n"
        "node = Node()\n"
        "node.me = node\n"
        "finalized = []\n"
        "weakref.finalize(node, finalized.append, 'collected')\n"
        "del node\n"
        "gc.collect()\n"
        "print(frozen, finalized)\n"
    )
    environ = {**{k: v for k, v in os.environ.items() if not k.startswith("RECIPECACHE_")},
               "RECIPECACHE_AUTO_ENABLE": "1", "RECIPECACHE_DIR": str(tmp_path / "store")}
    proc = subprocess.run([sys.executable, "-m", "launcher.bootstrap", str(probe)], capture_output=True, text=True,
                          cwd=tmp_path, env=environ, timeout=600, check=False)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    frozen, finalized = proc.stdout.split(maxsplit=1)
    assert int(frozen) > 10_000, "the imports were not frozen"
    assert finalized.strip() == "['collected']"
