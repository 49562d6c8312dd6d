"""The start-up hook (:mod:`recipecache.autoenable`): how it installs, what it costs where off, which processes it
takes for ranks, how it names a job's run directory and which settings it gives a rank. The hook at work in real
jobs: ``tests/torch_integration/test_any_launcher.py``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from harness.hook_env import HOOK_PTH, hook_environ, make_hook_env
from harness.paths import REPO

from recipecache import autoenable, env
from recipecache.node_tier import default_node_dir


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hook_env(tmp_path_factory.mktemp("hook-env") / "venv")


def run(python: Path, code: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=hook_environ(**extra),
                          timeout=300, check=False)


LOADED = "import sys; print(sorted(m for m in sys.modules if m.startswith('recipecache')))"


@pytest.mark.parametrize("value", [None, "", "0"])
def test_off_the_line_imports_nothing(python: Path, value: str | None) -> None:
    proc = run(python, LOADED, **({} if value is None else {"RECIPECACHE_ENABLE": value}))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "[]"


def test_on_it_waits_for_torch_and_wraps_its_entry_points(python: Path) -> None:
    proc = run(python, LOADED + "; import torch; print(torch.compile.__module__, "
               "torch.distributed.init_process_group is torch.distributed.distributed_c10d.init_process_group)",
               RECIPECACHE_ENABLE="1")
    assert proc.returncode == 0, proc.stderr
    before, after = proc.stdout.splitlines()
    assert "recipecache.torch_integration" not in before, "nothing of the integration before torch"
    assert after == "torch True"  # wrapped (functools.wraps keeps the name), both names the same wrapper


def test_a_bad_switch_is_one_warning_and_the_process_goes_on(python: Path) -> None:
    proc = run(python, "print('ran')", RECIPECACHE_ENABLE="yes")
    assert proc.returncode == 0 and proc.stdout == "ran\n"
    assert proc.stderr.count("\n") == 1 and "RECIPECACHE_ENABLE='yes': use 1 (on) or 0 (off)" in proc.stderr


def test_a_package_that_cannot_be_imported_is_one_warning(python: Path, tmp_path: Path) -> None:
    """The .pth line catches what its import raises: one line, not site's traceback."""
    environ = hook_environ(RECIPECACHE_ENABLE="1")
    environ["PYTHONPATH"] = str(tmp_path)  # no recipecache there, and the base environment's editable one is not
    (tmp_path / "recipecache").mkdir()    # run: a package whose import fails
    (tmp_path / "recipecache" / "__init__.py").write_text("raise RuntimeError('broken install')\n")
    proc = subprocess.run([str(python), "-c", "print('ran')"], capture_output=True, text=True, env=environ,
                          timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout == "ran\n"
    assert proc.stderr.count("\n") == 1 and "cannot be imported (RuntimeError('broken install'))" in proc.stderr


def test_rank_dirs_are_made_for_ranks_only(python: Path, tmp_path: Path) -> None:
    code = "import os; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    rank = run(python, code, RECIPECACHE_ENABLE="1", RECIPECACHE_RANK_DIRS=str(tmp_path), RANK="1")
    assert rank.stdout.strip() == str(tmp_path / "rank1" / "inductor"), rank.stderr
    agent = run(python, code, RECIPECACHE_ENABLE="1", RECIPECACHE_RANK_DIRS=str(tmp_path / "agent"))
    assert agent.stdout.strip() == "None" and not (tmp_path / "agent").exists()


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_every_wheel_puts_the_line_in_site_packages(tmp_path: Path, kind: str) -> None:
    """``pip install .`` and ``pip install -e .`` install the wheel setuptools builds: the line is at its root."""
    source = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    out = tmp_path / "out"
    out.mkdir()
    build = "build_wheel" if kind == "wheel" else "build_editable"
    proc = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{build}({str(out)!r}))"],
                          cwd=source, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = out / proc.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(HOOK_PTH.name) == HOOK_PTH.read_bytes()


