"""deploy/: the manifests parse, agree with each other, with deploy/README.md and with the Redis
backend; the Redis config and the rendered ACL work on a real redis-server; the Slurm template
launches one recipecache-run per node with the right rendezvous and cache URL, which reaches it
through the environment only (a password in process arguments is visible to every user in ps)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

import recipecache
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_server import RedisServer, free_port

from recipecache.backends.redis import ACL_COMMANDS, RedisBackend

ROOT = Path(__file__).resolve().parents[1]
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


def test_every_yaml_file_parses_and_k8s_objects_are_named() -> None:
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert {f.relative_to(DEPLOY).as_posix() for f in files} >= {
        "docker-compose.yml",
        "kustomization.yaml",
        "k8s/redis.yaml",
        "k8s/train-job.yaml",
        "k8s/tls/kustomization.yaml",
    }
    for f in files:
        load_docs(f)
    for f in (DEPLOY / "k8s/redis.yaml", DEPLOY / "k8s/train-job.yaml"):
        for doc in load_docs(f):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], f


def test_shell_scripts_have_valid_syntax() -> None:
    subprocess.run(["bash", "-n", str(DEPLOY / "slurm/train.sbatch")], check=True)
    for script in REDIS_DIR.glob("*.sh"):
        subprocess.run(["sh", "-n", str(script)], check=True)


def test_kustomization_ships_every_file_the_statefulset_uses() -> None:
    kust = load_docs(DEPLOY / "kustomization.yaml")[0]
    for resource in kust["resources"]:
        assert (DEPLOY / resource).is_file(), resource
    (gen,) = kust["configMapGenerator"]
    shipped = {Path(f).name for f in gen["files"]}
    for f in gen["files"]:
        assert (DEPLOY / f).is_file(), f
    assert shipped == {p.name for p in REDIS_DIR.iterdir()}, "every file of deploy/redis/ goes into the ConfigMap"

    sts = k8s_object(DEPLOY / "k8s/redis.yaml", "StatefulSet", "recipecache-redis")
    pod = sts["spec"]["template"]["spec"]
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == gen["name"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert container["command"] == ["sh", f"{mounts['config']}/start-redis.sh"]

    tls = load_docs(DEPLOY / "k8s/tls/kustomization.yaml")[0]
    assert tls["kind"] == "Component"
    (patch,) = tls["patches"]
    assert patch["target"] == {"kind": "StatefulSet", "name": sts["metadata"]["name"]}
    patched = yaml.safe_load(patch["patch"])["spec"]["template"]["spec"]
    assert env_of(patched["containers"][0])["REDIS_TLS"]["value"] == "1"
    assert patched["containers"][0]["volumeMounts"][0]["mountPath"] == "/tls"
    tls_conf = conf_directives(REDIS_DIR / "tls.conf")
    assert all(tls_conf[k].startswith("/tls/") for k in ("tls-cert-file", "tls-key-file", "tls-ca-cert-file"))


def test_redis_conf_suits_a_cache() -> None:
    conf = conf_directives(REDIS_DIR / "redis.conf")
    assert conf["maxmemory-policy"] == "allkeys-lru"
    assert re.fullmatch(r"\d+[kmg]b", conf["maxmemory"])
    assert conf["port"] == "6379"
    assert conf["aclfile"] == "/data/users.acl"
    assert conf["stop-writes-on-bgsave-error"] == "no"
    tls = conf_directives(REDIS_DIR / "tls.conf")
    assert tls["port"] == "0" and tls["tls-port"] == "6379"
    readme = (DEPLOY / "README.md").read_text()
    for named in ("allkeys-lru", f"maxmemory {conf['maxmemory']}", "tls-port 6379", "6379"):
        assert named in readme, named


def test_acl_grants_exactly_the_backend_commands_on_rc_keys() -> None:
    template = (REDIS_DIR / "users.acl.template").read_text()
    rules = acl_user_rules(template, "recipecache")
    commands = granted(rules)
    assert len(commands) == len(set(commands)), "a command granted twice"
    assert set(commands) == set(ACL_COMMANDS)
    assert [r for r in rules if r.startswith("~")] == ["~rc:*"]
    assert not any(r.startswith(("%", "&", "allkeys", "allchannels", "allcommands", "nopass")) for r in rules)
    assert rules.index("-@all") < min(rules.index(f"+{c}") for c in commands)
    assert "resetchannels" in rules and "on" in rules

    default = acl_user_rules(template, "default")
    assert "off" in default and "resetpass" in default and "-@all" in default
    assert not any(r.startswith((">", "#", "nopass", "+")) for r in default)

    readme = (DEPLOY / "README.md").read_text()
    listed = re.search(r"ACL_COMMANDS.*?\n\n\s*`([^`]+)`", readme, re.DOTALL)
    assert listed and sorted(listed.group(1).split()) == sorted(ACL_COMMANDS), "README lists the backend's commands"


def test_redis_manifests_name_ports_probes_persistence_and_secret() -> None:
    path = DEPLOY / "k8s/redis.yaml"
    sts = k8s_object(path, "StatefulSet", "recipecache-redis")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()

    headless = k8s_object(path, "Service", sts["spec"]["serviceName"])
    client = k8s_object(path, "Service", "redis")
    assert headless["spec"]["clusterIP"] == "None"
    for svc in (headless, client):
        assert svc["spec"]["selector"].items() <= labels.items()
        assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(6379, "redis")]

    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert image_version(container["image"]) >= ((7, 2) if NEEDS_REDIS_7_2 & set(ACL_COMMANDS) else (7, 0))
    assert container["ports"] == [{"name": "redis", "containerPort": 6379}]
    probe = container["livenessProbe"]["exec"]["command"], container["readinessProbe"]["exec"]["command"]
    assert probe == (["sh", "/etc/redis/probe.sh", "live"], ["sh", "/etc/redis/probe.sh", "ready"])

    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert claim["spec"]["resources"]["requests"]["storage"]

    passwords = next(v for v in pod["volumes"] if v["name"] == "passwords")
    assert passwords["secret"]["secretName"] == "recipecache-redis"
    env = env_of(container)
    for var, key in (
        ("REDIS_PASSWORD_FILE", "password"),
        ("REDIS_PREVIOUS_PASSWORD_FILE", "previous-password"),
        ("REDIS_ADMIN_PASSWORD_FILE", "admin-password"),
    ):
        assert env[var]["value"] == f"{mounts['passwords']}/{key}"
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_compose_runs_the_same_redis_as_kubernetes() -> None:
    compose = load_docs(DEPLOY / "docker-compose.yml")[0]
    redis_svc = compose["services"]["redis"]
    sts = k8s_object(DEPLOY / "k8s/redis.yaml", "StatefulSet", "recipecache-redis")
    k8s_container = sts["spec"]["template"]["spec"]["containers"][0]
    assert redis_svc["image"] == k8s_container["image"]
    assert redis_svc["entrypoint"] == k8s_container["command"]
    assert "6379:6379" in redis_svc["ports"]
    assert "./redis:/etc/redis:ro" in redis_svc["volumes"]
    assert any(v.endswith(":/data") and v.split(":")[0] in compose["volumes"] for v in redis_svc["volumes"])
    assert redis_svc["healthcheck"]["test"] == ["CMD", *k8s_container["readinessProbe"]["exec"]["command"]]

    secrets = compose["secrets"]
    assert set(redis_svc["secrets"]) == set(secrets)
    files = {redis_svc["environment"][v] for v in env_of(k8s_container) if v.endswith("_FILE")}
    assert files == {f"/run/secrets/{name}" for name in secrets}
    for spec in secrets.values():
        assert (DEPLOY / spec["file"]).parent == DEPLOY / "secrets"
    ignore = (DEPLOY / "secrets/.gitignore").read_text().split()
    assert "*" in ignore, "password files must stay out of git"


def test_train_job_wires_rendezvous_cache_and_secrets() -> None:
    path = DEPLOY / "k8s/train-job.yaml"
    job = k8s_object(path, "Job", "recipecache-train")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    (container,) = pod["containers"]
    env = env_of(container)
    nnodes = int(env["NNODES"]["value"])
    assert spec["completions"] == spec["parallelism"] == nnodes

    svc = k8s_object(path, "Service", pod["subdomain"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [29400]

    command = " ".join(container["command"] + container["args"])
    rdzv_host = f"{job['metadata']['name']}-0.{pod['subdomain']}"  # pod 0's DNS name
    for part in (
        "recipecache-run",
        '--nnodes "$NNODES"',
        '--node-rank "$JOB_COMPLETION_INDEX"',
        "--rdzv-backend c10d",
        f'--rdzv-endpoint "{rdzv_host}:29400"',
        '--nproc "$NPROC_PER_NODE"',
        "train.py",
    ):
        assert part in command, part
    assert "--cache" not in command and "RECIPECACHE_URL" not in command, "the URL holds the password: env only"
    assert int(env["NPROC_PER_NODE"]["value"]) == container["resources"]["limits"]["nvidia.com/gpu"]

    # $(REDIS_PASSWORD) expands only when REDIS_PASSWORD is defined earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("RECIPECACHE_URL")
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "recipecache-redis", "key": "password"}
    url = env["RECIPECACHE_URL"]["value"]
    assert url == "redis://recipecache:$(REDIS_PASSWORD)@redis:6379/0"
    k8s_object(DEPLOY / "k8s/redis.yaml", "Service", "redis")  # the URL's host
    acl_user_rules((REDIS_DIR / "users.acl.template").read_text(), "recipecache")  # the URL's user
    assert env["RECIPECACHE_NAMESPACE"]["value"]

    secret_file = Path(env["RECIPECACHE_SECRET_FILE"]["value"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if mounts.get(v["name"]) == str(secret_file.parent))
    assert volume["secret"]["secretName"] == "recipecache-signing"
    readme = (DEPLOY / "README.md").read_text()
    assert "recipecache-signing --from-literal=secret=" in readme
    assert "recipecache-redis \\\n  --from-literal=password=" in readme


# ---------------------------------------------------------------- the Slurm template, with stubs


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


# ---------------------------------------------------------------- a real redis-server


def render_acl(
    tmp_path: Path, password: str = JOB_PASSWORD, previous: str = PREVIOUS_PASSWORD
) -> subprocess.CompletedProcess[str]:
    for name, value in (("password", password), ("previous", previous), ("admin", ADMIN_PASSWORD)):
        (tmp_path / name).write_text(value + "\n")
    env = dict(
        os.environ,
        REDIS_ACL_FILE=str(tmp_path / "users.acl"),
        REDIS_PASSWORD_FILE=str(tmp_path / "password"),
        REDIS_PREVIOUS_PASSWORD_FILE=str(tmp_path / "previous"),
        REDIS_ADMIN_PASSWORD_FILE=str(tmp_path / "admin"),
    )
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
def start_deployed(tmp_path: Path, extra_conf: str = "") -> Iterator[Deployed]:
    """deploy/redis/redis.conf (+ extra_conf) and the ACL file render-acl.sh writes, plus a user
    with no rights; the overrides after the include keep the server on a free local port."""
    result = render_acl(tmp_path)
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


@pytest.fixture
def deployed(tmp_path: Path) -> Iterator[Deployed]:
    with start_deployed(tmp_path) as d:
        yield d


# One use of each command the job user may be granted ({k}: a key). A command the backend
# starts to use needs a line here.
SAMPLES = {
    "get": ["GET", "{k}"],
    "getrange": ["GETRANGE", "{k}", "0", "63"],
    "strlen": ["STRLEN", "{k}"],
    "set": ["SET", "{k}", "v", "NX", "PX", "1000"],
    "del": ["DEL", "{k}"],
    "unlink": ["UNLINK", "{k}"],
    "mget": ["MGET", "{k}"],
    "exists": ["EXISTS", "{k}"],
    "pexpire": ["PEXPIRE", "{k}", "1000"],
    "pttl": ["PTTL", "{k}"],
    "rpush": ["RPUSH", "{k}", "1"],
    "blmove": ["BLMOVE", "{k}", "{k}", "RIGHT", "LEFT", "0.01"],
    "eval": ["EVAL", "return 1", "1", "{k}"],
    "evalsha": ["EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "1", "{k}"],
    "script|load": ["SCRIPT", "LOAD", "return 1"],
    "script|exists": ["SCRIPT", "EXISTS", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"],
    "scan": ["SCAN", "0", "MATCH", "rc:*", "COUNT", "500"],
    "ping": ["PING"],
    "multi": ["MULTI"],
    "exec": ["EXEC"],
    "info": ["INFO"],
    "auth": ["AUTH", "recipecache", "x"],
    "hello": ["HELLO", "3"],
    "client|setinfo": ["CLIENT", "SETINFO", "LIB-NAME", "x"],
}
FORBIDDEN = [
    ["FLUSHALL"], ["FLUSHDB"], ["CONFIG", "GET", "maxmemory"], ["CONFIG", "SET", "maxmemory", "0"],
    ["KEYS", "*"], ["DEBUG", "SLEEP", "0"], ["SELECT", "1"], ["ACL", "LIST"], ["SHUTDOWN"],
    ["PUBLISH", "rc:ch", "x"], ["SUBSCRIBE", "rc:ch"], ["MONITOR"], ["CLIENT", "LIST"], ["CLIENT", "KILL", "ID", "1"],
    ["SCRIPT", "FLUSH"], ["FUNCTION", "FLUSH"], ["BGSAVE"], ["REPLICAOF", "NO", "ONE"], ["MODULE", "LIST"],
]  # fmt: skip


@pytest.mark.redis
def test_server_runs_redis_conf_and_the_acl_as_written(deployed: Deployed) -> None:
    admin = deployed.admin()
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert int(admin.config_get("maxmemory")["maxmemory"]) == 2 * 1024**3
    user = admin.acl_getuser("recipecache")
    assert user["keys"] == ["~rc:*"] and user["channels"] == [] and user["flags"] == ["on"]
    assert user["categories"] == ["-@all"] and {c[1:] for c in user["commands"]} == deployed.granted
    assert deployed.granted == set(ACL_COMMANDS) - (NEEDS_REDIS_7_2 if redis_server_version() < (7, 2) else set())
    assert len(user["passwords"]) == 2  # the current one and the previous one
    assert admin.acl_getuser("default")["flags"] == ["off"]
    assert admin.acl_getuser("default")["passwords"] == []


@pytest.mark.redis
def test_acl_allows_each_backend_command_on_rc_keys_only(deployed: Deployed) -> None:
    assert not deployed.granted - SAMPLES.keys(), "add a sample for each new command"
    for command in deployed.granted:
        argv = SAMPLES[command]
        assert deployed.dryrun(*(a.format(k="rc:e:ns/00ff00ff") for a in argv)) == "OK", command
        if "{k}" in argv:
            assert "no permissions" in deployed.dryrun(*(a.format(k="other:key") for a in argv)), command
    unknown_here = NEEDS_REDIS_7_2 if redis_server_version() < (7, 2) else set()
    for command in SAMPLES.keys() - deployed.granted - unknown_here:
        argv = [a.format(k="rc:e:ns/00ff00ff") for a in SAMPLES[command]]
        assert deployed.dryrun(*argv) != "OK", f"{command} is allowed but not in ACL_COMMANDS"
    for argv in FORBIDDEN:
        assert "no permissions" in deployed.dryrun(*argv), argv


@pytest.mark.redis
def test_the_redis_backend_works_as_the_job_user(deployed: Deployed) -> None:
    """The real backend, through the ACL user, with values small and chunked, leases and scan;
    afterwards the ACL log shows no refused command beyond redis-py's connect extras."""
    url = f"redis://recipecache:{JOB_PASSWORD}@127.0.0.1:{deployed.server.port}/0"
    backend = RedisBackend(url, redacted_url=url.replace(JOB_PASSWORD, "***"), chunk_size=1024)
    small, big, bigger = b"s" * 100, os.urandom(5000), os.urandom(3000)
    try:
        backend.put("ns/0a0a0a0a", small)
        backend.put("ns/0b0b0b0b", big)
        assert backend.get("ns/0a0a0a0a") == small and backend.get("ns/0b0b0b0b") == big
        backend.put("ns/0b0b0b0b", bigger)  # swaps the manifest, deletes the old chunks
        assert backend.get("ns/0b0b0b0b") == bigger and backend.get("ns/0c0c0c0c") is None
        assert {e.key for e in backend.scan("ns")} == {"ns/0a0a0a0a", "ns/0b0b0b0b"}
        assert backend.lease_add("ns/0d0d0d0d", "token-1", 30)
        assert not backend.lease_add("ns/0d0d0d0d", "token-2", 30)
        assert backend.lease_renew("ns/0d0d0d0d", "token-1", 30)
        assert not backend.lease_renew("ns/0d0d0d0d", "token-2", 30)
        backend.lease_release("ns/0d0d0d0d", "token-2")  # not the holder: a no-op
        assert not backend.lease_add("ns/0d0d0d0d", "token-2", 30)
        holder = backend.lease_holder("ns/0d0d0d0d")
        assert holder is not None and holder.token == "token-1"
        assert backend.lease_wait("ns/0d0d0d0d", "token-1", 0.05) is False
        backend.lease_release("ns/0d0d0d0d", "token-1")  # wakes its waiters
        assert backend.lease_wait("ns/0d0d0d0d", "token-1", 5) is True
        assert backend.lease_add("ns/0d0d0d0d", "token-2", 30)
        backend.delete("ns/0a0a0a0a")
        assert backend.get("ns/0a0a0a0a") is None
        assert backend.evict(0) == len(bigger)
    finally:
        backend.close()
    admin = deployed.admin()
    assert all(k.startswith(b"rc:") for k in admin.scan_iter()), "every backend key is under rc:"
    refused = [e for e in admin.acl_log() if e["username"] == "recipecache" and e["object"] not in CONNECT_EXTRAS]
    assert refused == []


