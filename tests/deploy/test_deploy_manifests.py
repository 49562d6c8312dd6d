"""deploy/'s Kubernetes and compose manifests, redis.conf and the ACL template: they parse, agree
with each other, with deploy/README.md and with the Redis backend."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from recipecache.backends.redis import ACL_COMMANDS

from support.deploy_support import (
    DEPLOY, NEEDS_REDIS_7_2, REDIS_DIR, acl_user_rules, conf_directives, env_of, granted, image_version,
    k8s_object, load_docs,
)


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
    assert "--url" not in command and "--cache" not in command and "RECIPECACHE_URL" not in command, "the URL holds the password: env only"
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
