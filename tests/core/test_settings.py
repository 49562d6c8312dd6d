"""Store settings and URLs: every malformed input is one ConfigError line, every good one means what it says."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import recipecache
from recipecache.backends import open_backend
from recipecache.backends.url import StoreURL, redact
from recipecache.errors import ConfigError
from recipecache.settings import MIN_SECRET_BYTES, StoreSettings


def test_open_store_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ["ftp://x", "redis://host:99999/0", "redis://h:1/abc", f"file://{tmp_path}?bogus=1", "file://host/x"]:
        with pytest.raises(ConfigError):
            recipecache.open_store(url)
    with pytest.raises(ConfigError, match="namespace"):
        recipecache.open_store("memory://", namespace="../evil")
    monkeypatch.setenv("RECIPECACHE_WAIT_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="RECIPECACHE_WAIT_TIMEOUT"):
        recipecache.open_store("memory://")


def test_default_url_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECIPECACHE_URL", raising=False)
    monkeypatch.setenv("RECIPECACHE_DIR", str(tmp_path / "d"))
    store = recipecache.open_store()
    assert store.url == f"file://{tmp_path / 'd'}"
    monkeypatch.setenv("RECIPECACHE_URL", "memory://")
    assert recipecache.open_store().url == "memory://"


def test_secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "secret").write_text("from-file-16-bytes\n")
    monkeypatch.delenv("RECIPECACHE_SECRET", raising=False)
    monkeypatch.setenv("RECIPECACHE_SECRET_FILE", str(tmp_path / "secret"))
    assert recipecache.open_store("memory://").settings.secret == b"from-file-16-bytes"
    monkeypatch.setenv("RECIPECACHE_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="RECIPECACHE_SECRET_FILE"):
        recipecache.open_store("memory://")


def _open_store_with_secret_file(path: Path) -> subprocess.CompletedProcess[str]:
    """``open_store`` in a fresh process whose key file is ``path``, with its memory capped (1 GiB) and a timeout:
    reading a FIFO blocks forever and reading ``/dev/zero`` never ends, and either must fail the test, not the machine."""
    code = "import recipecache\ntry:\n    recipecache.open_store('memory://')\nexcept recipecache.ConfigError as exc:\n" \
           "    raise SystemExit(f'error: {exc}')"
    environ = {k: v for k, v in os.environ.items() if k != "RECIPECACHE_SECRET"} | {"RECIPECACHE_SECRET_FILE": str(path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=60,
                          check=False, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)))


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too large"])
def test_a_key_file_that_is_no_small_regular_file_is_one_line_never_a_hang(kind: str, tmp_path: Path) -> None:
    """Issue 34: RECIPECACHE_SECRET_FILE naming a FIFO blocked every process opening the store forever, and
    /dev/zero was read until memory ran out."""
    path = {"fifo": tmp_path / "fifo", "device": Path("/dev/zero"), "directory": tmp_path,
            "too large": tmp_path / "big"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "too large":
        path.write_bytes(b"k" * (64 * 1024 + 1))
    proc = _open_store_with_secret_file(path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(
        f"error: RECIPECACHE_SECRET_FILE {path}: "), proc.stderr
    assert ("larger than" if kind == "too large" else "not a regular file") in proc.stderr


def test_a_key_file_through_a_symlink_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kubernetes mounts a secret as a symlink (``key -> ..data/key``): followed, the regular file behind it is read."""
    (tmp_path / "real").write_text("from-a-mounted-secret\n")
    (tmp_path / "key").symlink_to(tmp_path / "real")
    monkeypatch.delenv("RECIPECACHE_SECRET", raising=False)
    monkeypatch.setenv("RECIPECACHE_SECRET_FILE", str(tmp_path / "key"))
    assert recipecache.open_store("memory://").settings.secret == b"from-a-mounted-secret"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h:6379/0?chunk_size=0", "positive whole number of bytes"),
        # issue 44: redis-py read a database int() refuses as database 0, silently
        ("redis://h:6379/²", "bad database '²': use a number from 0 to 2147483647 such as /0"),
        ("redis+sentinel://h:26379/svc/²", "bad database '²'"),
        ("redis://h:6379/0?chunk_size=0.5", "not a whole number of bytes"),
        ("redis://h:6379/0?chunk_size=lots", "bad size"),
        ("redis://h:6379/0?ttl=nan", "positive, finite"),
        ("redis://h:6379/0?ttl=inf", "positive, finite"),
        ("redis://h:6379/0?ttl=-1", "positive, finite"),
        ("redis://h:6379/0?timeout=nan", "positive, finite"),
        ("redis://h:6379/0?timeout=0", "positive, finite"),
        # accepted by the parser but not by Redis or the socket (issue 18, item 12)
        ("redis://h:6379/0?chunk_size=1GiB", "chunk_size='1GiB' must be a positive whole number of bytes from 1.0 KiB "
                                             "to 512.0 MiB"),
        ("redis://h:6379/0?ttl=0.0001", "ttl='0.0001' must be a positive, finite number of seconds from 1 to 315360000"),
        ("redis://h:6379/0?ttl=1e300", "from 1 to 315360000"),
        ("redis://h:6379/0?timeout=1e308", "timeout='1e308' must be a positive, finite number of seconds from 0.01 to 600"),
        ("redis+cluster://h:7000?chunk_size=1GiB", "from 1.0 KiB to 512.0 MiB"),
        ("redis+sentinel://h:26379/svc?timeout=1e308", "from 0.01 to 600"),
        ("redis://[::1", "bad cache URL"),
        ("redis://h:6379/0?ssl_ca_certs=/ca.pem", "needs TLS: use rediss://"),
        ("redis://:6379/0", "use redis://"),
        ("redis://h:6379/0?ttl=1&ttl", "bad cache URL"),
        ("file:///x?max_size=0", "positive whole number of bytes"),
        ("memory://somewhere", "use memory://"),
        ("nothing-here", "needs a scheme"),
        ("gopher://h/", "scheme must be one of"),
        # issue 34: a host name no resolver takes raised from the first lookup (idna: label too long)
        ("redis://" + "a" * 300 + ":6379/0", "bad host"),
        ("redis://" + "a" * 64 + ".example:6379/0", "bad host"),
        ("redis+cluster://h:7000," + "b" * 300 + ":7001", "bad host"),
        ("redis+sentinel://" + "c" * 300 + ":26379/svc", "bad host"),
    ],
)
def test_malformed_urls_are_one_line_config_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        open_backend(url)
    assert "\n" not in str(info.value)


