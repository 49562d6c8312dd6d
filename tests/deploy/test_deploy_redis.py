"""deploy/redis on a real redis-server: redis.conf and the rendered ACL as written, the job user's
exact rights, the Redis backend working through it, password rotation, probes and TLS."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import recipecache
from harness.ports import free_port

from recipecache.backends.redis import ACL_COMMANDS, RedisBackend

from support.deploy_support import (
    ADMIN_PASSWORD, CONNECT_EXTRAS, Deployed, JOB_PASSWORD, NEEDS_REDIS_7_2, PREVIOUS_PASSWORD, REDIS_DIR,
    acl_user_rules, redis_server_version, render_acl, start_deployed,
)


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
    "persist": ["PERSIST", "{k}"],
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


ALPHA_PASSWORD = "alpha-password-0123456789abcdef"
ALPHA_NEXT_PASSWORD = "alpha-next-password-0123456789"
BETA_PASSWORD = "beta-password-0123456789abcdef"


@pytest.mark.redis
def test_project_users_reach_their_own_namespace_only(tmp_path: Path) -> None:
    """REDIS_PROJECTS_DIR makes namespaces a boundary: user rc-<ns> runs the whole backend (values,
    chunks, leases, wake lists, scan) in its namespace and cannot read or write another's."""
    projects = {"alpha": f"{ALPHA_PASSWORD}\n{ALPHA_NEXT_PASSWORD}\n", "beta": BETA_PASSWORD + "\n"}
    with start_deployed(tmp_path, projects=projects) as deployed:
        admin = deployed.admin()
        user = admin.acl_getuser("rc-alpha")
        assert user["keys"] == ["~rc:?:alpha/*", "~rc:?:{alpha/*"] and user["channels"] == []
        assert {c[1:] for c in user["commands"]} == deployed.granted, "the job user's commands, no more"
        assert len(user["passwords"]) == 2  # both lines of the file: a rotation

        def backend(password: str) -> RedisBackend:
            url = f"redis://rc-alpha:{password}@127.0.0.1:{deployed.server.port}/0"
            return RedisBackend(url, redacted_url=url.replace(password, "***"), chunk_size=1024)

        alpha = backend(ALPHA_NEXT_PASSWORD)
        big = os.urandom(5000)
        try:
            alpha.put("alpha/0a0a0a0a", big)  # chunked
            assert alpha.get("alpha/0a0a0a0a") == big
            assert {e.key for e in alpha.scan("alpha")} == {"alpha/0a0a0a0a"}
            assert alpha.lease_add("alpha/0b0b0b0b", "token-1", 30)
            alpha.lease_release("alpha/0b0b0b0b", "token-1")  # fills the wake list
            assert alpha.lease_wait("alpha/0b0b0b0b", "token-1", 5) is True
            for call in (lambda: alpha.get("beta/0a0a0a0a"), lambda: alpha.put("beta/0a0a0a0a", b"forged"),
                         lambda: alpha.lease_add("beta/0b0b0b0b", "token-1", 30),
                         lambda: alpha.delete("beta/0a0a0a0a")):
                with pytest.raises(recipecache.BackendError, match="(?i)noperm|permission"):
                    call()
        finally:
            alpha.close()
        assert not [k for k in admin.scan_iter() if b"beta/" in k], "nothing was written in beta's namespace"
        # the store as a user sees it: a round trip in its own namespace, signed
        url = f"redis://rc-beta:{BETA_PASSWORD}@127.0.0.1:{deployed.server.port}/0"
        store = recipecache.open_store(url, namespace="beta", secret="beta-signing-key-0123456789")
        assert store.put("graph", b"kernel") and bytes(store.get("graph") or b"") == b"kernel"
        refused = [e for e in admin.acl_log() if e["username"] == "rc-beta" and e["object"] not in CONNECT_EXTRAS]
        assert refused == []


def test_render_acl_refuses_project_files_that_name_no_namespace(tmp_path: Path) -> None:
    cases = {"-leading-dash": "named after its namespace", "white space": "named after its namespace",
             "x" * 65: "at most 64 characters", "gamma": "shorter than 16"}
    for i, (name, says) in enumerate(cases.items()):
        work = tmp_path / str(i)
        work.mkdir()
        result = render_acl(work, projects={name: "too-short\n" if name == "gamma" else ALPHA_PASSWORD})
        assert result.returncode == 2 and says in result.stderr, (name, result.stderr)
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert not (work / "users.acl").exists()