def test_the_line_is_one_import_line_that_checks_the_variable_first() -> None:
    """site runs a .pth line only when it starts with ``import``; the check comes before any import of ours."""
    (line,) = HOOK_PTH.read_text().splitlines()
    assert line.startswith("import os;")
    assert line.index(env.ENABLE) < line.index("recipecache.autoenable")


@pytest.mark.parametrize(("environ", "name"), [
    ({"TORCHELASTIC_RUN_ID": "5fc8-82bb", "SLURM_JOB_ID": "7"}, "torchelastic-5fc8-82bb"),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}, "slurm-7.2"),
    ({"SLURM_JOB_ID": "7"}, "slurm-7"),
    ({"PMIX_NAMESPACE": "prterun-host-1234@1"}, "mpi-prterun-host-1234-1"),
    ({"RAY_JOB_ID": "01000000"}, None),
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, None),
])
def test_the_run_directory_is_named_after_the_launchers_job(environ: dict[str, str], name: str | None) -> None:
    assert autoenable.job_name(environ) == name


def test_without_a_job_identity_rank_0_proposes_address_port_and_time() -> None:
    name = autoenable.fallback_job_name({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, now=0.0)
    assert name.startswith("10.0.0.1-29500-19") or name.startswith("10.0.0.1-29500-20")  # the local date of 0


def test_a_ray_job_is_named_by_its_id_and_rank_0s_time() -> None:
    """Ray's job id counts the jobs of one cluster: every new local cluster's first job is 01000000."""
    name = autoenable.fallback_job_name({"RAY_JOB_ID": "01000000", "MASTER_ADDR": "10.0.0.1"}, now=0.0)
    assert name.startswith(("ray-01000000-19", "ray-01000000-20"))


@pytest.mark.parametrize(("environ", "rank"), [
    ({"RANK": "3", "SLURM_PROCID": "5"}, 3), ({"SLURM_PROCID": "5"}, 5), ({"OMPI_COMM_WORLD_RANK": "2"}, 2),
    ({"LOCAL_RANK": "1"}, None), ({}, None), ({"RANK": "x"}, None),
])
def test_a_rank_is_a_process_whose_launcher_gave_it_a_global_rank(environ: dict[str, str], rank: int | None) -> None:
    assert autoenable.global_rank(environ) == rank


def test_a_rank_gets_what_recipecache_run_would_give_it(tmp_path: Path) -> None:
    environ = {"LOCAL_WORLD_SIZE": "2", env.RUNS_DIR: str(tmp_path)}
    got = autoenable.rank_environment(environ, rank=1, world=2, job="slurm-7", script="/jobs/train.py")
    run_dir = tmp_path / "slurm-7"
    assert got == {
        "RANK": "1", "WORLD_SIZE": "2", env.RUN_DIR: str(run_dir),
        env.METRICS_FILE: str(run_dir / "metrics-rank{rank}.json"), env.EVENT_LOG: str(run_dir / "events"),
        env.NODE_DIR: str(default_node_dir()), env.NAMESPACE: "train", "OMP_NUM_THREADS": "1",
    }


def test_what_the_environment_says_wins() -> None:
    environ = {"OMP_NUM_THREADS": "3", env.NAMESPACE: "mine", env.NODE_DIR: "", env.RUN_DIR: "/runs/x",
               "RANK": "1", "WORLD_SIZE": "2"}
    got = autoenable.rank_environment(environ, rank=1, world=2, job="ignored", script="-c")
    assert got == {env.METRICS_FILE: "/runs/x/metrics-rank{rank}.json", env.EVENT_LOG: "/runs/x/events"}


def test_a_rank_running_an_installed_packages_script_keeps_the_default_namespace(tmp_path: Path) -> None:
    """Ray starts its ranks as ``.../site-packages/ray/_private/workers/default_worker.py``: that name would be every
    Ray job's namespace, so such a rank keeps enable()'s default, as without the hook."""
    script = "/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py"
    got = autoenable.rank_environment({env.RUNS_DIR: str(tmp_path)}, rank=0, world=2, job="ray-01", script=script)
    assert env.NAMESPACE not in got and got["RANK"] == "0"
