"""The admin CLI end to end, as a user runs it: a real process, real stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import recipecache
from recipecache.keys import storage_key


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recipecache.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


@pytest.fixture
def url(tmp_path: Path) -> str:
    store = recipecache.open_store(f"file://{tmp_path / 'c'}", namespace="job")
    for i in range(3):
        store.put(f"graph-{i}", bytes(100 * (i + 1)))
    recipecache.open_store(f"file://{tmp_path / 'c'}", namespace="other").put("x", b"y")
    return f"file://{tmp_path / 'c'}"


def test_stats_counts_every_namespace(url: str) -> None:
    out = json.loads(run("stats", "--url", url, "--json").stdout)
    assert out["namespaces"]["job"]["entries"] == 3
    assert out["namespaces"]["other"]["entries"] == 1
    assert out["entries"] == 4


def test_ls_shows_producer_and_status(url: str) -> None:
    proc = run("ls", "--url", url, "--namespace", "job")
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and all(line.endswith("ok") for line in lines[1:])
    rows = json.loads(run("ls", "--url", url, "--namespace", "job", "--json").stdout)
    assert sorted(r["key"] for r in rows) == ["graph-0", "graph-1", "graph-2"]


def test_verify_finds_and_fixes_bad_entries(url: str, tmp_path: Path) -> None:
    store = recipecache.open_store(url, namespace="job")
    path = store.backend._object_path(storage_key("job", "graph-1"))  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    proc = run("verify", "--url", url, "--namespace", "job")
    assert proc.returncode == 1
    assert "1 bad entries found" in proc.stdout and "checksum" in proc.stdout
    assert run("verify", "--url", url, "--namespace", "job", "--fix").returncode == 0
    assert run("verify", "--url", url, "--namespace", "job").returncode == 0
    assert store.get("graph-0") is not None and store.get("graph-1") is None


def test_verify_with_secret_flags_unsigned(url: str) -> None:
    proc = run("verify", "--url", url, "--namespace", "job", env={"RECIPECACHE_SECRET": "k"})
    assert proc.returncode == 1 and "unsigned" in proc.stdout


def test_prune_and_clear(url: str) -> None:
    assert run("prune", "--url", url, "--max-size", "800").returncode == 0
    assert json.loads(run("stats", "--url", url, "--json").stdout)["bytes"] <= 800
    assert run("clear", "--url", url, "--namespace", "other").returncode == 0
    assert "other" not in json.loads(run("stats", "--url", url, "--json").stdout)["namespaces"]


def test_export_import_moves_a_namespace(url: str, tmp_path: Path, redis_url: str) -> None:
    dump = tmp_path / "job.rcx"
    assert run("export", "--url", url, "--namespace", "job", str(dump)).returncode == 0
    proc = run("import", "--url", redis_url, "--namespace", "warm-job", str(dump))
    assert proc.returncode == 0, proc.stderr
    assert "imported 3" in proc.stdout
    target = recipecache.open_store(redis_url, namespace="warm-job")
    assert target.get("graph-2") == bytes(300)


def test_import_refuses_tampered_entries(url: str, tmp_path: Path) -> None:
    dump = tmp_path / "job.rcx"
    run("export", "--url", url, "--namespace", "job", str(dump))
    data = bytearray(dump.read_bytes())
    data[-5] ^= 0xFF
    dump.write_bytes(bytes(data))
    proc = run("import", "--url", f"file://{tmp_path / 'new'}", str(dump))
    assert proc.returncode == 1 and "refused 1" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ls", "--url", "ftp://nowhere"], "unsupported cache URL"),
        (["prune", "--url", "memory://", "--max-size", "lots"], "bad size"),
        (["ls", "--url", "memory://", "--namespace", "a/b"], "bad namespace"),
        (["import", "--url", "memory://", "/does/not/exist"], "cannot read"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    proc = run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_unreachable_redis_is_one_line_exit_1() -> None:
    proc = run("stats", "--url", "redis://127.0.0.1:1/0?timeout=0.5")
    assert proc.returncode == 1
    assert proc.stderr.startswith("recipecache: error: backend_down") and len(proc.stderr.strip().splitlines()) == 1