@pytest.mark.redis
@pytest.mark.parametrize("protocol", [2, 3])  # AUTH then CLIENT SETINFO, or HELLO 3 AUTH
def test_job_user_reads_writes_and_runs_scripts_on_rc_keys(deployed: Deployed, protocol: int) -> None:
    r = deployed.client(protocol=protocol)
    assert r.ping()
    assert r.set("rc:a", b"artifact") and r.set("rc:lease", b"token-1", nx=True, px=60_000)
    assert r.get("rc:a") == b"artifact" and r.getrange("rc:a", 0, 3) == b"arti"
    assert r.mget("rc:a", "rc:missing") == [b"artifact", None]
    assert r.pexpire("rc:a", 60_000)
    assert set(r.scan_iter(match="rc:*")) == {b"rc:a", b"rc:lease"}
    # EVALSHA, and SCRIPT LOAD on the first call (the script is not cached yet)
    compare_and_delete = r.register_script(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
    )
    assert compare_and_delete(keys=["rc:lease"], args=["token-2"]) == 0
    assert compare_and_delete(keys=["rc:lease"], args=["token-1"]) == 1
    assert r.delete("rc:a") == 1
    assert deployed.client(password=PREVIOUS_PASSWORD, protocol=protocol).get("rc:a") is None


@pytest.mark.redis
def test_job_user_is_refused_outside_rc_keys_and_its_commands(deployed: Deployed) -> None:
    r = deployed.client()
    for call in (
        lambda: r.get("other"),
        lambda: r.set("other", b"x"),
        lambda: r.mget("rc:a", "other"),
        lambda: r.delete("other"),
        lambda: r.register_script("return redis.call('get', KEYS[1])")(keys=["other"]),
        lambda: r.flushall(),
        lambda: r.config_get("maxmemory"),
        lambda: r.keys("*"),
        lambda: r.execute_command("SELECT", 1),
        lambda: r.publish("rc:channel", b"x"),
        lambda: r.acl_list(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
        r.register_script("return redis.call('flushall')")(keys=["rc:a"])
    with pytest.raises(redis.exceptions.ResponseError):
        r.execute_command("DEBUG", "SLEEP", "0")
    assert deployed.admin().dbsize() == 0, "nothing was written"


@pytest.mark.redis
def test_wrong_passwords_unnamed_clients_and_users_without_rights_are_refused(deployed: Deployed) -> None:
    for username, password in (
        ("recipecache", "wrong-password-0123456789"),
        ("recipecache", ADMIN_PASSWORD),
        (None, JOB_PASSWORD),  # the default user
        (None, None),
        ("admin", JOB_PASSWORD),
    ):
        for protocol in (2, 3):
            with pytest.raises(redis.exceptions.AuthenticationError):
                deployed.client(username, password, protocol=protocol).get("rc:a")
    nobody = deployed.client("nobody", "nobody-password-0123")
    for call in (lambda: nobody.get("rc:a"), nobody.ping):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()


@pytest.mark.redis
def test_password_rotation_as_the_readme_describes(deployed: Deployed) -> None:
    """README: add the new password's hash on the live server, then remove the old one's."""

    def rule(prefix: str, password: str) -> str:
        return prefix + hashlib.sha256(password.encode()).hexdigest()

    new = "new-job-password-0123456789"
    admin = deployed.admin()
    admin.execute_command("ACL", "SETUSER", "recipecache", rule("#", new))
    for password in (JOB_PASSWORD, new):
        assert deployed.client(password=password).set("rc:x", b"1")
    admin.execute_command("ACL", "SETUSER", "recipecache", rule("!", JOB_PASSWORD))
    assert deployed.client(password=new).get("rc:x") == b"1"
    with pytest.raises(redis.exceptions.AuthenticationError):
        deployed.client(password=JOB_PASSWORD).get("rc:x")
    assert admin.acl_getuser("recipecache")["keys"] == ["~rc:*"], "rotation keeps the rest of the user"


@pytest.mark.redis
def test_probe_script_live_and_ready(deployed: Deployed) -> None:
    def probe(mode: str, password_file: Path) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, REDIS_PORT=str(deployed.server.port), REDIS_PASSWORD_FILE=str(password_file))
        return subprocess.run(
            ["sh", str(REDIS_DIR / "probe.sh"), mode], check=False, env=env, capture_output=True, text=True
        )

    wrong = deployed.workdir / "wrong"
    wrong.write_text("wrong-password-0123456789\n")
    good = deployed.workdir / "password"
    assert probe("live", wrong).returncode == 0, "liveness needs no password"
    assert probe("ready", good).returncode == 0
    failed = probe("ready", wrong)
    assert failed.returncode == 1 and "WRONGPASS" in failed.stderr
    assert probe("nonsense", good).returncode == 2


def test_render_acl_refuses_passwords_that_cannot_go_into_a_url(tmp_path: Path) -> None:
    for bad, why in (
        ("short-pw", "shorter than 16"),
        ("has space " + "x" * 16, "outside"),
        ("p@ss:w/rd" + "x" * 16, "outside"),
    ):
        result = render_acl(tmp_path, password=bad)
        assert result.returncode == 2, bad
        assert why in result.stderr and result.stderr.count("\n") == 1
        assert not (tmp_path / "users.acl").exists()
    result = render_acl(tmp_path, previous="")  # a blank previous-password file: one password
    assert result.returncode == 0, result.stderr
    rules = acl_user_rules((tmp_path / "users.acl").read_text(), "recipecache")
    assert len([r for r in rules if r.startswith("#")]) == 1


@pytest.mark.redis
def test_tls_conf_serves_the_job_user_over_tls(tmp_path: Path) -> None:
    """tls.conf with a throwaway CA; the plain port stays open here only for the test helper's
    start check (tls.conf itself closes it: port 0, checked above)."""
    certs = tmp_path / "tls"
    certs.mkdir()
    (certs / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca"],
        ["req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "tls.crt", "-days", "1", "-extfile", "san.ext"],
    ):  # fmt: skip
        subprocess.run(["openssl", *cmd], cwd=certs, check=True, capture_output=True)
    tls_port = free_port()
    extra = f"include {REDIS_DIR / 'tls.conf'}\ntls-port {tls_port}\n" + "".join(
        f"{k} {certs / v}\n"
        for k, v in (("tls-cert-file", "tls.crt"), ("tls-key-file", "tls.key"), ("tls-ca-cert-file", "ca.crt"))
    )
    with start_deployed(tmp_path, extra) as deployed:
        r = redis.Redis(
            host="127.0.0.1", port=tls_port, username="recipecache", password=JOB_PASSWORD,
            ssl=True, ssl_ca_certs=str(certs / "ca.crt"),
        )  # fmt: skip
        assert r.set("rc:tls", b"1") and r.get("rc:tls") == b"1"
        # the store itself over rediss://, the CA passed through the URL as the README says
        store = recipecache.open_store(
            f"rediss://recipecache:{JOB_PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={certs / 'ca.crt'}", namespace="tls"
        )
        store.put("k", b"over tls")
        assert store.get("k") == b"over tls" and store.stats()["hits"] == 1
        env = dict(
            os.environ, REDIS_TLS="1", REDIS_TLS_CA=str(certs / "ca.crt"), REDIS_PORT=str(tls_port),
            REDIS_PASSWORD_FILE=str(deployed.workdir / "password"),
        )  # fmt: skip
        probe = subprocess.run(
            ["sh", str(REDIS_DIR / "probe.sh"), "ready"], check=False, env=env, capture_output=True, text=True
        )
        assert probe.returncode == 0, probe.stderr
