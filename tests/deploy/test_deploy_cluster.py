"""deploy/'s Redis Cluster variant: compose and the Kubernetes component agree with the single-Redis
files, and nodes started by start-redis.sh with REDIS_CLUSTER=1, joined by create-cluster.sh, serve
the job user exactly as the backend needs (ACL log clean)."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import yaml
from harness.ports import port_below
from harness.ports import free_port
from support.deploy_support import (
    ADMIN_PASSWORD, CONNECT_EXTRAS, DEPLOY, JOB_PASSWORD, REDIS_DIR, acl_user_rules, env_of, granted, k8s_object,
    load_docs, render_acl,
)

import recipecache
from recipecache.backends import open_backend
from recipecache.backends.redis import ACL_COMMANDS
from recipecache.backends.redis_cluster import CLUSTER_ACL_COMMANDS

STS = "recipecache-redis"


def test_compose_cluster_runs_six_nodes_of_the_same_redis_and_joins_them() -> None:
    single = load_docs(DEPLOY / "docker-compose.yml")[0]["services"]["redis"]
    compose = load_docs(DEPLOY / "docker-compose.cluster.yml")[0]
    nodes = {name: svc for name, svc in compose["services"].items() if name != "cluster-create"}
    assert len(nodes) == 6
    ports = set()
    for svc in nodes.values():
        assert (svc["image"], svc["entrypoint"], svc["user"]) == (single["image"], single["entrypoint"], single["user"])
        assert svc["environment"]["REDIS_CLUSTER"] == "1" and svc["network_mode"] == "host"
        assert svc["command"] == ["--port", svc["environment"]["REDIS_PORT"]], "the probe checks the node's port"
        assert "./redis:/etc/redis:ro" in svc["volumes"] and svc["healthcheck"] == single["healthcheck"]
        assert {k: v for k, v in svc["environment"].items() if k.endswith("_FILE")} == {
            k: v for k, v in single["environment"].items() if k.endswith("_FILE")}
        ports.add(svc["environment"]["REDIS_PORT"])
    create = compose["services"]["cluster-create"]
    assert create["entrypoint"][:2] == ["sh", "/etc/redis/create-cluster.sh"]
    assert {arg.rsplit(":", 1)[1] for arg in create["entrypoint"][2:]} == ports
    assert set(create["depends_on"]) == set(nodes)
    assert compose["secrets"] == load_docs(DEPLOY / "docker-compose.yml")[0]["secrets"]


def test_kubernetes_cluster_component_turns_the_statefulset_into_a_cluster() -> None:
    kust = load_docs(DEPLOY / "kustomization.yaml")[0]
    assert "#   - k8s/cluster" in (DEPLOY / "kustomization.yaml").read_text()
    sts = k8s_object(DEPLOY / "k8s/redis.yaml", "StatefulSet", STS)
    component = load_docs(DEPLOY / "k8s/cluster/kustomization.yaml")[0]
    assert component["kind"] == "Component"
    (patch,) = component["patches"]
    assert patch["target"] == {"kind": "StatefulSet", "name": STS}
    patched = yaml.safe_load(patch["patch"])
    assert patched["spec"]["replicas"] == 6
    (container,) = patched["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert env["REDIS_CLUSTER"]["value"] == "1"
    assert env["REDIS_CLUSTER_ANNOUNCE_HOSTNAME"]["value"] == f"$(POD_NAME).{sts['spec']['serviceName']}"

    (job_file,) = component["resources"]
    job = k8s_object(DEPLOY / "k8s/cluster" / job_file, "Job", "recipecache-redis-cluster-create")
    pod = job["spec"]["template"]["spec"]
    (create,) = pod["containers"]
    assert create["image"] == sts["spec"]["template"]["spec"]["containers"][0]["image"]
    assert create["command"][:2] == ["sh", "/etc/redis/create-cluster.sh"]
    assert create["command"][2:] == [f"{STS}-{i}.{sts['spec']['serviceName']}:6379" for i in range(6)]
    (generator,) = kust["configMapGenerator"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == generator["name"]
    assert volumes["passwords"]["secret"]["secretName"] == "recipecache-redis"
    mounts = {m["name"]: m["mountPath"] for m in create["volumeMounts"]}
    assert env_of(create)["REDIS_ADMIN_PASSWORD_FILE"]["value"] == f"{mounts['passwords']}/admin-password"
    assert {"redis/cluster.conf", "redis/create-cluster.sh"} <= set(generator["files"])


def test_cluster_acl_adds_exactly_the_cluster_clients_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_CLUSTER", "1")
    assert render_acl(tmp_path).returncode == 0
    rules = acl_user_rules((tmp_path / "users.acl").read_text(), "recipecache")
    assert set(granted(rules)) == set(ACL_COMMANDS) | set(CLUSTER_ACL_COMMANDS)
    assert not any(r.startswith("@") and r.endswith("@") for r in rules), "no placeholder is left"
    monkeypatch.delenv("REDIS_CLUSTER")
    assert render_acl(tmp_path).returncode == 0
    assert set(granted(acl_user_rules((tmp_path / "users.acl").read_text(), "recipecache"))) == set(ACL_COMMANDS)


@contextmanager
def deployed_cluster_nodes(tmp_path: Path, count: int) -> Iterator[list[int]]:
    """``count`` nodes started as the containers start them (start-redis.sh, REDIS_CLUSTER=1), on 127.0.0.1."""
    assert render_acl(tmp_path).returncode == 0  # writes the password files start-redis.sh reads
    procs, ports = [], []
    try:
        for i in range(count):
            node = tmp_path / f"node{i}"
            node.mkdir()
            port = port_below(55535)
            env = dict(os.environ, REDIS_CLUSTER="1", REDIS_ACL_FILE=str(node / "users.acl"),
                       REDIS_PASSWORD_FILE=str(tmp_path / "password"),
                       REDIS_PREVIOUS_PASSWORD_FILE=str(tmp_path / "previous"),
                       REDIS_ADMIN_PASSWORD_FILE=str(tmp_path / "admin"),
                       REDIS_CLUSTER_AUTH_FILE=str(node / "cluster-auth.conf"))
            args = ["--port", str(port), "--cluster-port", str(free_port()), "--bind", "127.0.0.1", "--dir", str(node),
                    "--aclfile", str(node / "users.acl"), "--cluster-config-file", str(node / "nodes.conf"),
                    "--logfile", str(node / "redis.log"), "--save", ""]
            procs.append(subprocess.Popen(["sh", str(REDIS_DIR / "start-redis.sh"), *args], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            ports.append(port)
        deadline = time.monotonic() + 120  # a hang guard
        for port, proc in zip(ports, procs):
            while True:
                try:
                    admin(port).ping()
                    break
                except redis.exceptions.RedisError:
                    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                    assert time.monotonic() < deadline, "a node did not start"
                    time.sleep(0.05)
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def admin(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, username="admin", password=ADMIN_PASSWORD, socket_timeout=5)


def create_cluster(tmp_path: Path, ports: list[int]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, REDIS_ADMIN_PASSWORD_FILE=str(tmp_path / "admin"), REDIS_CLUSTER_REPLICAS="0",
               REDIS_CLUSTER_WAIT_S="30")
    return subprocess.run(["sh", str(REDIS_DIR / "create-cluster.sh"), *(f"127.0.0.1:{p}" for p in ports)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.redis
def test_cluster_nodes_from_the_deploy_files_serve_the_job_user(tmp_path: Path) -> None:
    with deployed_cluster_nodes(tmp_path, 3) as ports:
        auth = tmp_path / "node0" / "cluster-auth.conf"
        assert stat.S_IMODE(auth.stat().st_mode) == 0o600 and "masteruser admin" in auth.read_text()
        created = create_cluster(tmp_path, ports)
        assert created.returncode == 0, created.stdout + created.stderr
        again = create_cluster(tmp_path, ports)
        assert again.returncode == 0 and "already form a cluster" in again.stdout
        deadline = time.monotonic() + 120  # a hang guard
        while not all(b"cluster_state:ok" in admin(p).execute_command("CLUSTER", "INFO") for p in ports):
            assert time.monotonic() < deadline, "the cluster did not form"
            time.sleep(0.1)
        for port in ports:  # replicas authenticate from the included file, not from the command line
            client = admin(port)
            assert client.config_get("masterauth") == {"masterauth": ADMIN_PASSWORD}
            cmdline = Path(f"/proc/{client.info('server')['process_id']}/cmdline").read_bytes()
            assert ADMIN_PASSWORD.encode() not in cmdline

        url = f"redis+cluster://recipecache:{JOB_PASSWORD}@127.0.0.1:{ports[0]}/0?chunk_size=1KiB"
        backend = open_backend(url)
        small, big = b"s" * 100, os.urandom(5000)
        try:
            backend.put("ns/0a0a0a0a", small)
            backend.put("ns/0b0b0b0b", big)
            assert backend.get("ns/0a0a0a0a") == small and backend.get("ns/0b0b0b0b") == big
            assert {e.key for e in backend.scan("ns")} == {"ns/0a0a0a0a", "ns/0b0b0b0b"}
            assert backend.lease_add("ns/0d0d0d0d", "token-1", 30)
            assert backend.lease_holder("ns/0d0d0d0d").token == "token-1"  # type: ignore[union-attr]
            backend.lease_release("ns/0d0d0d0d", "token-1")
            assert backend.lease_wait("ns/0d0d0d0d", "token-1", 5) is True
            backend.delete("ns/0a0a0a0a")
            assert backend.get("ns/0a0a0a0a") is None
        finally:
            backend.close()
        store = recipecache.open_store(url, namespace="cluster-job")
        assert store.get_or_compile("k", lambda: b"v" * 20_000) == b"v" * 20_000
        assert store.stats()["fallback"] == 0
        for port in ports:
            refused = [e for e in admin(port).acl_log()
                       if e["username"] == "recipecache" and e["object"] not in CONNECT_EXTRAS]
            assert refused == [], f"node {port} refused the job user: {refused}"
            assert all(k.startswith(b"rc:") for k in admin(port).scan_iter())
