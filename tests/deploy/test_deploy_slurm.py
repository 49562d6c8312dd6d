"""deploy/slurm/train.sbatch with stub scontrol/srun/recipecache-run: one recipecache-run per node
with the right rendezvous, and the cache URL reaches it through the environment only (a
password in process arguments is visible to every user in ps)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.deploy_support import DEPLOY, JOB_PASSWORD


@dataclass
class Slurm:
    home: Path
    out: Path
    env: dict[str, str]

    def sbatch(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(DEPLOY / "slurm/train.sbatch"), *args],
            check=False,
            env=self.env,
            capture_output=True,
            text=True,
        )


@pytest.fixture
def slurm(tmp_path: Path) -> Slurm:
    """Stub scontrol/srun/recipecache-run: srun runs its command once per node with SLURM_NODEID
    set, as a real one-task-per-node srun does; recipecache-run records its argv and environment."""
    stubs, out, home = tmp_path / "bin", tmp_path / "out", tmp_path / "home"
    for d in (stubs, out, home / ".config/recipecache"):
        d.mkdir(parents=True)
    scripts = {
        "scontrol": '[ "$1 $2 $3" = "show hostnames node-[a-b]" ] || exit 9\necho node-a\necho node-b\n',
        "srun": 'printf "%s\\n" "$@" > "$STUB_OUT/srun"\nwhile [[ $1 == -* ]]; do shift; done\n'
        'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit; done\n',
        "recipecache-run": 'printf "%s\\n" "$@" > "$STUB_OUT/args.$SLURM_NODEID"\nenv > "$STUB_OUT/env.$SLURM_NODEID"\n',
    }
    for name, body in scripts.items():
        (stubs / name).write_text("#!/bin/bash\n" + body)
        (stubs / name).chmod(0o755)
    for name, value in (("redis-password", JOB_PASSWORD), ("secret", "signing-key-0123456789abcdef")):
        (home / ".config/recipecache" / name).write_text(value + "\n")
        (home / ".config/recipecache" / name).chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECIPECACHE_", "SLURM_"))}
    env.update(
        PATH=f"{stubs}:{env['PATH']}",
        HOME=str(home),
        STUB_OUT=str(out),
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_NNODES="2",
        SLURM_JOB_NAME="my-project",
        SLURM_GPUS_ON_NODE="4",
        RECIPECACHE_REDIS_HOST="redis.test",
    )
    return Slurm(home, out, env)


def test_sbatch_runs_one_launcher_per_node_with_rendezvous_on_the_first_node(slurm: Slurm) -> None:
    result = slurm.sbatch("train.py", "--lr", "3e-4")
    assert result.returncode == 0, result.stderr
    assert "--ntasks-per-node=1" in (slurm.out / "srun").read_text().split()
    assert JOB_PASSWORD not in (slurm.out / "srun").read_text(), "srun's arguments are visible in ps"
    url = f"redis://recipecache:{JOB_PASSWORD}@redis.test:6379/0"
    for rank in (0, 1):
        args = (slurm.out / f"args.{rank}").read_text().splitlines()
        assert args == [
            "--nnodes", "2", "--node-rank", str(rank), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "node-a:29400", "--nproc", "4",
            "train.py", "--lr", "3e-4",
        ]  # fmt: skip
        env = dict(line.split("=", 1) for line in (slurm.out / f"env.{rank}").read_text().splitlines() if "=" in line)
        assert env["RECIPECACHE_URL"] == url  # the launcher's default store: no --cache, no password in ps
        assert env["RECIPECACHE_NAMESPACE"] == "my-project"
        assert env["RECIPECACHE_SECRET_FILE"] == str(slurm.home / ".config/recipecache/secret")


def test_sbatch_refuses_readable_secret_files_and_a_missing_host(slurm: Slurm) -> None:
    (slurm.home / ".config/recipecache/secret").chmod(0o644)
    result = slurm.sbatch()
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "chmod 600" in result.stderr
    (slurm.home / ".config/recipecache/secret").chmod(0o600)
    del slurm.env["RECIPECACHE_REDIS_HOST"]
    result = slurm.sbatch()
    assert result.returncode == 2 and "RECIPECACHE_REDIS_HOST" in result.stderr
    assert not (slurm.out / "srun").exists()