def test_errors_never_show_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        open_backend("redis://user:hunter2@h:6379/0?bogus=1")
    assert "hunter2" not in str(info.value) and "***" in str(info.value)
    assert redact("redis://user:hunter2@h:6379/0") == "redis://user:***@h:6379/0"
    assert "hunter2" not in redact("redis://user:hunter2@[::1")


def test_defaults_apply_only_where_the_backend_has_the_option(tmp_path: Path) -> None:
    backend = open_backend("redis://127.0.0.1:1/0", timeout=0.25)
    assert backend.url == "redis://127.0.0.1:1/0"
    backend.close()
    assert open_backend(f"file://{tmp_path}/c", timeout=0.25).url == f"file://{tmp_path}/c"
    parsed = StoreURL.parse("redis://h:1/0?timeout=2")
    assert parsed.with_defaults({"timeout"}, timeout=9).options["timeout"] == "2", "the URL wins"


@pytest.mark.parametrize(("name", "value"), [("RECIPECACHE_WAIT_TIMEOUT", "nan"), ("RECIPECACHE_WAIT_TIMEOUT", "-5"),
                                             ("RECIPECACHE_LEASE_TTL", "inf"), ("RECIPECACHE_LEASE_TTL", "0"),
                                             ("RECIPECACHE_LEASE_TTL", "0.0001"), ("RECIPECACHE_LEASE_TTL", "1e300")])
def test_timeouts_from_the_environment_are_finite_and_positive(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        recipecache.open_store("memory://")


@pytest.mark.parametrize("secret", ["", "short", b"x" * (MIN_SECRET_BYTES - 1)])
def test_empty_or_short_secrets_are_refused(secret: str | bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        recipecache.open_store("memory://", secret=secret)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        StoreSettings(url="memory://", secret=secret if isinstance(secret, bytes) else secret.encode())
    monkeypatch.setenv("RECIPECACHE_SECRET", secret if isinstance(secret, str) else secret.decode())
    with pytest.raises(ConfigError, match="RECIPECACHE_SECRET"):
        recipecache.open_store("memory://")


def test_signed_reports_the_truth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECIPECACHE_SECRET", raising=False)
    monkeypatch.delenv("RECIPECACHE_SECRET_FILE", raising=False)
    assert recipecache.open_store("memory://").stats()["signed"] is False
    assert recipecache.open_store("memory://", secret="k" * MIN_SECRET_BYTES).stats()["signed"] is True


def test_url_and_namespace_resolve_argument_then_environment_then_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One order for every caller (library, CLI, doctor, launcher); only the last fallback is the caller's."""
    from recipecache.settings import resolve_namespace, resolve_url

    monkeypatch.delenv("RECIPECACHE_URL", raising=False)
    monkeypatch.delenv("RECIPECACHE_NAMESPACE", raising=False)
    monkeypatch.setenv("RECIPECACHE_DIR", str(tmp_path))
    assert resolve_url() == f"file://{tmp_path}"
    assert (resolve_namespace(), resolve_namespace(default="train")) == ("default", "train")
    monkeypatch.setenv("RECIPECACHE_URL", "memory://")
    monkeypatch.setenv("RECIPECACHE_NAMESPACE", "env-ns")
    assert (resolve_url(), resolve_namespace(default="train")) == ("memory://", "env-ns")
    assert (resolve_url("redis://h:1/0"), resolve_namespace("arg", default="train")) == ("redis://h:1/0", "arg")
    settings = StoreSettings.resolve()
    assert (settings.url, settings.namespace) == ("memory://", "env-ns")
    monkeypatch.setenv("RECIPECACHE_NAMESPACE", "../evil")
    with pytest.raises(ConfigError, match="namespace"):
        resolve_namespace(default="train")


def test_a_variable_renamed_after_its_feature_is_still_read_by_its_old_name(caplog: pytest.LogCaptureFixture) -> None:
    """``RECIPECACHE_BEHIND_TIMEOUT`` (no-stall's deadline before the rename) still sets it, with a deprecation line;
    the new name wins where both are set."""
    from recipecache import env

    assert env.seconds(env.NO_STALL_TIMEOUT, 5.0, {"RECIPECACHE_BEHIND_TIMEOUT": "7"}) == 7.0
    assert "RECIPECACHE_BEHIND_TIMEOUT is deprecated; use RECIPECACHE_NO_STALL_TIMEOUT" in caplog.text
    both = {"RECIPECACHE_BEHIND_TIMEOUT": "7", "RECIPECACHE_NO_STALL_TIMEOUT": "9"}
    assert env.seconds(env.NO_STALL_TIMEOUT, 5.0, both) == 9.0
    with pytest.raises(ConfigError, match="RECIPECACHE_BEHIND_TIMEOUT='soon'"):
        env.seconds(env.NO_STALL_TIMEOUT, 5.0, {"RECIPECACHE_BEHIND_TIMEOUT": "soon"})
