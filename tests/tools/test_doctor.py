"""``recipecache doctor`` on real stores: a good filesystem store, real Redis (plain and with the
deploy/ ACL user), a dead store, a malformed URL, an unsafe directory, a bad signing key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.ports import free_port
from support.hung_peer import HungPeer
from support.deploy_support import JOB_PASSWORD, start_deployed

import recipecache
from recipecache import env
from recipecache.tools import doctor
from recipecache.backends import open_backend
from recipecache.backends.redis import ACL_COMMANDS
from recipecache.backends.redis_cluster import CLUSTER_ACL_COMMANDS
from recipecache.errors import ConfigError, URLError
from recipecache.node_tier import default_node_dir
from recipecache.torch_integration.compat import HOOKS

EXPECTED = ["store", "leases", "permissions", "free space", "clock", "node dir", "node dir", "signing", "settings",
            "torch cache",
            "torch cache", "torch", *["hook"] * len(HOOKS), "threads", "compile", "cpu", "key inputs"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("RECIPECACHE_SECRET", "RECIPECACHE_SECRET_FILE", "RECIPECACHE_URL", "PT_HPU_RECIPE_CACHE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RECIPECACHE_NODE_DIR", str(tmp_path / "node"))


def by_name(checks: list[doctor.HealthCheck]) -> dict[str, doctor.HealthCheck]:
    return {c.name: c for c in checks}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RECIPECACHE_")} | (env or {})
    return subprocess.run([sys.executable, "-m", "recipecache.tools.cli", "doctor", *args], capture_output=True, text=True,
                          env=environ, timeout=600, check=False)  # a hang guard


def test_good_filesystem_store_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    checks = doctor.run_checks(f"file://{tmp_path / 'store'}", namespace="job")
    assert [c.name for c in checks] == EXPECTED
    assert not [c for c in checks if c.failed], doctor.format_checks(checks)
    found = by_name(checks)
    assert found["threads"].status == "pass" and "OMP_NUM_THREADS=1" in found["threads"].detail
    assert found["signing"].status == "warn" and found["signing"].fix
    assert all("\n" not in c.detail for c in checks)
    left = open_backend(f"file://{tmp_path / 'store'}")
    assert list(left.scan()) == [] and not list((tmp_path / "store").rglob("*.lease")), "no entry or lease left behind"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert by_name(doctor.run_checks(f"file://{tmp_path / 'store'}"))["threads"].status == "warn"


def test_cli_exit_status_and_one_line_per_check(tmp_path: Path) -> None:
    good = run_cli("--url", f"file://{tmp_path / 'store'}", env={"RECIPECACHE_NODE_DIR": str(tmp_path / "node")})
    assert good.returncode == 0, good.stdout + good.stderr
    lines = good.stdout.splitlines()
    assert len(lines) == len(EXPECTED) + 1 and lines[-1].startswith(f"{len(EXPECTED)} of {len(EXPECTED)} checks passed")
    assert all(line.split()[0] in ("PASS", "WARN") for line in lines[:-1])
    dead = run_cli("--url", f"redis://127.0.0.1:{free_port()}/0")
    assert dead.returncode == 1
    failed = [line for line in dead.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].split()[1] == "store" and "backend_down" in failed[0] and "fix:" in failed[0]
    assert "Traceback" not in dead.stderr
    bad = run_cli("--url", "redis://127.0.0.1:notaport/0")
    assert (bad.returncode, bad.stdout) == (2, "")
    assert len(bad.stderr.splitlines()) == 1 and bad.stderr.startswith("recipecache: error: bad cache URL")


@pytest.mark.parametrize("form", ["plain", "cluster", "sentinel"])
def test_a_server_that_never_answers_is_one_failed_line(form: str, tmp_path: Path) -> None:
    """Issue 28: a listener that accepts and never replies (a stopped server) is the store check's one failed
    line, which says how long it waited, and the other checks run; the subprocess's timeout only guards a hang."""
    with HungPeer() as peer:
        url = {"plain": f"redis://127.0.0.1:{peer.port}/0", "cluster": f"redis+cluster://127.0.0.1:{peer.port}",
               "sentinel": f"redis+sentinel://127.0.0.1:{peer.port}/svc"}[form]
        proc = run_cli("--url", url, env={"RECIPECACHE_NODE_DIR": str(tmp_path / "node")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].split()[1] == "store", proc.stdout
    # a call's timeout, or on a machine too busy to run the checks' thread, their budget: either says how long
    assert re.search(r"no answer within \d+(\.\d+)? s", failed[0]) and "fix:" in failed[0], failed[0]
    names = [line[6:18].rstrip() for line in proc.stdout.splitlines()[:-1]]  # "FAIL  store        ..."
    assert names == ["store", *EXPECTED[5:]], "the rest ran"
    assert proc.stderr == ""


def test_the_store_checks_together_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """However many calls the store's checks make, they get one budget: here far less than one call's timeout
    (600 s, the most a URL may set), so the call blocked on a listener that never answers is still waiting
    when doctor stops waiting for it, however slow the machine (the other checks' running beside it is in
    test_a_server_that_never_answers_is_one_failed_line)."""
    monkeypatch.setattr(doctor, "STORE_CHECKS_BUDGET", 0.001)
    with HungPeer() as peer:
        url = f"redis://127.0.0.1:{peer.port}/0?timeout=600"
        checks = doctor._StoreChecks(url, None).result()
        assert [(c.name, c.status, c.detail) for c in checks] == [
            ("store", "fail", f"{url}: no answer within 0.6 s (the store's checks together)")]
        hang_guard = time.monotonic() + 120
        while not peer.connections:  # the checks went on in their thread: they did ask the server
            assert time.monotonic() < hang_guard, "the store's checks never connected"
            time.sleep(0.05)


def test_malformed_urls_are_bad_input() -> None:
    for url in ("foo://x", "redis://h:6379/0?bogus=1", "file://relative/path", "file:///x?max_size=lots", "nourl"):
        with pytest.raises(URLError):
            doctor.run_checks(url)


def test_a_bad_namespace_is_one_line_of_bad_input(tmp_path: Path) -> None:
    """Doctor resolves the namespace as every other command does (argument, else environment), checked."""
    for args, env in ((["--namespace", "../x"], {}), ([], {"RECIPECACHE_NAMESPACE": "../x"})):
        proc = run_cli("--url", f"file://{tmp_path / 'store'}", *args, env=env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "'../x'" in proc.stderr and "Traceback" not in proc.stderr


def test_unsafe_store_directory_is_a_failed_check(tmp_path: Path) -> None:
    store = tmp_path / "shared"
    store.mkdir(mode=0o777)
    store.chmod(0o777)
    checks = doctor.run_checks(f"file://{store}")
    assert checks[0].name == "store" and checks[0].failed and "writable by group or others" in checks[0].detail
    assert doctor.exit_status(checks) == 1


def test_a_node_directory_enable_refuses_fails_doctor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18.16: a world-writable RECIPECACHE_NODE_DIR makes every rank's enable() raise; doctor says so."""
    node = tmp_path / "shared-node"
    node.mkdir()
    node.chmod(0o777)
    monkeypatch.setenv("RECIPECACHE_NODE_DIR", str(node))
    with pytest.raises(ConfigError, match="writable by group or others"):
        recipecache.open_store(f"file://{tmp_path / 'store'}")  # as enable() opens it in every rank
    checks = doctor.run_checks(f"file://{tmp_path / 'store'}")
    failed = [c for c in checks if c.failed]
    assert [c.name for c in failed] == ["node dir"] and "writable by group or others" in failed[0].detail
    assert doctor.exit_status(checks) == 1
    monkeypatch.delenv("RECIPECACHE_NODE_DIR")
    assert str(default_node_dir()) in by_name(doctor.run_checks(f"file://{tmp_path / 'store'}"))["node dir"].detail, \
        "unset, the directory recipecache-run uses by default"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("RECIPECACHE_NODE_MAX_SIZE", "abc", "RECIPECACHE_NODE_MAX_SIZE: bad size 'abc'"),
    ("RECIPECACHE_LEASE_TTL", "soon", "RECIPECACHE_LEASE_TTL='soon' must be a positive, finite number of seconds"),
    ("RECIPECACHE_WAIT_TIMEOUT", "-1", "RECIPECACHE_WAIT_TIMEOUT='-1'"),
    ("RECIPECACHE_PRECOMPILE", "yes", "RECIPECACHE_PRECOMPILE='yes': use 1 (on) or 0 (off)"),
    ("RECIPECACHE_EXIT_GRACE", "nan", "RECIPECACHE_EXIT_GRACE='nan'"),
    ("RECIPECACHE_ENABLE", "yes", "RECIPECACHE_ENABLE='yes'"),
])
def test_a_setting_every_rank_would_stop_on_fails_doctor(name: str, value: str, message: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: doctor passed with RECIPECACHE_NODE_MAX_SIZE=abc, on which every rank's enable() stops."""
    monkeypatch.setenv(name, value)
    checks = doctor.run_checks(f"file://{tmp_path / 'store'}")
    failed = [c for c in checks if c.failed]
    assert [c.name for c in failed] == ["settings"] and failed[0].detail.startswith(message), failed
    assert doctor.exit_status(checks) == 1
    monkeypatch.delenv(name)
    assert by_name(doctor.run_checks(f"file://{tmp_path / 'store'}"))["settings"].status == "pass"


def test_signing_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "key"
    key.write_text("k" * 32)
    monkeypatch.setenv("RECIPECACHE_SECRET_FILE", str(key))
    found = by_name(doctor.run_checks(f"file://{tmp_path / 'store'}"))
    assert found["signing"].status == "pass" and found["signing"].detail == \
        "on: keyed BLAKE3 with a 32-byte key from RECIPECACHE_SECRET_FILE"
    assert found["store"].status == "pass", "the round trip signs and verifies with the key"
    key.write_text("short")
    found = by_name(doctor.run_checks(f"file://{tmp_path / 'store'}"))
    assert found["signing"].failed and "16 bytes" in found["signing"].detail
    assert found["store"].status == "pass"


def test_gaudi_recipe_directory_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipes = tmp_path / "recipes"
    monkeypatch.setenv("PT_HPU_RECIPE_CACHE_CONFIG", f"{recipes},false,1024")
    found = [c for c in doctor.run_checks(f"file://{tmp_path / 'store'}") if c.name == "hpu recipes"]
    assert [c.status for c in found] == ["pass", "pass"]
    recipes.chmod(0o777)
    assert [c.status for c in doctor.run_checks(f"file://{tmp_path / 'store'}") if c.name == "hpu recipes"][0] == "fail"


@pytest.mark.redis
def test_plain_redis_passes_with_a_measured_clock(redis_url: str) -> None:
    found = by_name(doctor.run_checks(redis_url, namespace="doctor"))
    assert not [c for c in found.values() if c.failed], doctor.format_checks(list(found.values()))
    assert found["acl"].status == "pass"
    assert "off the server's" in found["clock"].detail


@pytest.mark.redis
def test_redis_with_the_deploy_acl_user(tmp_path: Path) -> None:
    """The job user of deploy/redis: every backend command allowed, TIME refused (so the clock is not measured)."""
    with start_deployed(tmp_path) as deployed:
        url = f"redis://recipecache:{JOB_PASSWORD}@127.0.0.1:{deployed.server.port}/0"
        checks = doctor.run_checks(url, namespace="job")
        found = by_name(checks)
        assert not [c for c in checks if c.failed], doctor.format_checks(checks)
        assert found["acl"].detail.startswith(f"the user may run all {len(ACL_COMMANDS)} commands")
        assert found["clock"].status == "pass" and "may not run TIME" in found["clock"].detail
        assert JOB_PASSWORD not in doctor.format_checks(checks)
        admin = deployed.admin()
        assert not [k for k in admin.scan_iter() if b"doctor" in k], "the checks left no key behind"
        admin.execute_command("ACL", "SETUSER", "recipecache", "-mget", "-pexpire")
        acl = by_name(doctor.run_checks(url, namespace="job"))["acl"]
        assert acl.failed and acl.detail == "the user may not run mget, pexpire" and "+mget +pexpire" in acl.fix


def test_acl_probes_cover_every_backend_command() -> None:
    backend = open_backend("redis://127.0.0.1:1/0")
    try:
        assert set(backend._acl_probes("rc:e:ns/00")) == set(ACL_COMMANDS)  # type: ignore[attr-defined]
    finally:
        backend.close()


@pytest.mark.redis
def test_doctor_on_a_cluster_and_a_sentinel_primary(redis_cluster, redis_sentinel) -> None:  # type: ignore[no-untyped-def]
    """The same checks through the cluster client (slot map commands probed too) and the sentinel's primary."""
    for url in (redis_cluster.url, redis_sentinel.url):
        checks = doctor.run_checks(url, namespace="doctor")
        found = by_name(checks)
        assert not [c for c in checks if c.failed], doctor.format_checks(checks)
        assert found["acl"].status == "pass", found["acl"].detail
    assert by_name(doctor.run_checks(redis_cluster.url, namespace="doctor"))["acl"].detail.startswith(
        f"the user may run all {len(ACL_COMMANDS) + len(CLUSTER_ACL_COMMANDS)} commands")


def test_key_inputs_digest_covers_the_cpu_fingerprint_keys_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19: the digest doctor says is equal for equal keys is made of the host-CPU fingerprint the keys
    carry (RECIPECACHE_CPU_FINGERPRINT when set), not of a description of /proc/cpuinfo; the cpu line shows it."""
    seen = {}
    for fleet in ("fleet-a", "fleet-b"):
        monkeypatch.setenv(env.CPU_FINGERPRINT, fleet)
        found = by_name(doctor._torch_checks())
        assert f"fingerprint in keys {fleet}" in found["cpu"].detail
        seen[fleet] = found["key inputs"].detail
    assert seen["fleet-a"] != seen["fleet-b"], "other fingerprints, other keys: the digests must differ"
    monkeypatch.setenv(env.CPU_FINGERPRINT, "two words")
    found = by_name(doctor._torch_checks())
    assert found["cpu"].failed and env.CPU_FINGERPRINT in found["cpu"].detail
