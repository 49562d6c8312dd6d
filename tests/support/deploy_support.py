"""What the deploy/ tests share: where deploy/ is, the test passwords, manifest readers, and a
real redis-server running deploy/redis/redis.conf with the ACL file render-acl.sh writes."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import yaml
from harness.paths import REPO
from harness.ports import free_port
from harness.redis_server import RedisServer
from redis.backoff import NoBackoff
from redis.retry import Retry


ROOT = REPO
DEPLOY = ROOT / "deploy"
REDIS_DIR = DEPLOY / "redis"

JOB_PASSWORD = "job-password-0123456789abcdef"
PREVIOUS_PASSWORD = "old-job-password-0123456789"
ADMIN_PASSWORD = "admin-password-0123456789abcdef"

# Commands that exist from Redis 7.2 (the manifests' image) on: an older redis-server refuses to
# load an ACL file that names one, so for such a server the live tests drop those grants.
NEEDS_REDIS_7_2 = {"client|setinfo"}
# What redis-py sends on connect and shrugs off when refused (deploy/README.md).
CONNECT_EXTRAS = {"client|setinfo", "client|maint_notifications"}


def load_docs(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def k8s_object(path: Path, kind: str, name: str) -> dict:
    found = [d for d in load_docs(path) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{path}: expected one {kind} {name}, found {len(found)}"
    return found[0]


def conf_directives(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            out[name] = value.strip()
    return out


def acl_user_rules(text: str, user: str) -> list[str]:
    lines = [ln.split() for ln in text.splitlines() if ln.startswith(f"user {user} ")]
    assert len(lines) == 1, f"expected one ACL line for user {user}"
    return lines[0][2:]


def granted(rules: list[str]) -> list[str]:
    return [r[1:] for r in rules if r.startswith("+")]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def redis_server_version() -> tuple[int, int]:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"v=(\d+)\.(\d+)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def image_version(image: str) -> tuple[int, int]:
    m = re.fullmatch(r"redis:(\d+)\.(\d+)(?:[.-].*)?", image)
    assert m, f"expected a pinned redis:<major>.<minor> image, got {image}"
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------- static checks


def render_acl(
    tmp_path: Path, password: str = JOB_PASSWORD, previous: str = PREVIOUS_PASSWORD,
    projects: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run render-acl.sh; ``projects`` (namespace -> password file text) fills REDIS_PROJECTS_DIR."""
    for name, value in (("password", password), ("previous", previous), ("admin", ADMIN_PASSWORD)):
        (tmp_path / name).write_text(value + "\n")
    env = dict(
        os.environ,
        REDIS_ACL_FILE=str(tmp_path / "users.acl"),
        REDIS_PASSWORD_FILE=str(tmp_path / "password"),
        REDIS_PREVIOUS_PASSWORD_FILE=str(tmp_path / "previous"),
        REDIS_ADMIN_PASSWORD_FILE=str(tmp_path / "admin"),
    )
    if projects is not None:
        (tmp_path / "projects").mkdir(exist_ok=True)
        for namespace, text in projects.items():
            (tmp_path / "projects" / namespace).write_text(text)
        env["REDIS_PROJECTS_DIR"] = str(tmp_path / "projects")
    return subprocess.run(
        ["sh", str(REDIS_DIR / "render-acl.sh")], check=False, env=env, capture_output=True, text=True
    )


@dataclass
class Deployed:
    server: RedisServer
    workdir: Path
    granted: set[str]  # the job user's commands, as loaded into this redis-server

    def client(
        self, username: str | None = "recipecache", password: str | None = JOB_PASSWORD, **kw: object
    ) -> redis.Redis:
        # No retries: redis-py retries a refused AUTH (a ConnectionError) for seconds by default.
        return redis.Redis(
            host="127.0.0.1", port=self.server.port, username=username, password=password,
            retry=Retry(NoBackoff(), 0), **kw,
        )  # fmt: skip

    def admin(self) -> redis.Redis:
        return self.client("admin", ADMIN_PASSWORD, protocol=2)

    def dryrun(self, *argv: str) -> str:
        """Whether the job user may run argv, as the server's ACL sees it ("OK" or the reason)."""
        return self.admin().execute_command("ACL", "DRYRUN", "recipecache", *argv).decode()


@contextmanager
def start_deployed(
    tmp_path: Path, extra_conf: str = "", projects: dict[str, str] | None = None
) -> Iterator[Deployed]:
    """deploy/redis/redis.conf (+ extra_conf) and the ACL file render-acl.sh writes, plus a user
    with no rights; the overrides after the include keep the server on a free local port."""
    result = render_acl(tmp_path, projects=projects)
    assert result.returncode == 0, result.stderr
    acl_file = tmp_path / "users.acl"
    text = acl_file.read_text()
    for password in (JOB_PASSWORD, PREVIOUS_PASSWORD, ADMIN_PASSWORD):
        assert password not in text, "the rendered ACL file holds hashes, never passwords"
    commands = set(granted(acl_user_rules(text, "recipecache")))
    if redis_server_version() < (7, 2):
        for command in NEEDS_REDIS_7_2 & commands:
            text = text.replace(f" +{command}", "")
        commands -= NEEDS_REDIS_7_2
    acl_file.write_text(text + "user nobody on >nobody-password-0123 -@all\n")
    port = free_port()
    workdir = tmp_path / "server"
    config = (
        f"include {REDIS_DIR / 'redis.conf'}\n{extra_conf}\nbind 127.0.0.1\nport {port}\n"
        f'aclfile {acl_file}\nlogfile {workdir / "redis.log"}\nsave ""\n'
    )
    with RedisServer(workdir, config=config, port=port) as server:
        yield Deployed(server, tmp_path, commands)
