"""The admin CLI end to end, as a user runs it: a real process, real stores."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import recipecache
from recipecache.keys import storage_key
from recipecache.tools import admin
from recipecache.store_admin import StoreAdmin


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recipecache.tools.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)  # a hang guard


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
    path = store.backend.layout.object_path(storage_key("job", "graph-1"))  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    proc = run("verify", "--url", url, "--namespace", "job")
    assert proc.returncode == 1
    assert "1 bad entries found" in proc.stdout and "checksum" in proc.stdout
    assert run("verify", "--url", url, "--namespace", "job", "--fix").returncode == 0
    assert run("verify", "--url", url, "--namespace", "job").returncode == 0
    assert store.get("graph-0") is not None and store.get("graph-1") is None


def test_verify_fix_spares_a_good_entry_published_after_it_read_the_damaged_one(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: --fix removed damaged entries with a plain delete, so a rank that compiled the key again and
    published it between verify's read and its delete lost its good entry. It compares and deletes now."""
    namespace = f"fix{os.getpid()}{os.urandom(3).hex()}"
    store = recipecache.open_store(store_url, namespace=namespace)
    for i in range(2):
        store.put(f"graph-{i}", bytes(100 * (i + 1)))
    skey = storage_key(namespace, "graph-1")
    ops = StoreAdmin(store)
    damaged = bytearray(ops.read_raw(skey) or b"")
    damaged[-1] ^= 1
    ops.write_raw(skey, damaged)
    rank = recipecache.open_store(store_url, namespace=namespace)
    read = store.backend.get

    def read_then_a_rank_publishes(key: str) -> object:
        blob = read(key)
        if key == skey:
            assert rank.put("graph-1", b"compiled again"), "the rank's put landed"
        return blob

    monkeypatch.setattr(store.backend, "get", read_then_a_rank_publishes)
    result = admin.verify(ops, fix=True)
    assert [r.storage_key for r in result.bad] == [skey], "what verify read was damaged"
    assert result.removed == [] and [r.storage_key for r in result.changed] == [skey]
    assert rank.get("graph-1") == b"compiled again", "the entry published meanwhile survives"
    assert rank.get("graph-0") == bytes(100)
    monkeypatch.undo()
    ops.write_raw(skey, damaged)
    assert [r.storage_key for r in admin.verify(ops, fix=True).removed] == [skey], "unchanged, it is removed"
    assert rank.get("graph-1") is None and rank.get("graph-0") == bytes(100)


def test_verify_with_secret_flags_unsigned(url: str) -> None:
    proc = run("verify", "--url", url, "--namespace", "job", env={"RECIPECACHE_SECRET": "k" * 16})
    assert proc.returncode == 1 and "unsigned" in proc.stdout


SECRET = "s" * 16


@pytest.fixture
def signed_url(tmp_path: Path) -> str:
    """A store whose namespace ``job`` holds three entries signed with SECRET."""
    url = f"file://{tmp_path / 'signed'}"
    store = recipecache.open_store(url, namespace="job", secret=SECRET)
    for i in range(3):
        store.put(f"graph-{i}", bytes(100 * (i + 1)))
    return url


def test_verify_fix_removes_damage_only_never_what_another_secret_refuses(signed_url: str) -> None:
    """Issue 18, item 8: a mistyped secret made every entry bad_signature and --fix removed them all."""
    store = recipecache.open_store(signed_url, namespace="job", secret=SECRET)
    path = store.backend.layout.object_path(storage_key("job", "graph-1"))  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    mistyped = {"RECIPECACHE_SECRET": "t" * 16}
    proc = run("verify", "--url", signed_url, "--namespace", "job", "--fix", env=mistyped)
    assert proc.returncode == 1, proc.stdout
    assert "1 corrupt entries removed" in proc.stdout
    assert "2 refused entries left in place (bad_signature 2)" in proc.stdout
    assert store.get("graph-0") == bytes(100) and store.get("graph-2") == bytes(300) and store.get("graph-1") is None
    unsigned_reader = run("verify", "--url", signed_url, "--namespace", "job", "--fix", "--json")
    assert unsigned_reader.returncode == 0 and json.loads(unsigned_reader.stdout)["removed"] == []
    with_secret = run("verify", "--url", signed_url, "--namespace", "job", "--fix", "--json",
                      env={"RECIPECACHE_SECRET": SECRET})
    assert with_secret.returncode == 0 and json.loads(with_secret.stdout)["checked"] == 2


def test_import_without_secret_refuses_to_drop_signatures_unless_unsigned(signed_url: str, tmp_path: Path) -> None:
    """Issue 18, item 8: import into another namespace without a secret stripped signatures silently."""
    dump = tmp_path / "job.rcx"
    assert run("export", "--url", signed_url, "--namespace", "job", str(dump)).returncode == 0
    target = f"file://{tmp_path / 'new'}"
    proc = run("import", "--url", target, "--namespace", "warm", str(dump))
    assert proc.returncode == 2 and "--unsigned" in proc.stderr and "signatures" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert recipecache.open_store(target, namespace="warm").get("graph-0") is None, "nothing is written"
    same = run("import", "--url", target, "--namespace", "job", str(dump))  # nothing to re-seal: signatures kept
    assert same.returncode == 0 and "imported 3" in same.stdout, same.stderr
    assert recipecache.open_store(target, namespace="job", secret=SECRET).get("graph-0") == bytes(100)
    signed = run("import", "--url", target, "--namespace", "signed", str(dump), env={"RECIPECACHE_SECRET": SECRET})
    assert signed.returncode == 0 and "imported 3" in signed.stdout, signed.stderr
    assert recipecache.open_store(target, namespace="signed", secret=SECRET).get("graph-2") == bytes(300)
    stripped = run("import", "--url", target, "--namespace", "warm", "--unsigned", str(dump))
    assert stripped.returncode == 0 and "imported 3" in stripped.stdout, stripped.stderr
    assert recipecache.open_store(target, namespace="warm").get("graph-1") == bytes(200)


def _what_is_there(path: Path) -> tuple[int, str | None, bytes | None]:
    """The file type at ``path``, where a symlink points, and what the file behind it holds (None: not a file)."""
    mode = os.lstat(path).st_mode
    target = os.readlink(path) if stat.S_ISLNK(mode) else None
    no_stall = Path(path).read_bytes() if target is not None and Path(path).is_file() else None
    return stat.S_IFMT(mode), target, no_stall


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dangling symlink", "directory", "device"])
def test_export_never_replaces_what_is_not_a_regular_file(kind: str, url: str, tmp_path: Path) -> None:
    """Issue 34: export replaced a FIFO, a symlink or a device node at FILE with a regular file (as root,
    ``export /dev/stdout`` destroyed the link), and a directory gave a traceback."""
    place = tmp_path / "place"
    place.mkdir()
    target = place / "target"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (tmp_path / "mine.txt").write_bytes(b"not an export")
        target.symlink_to(tmp_path / "mine.txt")
    elif kind == "dangling symlink":
        target.symlink_to(tmp_path / "nowhere")
    elif kind == "directory":
        target.mkdir()
    else:
        try:
            os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("creating a device node takes root")
    before = _what_is_there(target)
    proc = run("export", "--url", url, "--namespace", "job", str(target))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "not a regular file" in proc.stderr, proc.stderr
    assert _what_is_there(target) == before, "left as it was"
    assert sorted(p.name for p in place.iterdir()) == ["target"], "no temp file left behind"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_import_reads_only_a_regular_file(kind: str, tmp_path: Path) -> None:
    """Opening a FIFO blocked the import forever (as the key file did, issue 34); a directory is no export either."""
    source = tmp_path / "source"
    if kind == "fifo":
        os.mkfifo(source)
    else:
        source.mkdir()
    proc = run("import", "--url", f"file://{tmp_path / 'new'}", str(source))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"recipecache: error: cannot read {source}: not a regular file"]


def test_export_replaces_a_regular_file_whole(url: str, tmp_path: Path) -> None:
    dump = tmp_path / "job.rcx"
    dump.write_bytes(b"an older export")
    assert run("export", "--url", url, "--namespace", "job", str(dump)).returncode == 0
    imported = run("import", "--url", f"file://{tmp_path / 'new'}", "--namespace", "job", str(dump))
    assert imported.returncode == 0 and "imported 3" in imported.stdout, imported.stderr


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


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["ls", "--url", "redis://h:6379/0?chunk_size=0"], {}, "positive whole number of bytes"),
        (["ls", "--url", "redis://h:6379/0?ttl=nan"], {}, "positive, finite"),
        (["ls", "--url", "redis://h:6379/0?ttl=0.0001"], {}, "from 1 to 315360000"),
        (["stats", "--url", "redis://h:6379/0?timeout=1e308"], {}, "from 0.01 to 600"),
        (["ls", "--url", "redis://h:6379/0?chunk_size=1GiB"], {}, "from 1.0 KiB to 512.0 MiB"),
        (["ls", "--url", "redis://[::1"], {}, "bad cache URL"),
        (["ls", "--url", "redis://h:6379/0?ssl_certfile=/c.pem"], {}, "rediss://"),
        (["ls", "--url", "memory://"], {"RECIPECACHE_WAIT_TIMEOUT": "nan"}, "RECIPECACHE_WAIT_TIMEOUT"),
        (["ls", "--url", "memory://"], {"RECIPECACHE_LEASE_TTL": "inf"}, "RECIPECACHE_LEASE_TTL"),
        (["ls", "--url", "memory://"], {"RECIPECACHE_LEASE_TTL": "0.0001"}, "RECIPECACHE_LEASE_TTL='0.0001'"),
        (["ls", "--url", "memory://", "--namespace", "job\n"], {}, "bad namespace"),
        (["ls", "--url", "memory://"], {"RECIPECACHE_SECRET": ""}, "at least 16 bytes"),
        (["export", "--url", "memory://", "/no/such/dir/x.rcx"], {}, "does not exist"),
        # issue 34: these raised tracebacks
        (["sim", "--seed", "-1"], {}, "seed"),
        (["ls", "--url", "redis://" + "a" * 300 + ":6379/0"], {}, "bad host"),
        # issue 28: numpy raised "Maximum allowed dimension exceeded"
        (["sim", "--ranks", "9" * 20], {}, "ranks must be at most 1,048,576"),
        (["sim", "--shapes", "9" * 20], {}, "shapes must be at most"),
        (["sim", "--steps", "9" * 20], {}, "steps must be at most"),
        # issue 28: a mistyped run directory exited 0, explained as a run whose ranks asked for no graph
        (["explain", "/no/such/run"], {}, "/no/such/run: no such run directory"),
        (["trace", "/no/such/run"], {}, "/no/such/run: no such run directory"),
        # issue 28: each said "weights must be >= 0 with a positive sum"
        # issue 44: an exponent or a sign is no number by the rule (recipecache.quantities)
        (["sim", "--weights", "1e400"], {}, "--weights: weight 1='1e400' is not a number (ASCII digits"),
        (["sim", "--weights", "1,-2"], {}, "--weights: weight 2='-2' is not a number (ASCII digits"),
        (["sim", "--weights", "0,0"], {}, "every weight is 0"),
    ],
)
def test_more_bad_input_is_one_line_and_exit_2(args: list[str], env: dict[str, str], message: str) -> None:
    proc = run(*args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("command", ["explain", "trace"])
def test_a_run_dir_the_system_refuses_is_one_line(command: str) -> None:
    """Issue 28: a run directory name longer than the system takes raised OSError (ENAMETOOLONG) as a traceback."""
    proc = run(command, "r" * 300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("recipecache: error: [Errno 36] File name too long") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_clear_all_clears_every_namespace(url: str) -> None:
    proc = run("clear", "--url", url, "--all")
    assert proc.returncode == 0 and "removed 4 entries from all namespaces" in proc.stdout
    assert json.loads(run("stats", "--url", url, "--json").stdout)["entries"] == 0


def _export(url: str, tmp_path: Path) -> bytes:
    dump = tmp_path / "job.rcx"
    assert run("export", "--url", url, "--namespace", "job", str(dump)).returncode == 0
    return dump.read_bytes()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data, one: data[: len(data) - one], "ends after 2 of 3 entries"),  # cut at an entry boundary
        (lambda data, one: data[:-7], "ends in the middle of an entry"),
        (lambda data, one: data + b"\xc1junk", "cannot be decoded"),
        (lambda data, one: data + b"\x01", "holds something else after entry 3"),
    ],
)
def test_damaged_import_is_an_error_that_says_what_was_imported(
    url: str, tmp_path: Path, damage: object, message: str
) -> None:
    data = _export(url, tmp_path)
    one_entry = len(data) - len(_export_without_last(url, tmp_path))
    damaged = tmp_path / "damaged.rcx"
    damaged.write_bytes(damage(data, one_entry))  # type: ignore[operator]
    proc = run("import", "--url", f"file://{tmp_path / 'new'}", "--namespace", "job", str(damaged))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "imported" in proc.stderr and "before the damage" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _export_without_last(url: str, tmp_path: Path) -> bytes:
    """The same export with one entry fewer (to learn where the last entry starts)."""
    store = StoreAdmin(recipecache.open_store(url, namespace="job"))
    last = max(store.scan(), key=lambda info: info.key)
    blob = store.read_raw(last.key)
    store.delete_raw(last.key)
    try:
        dump = tmp_path / "fewer.rcx"
        assert run("export", "--url", url, "--namespace", "job", str(dump)).returncode == 0
        return dump.read_bytes()
    finally:
        assert blob is not None
        store.write_raw(last.key, blob)


def test_ls_and_verify_report_hostile_entries_without_crashing(tmp_path: Path, redis_url: str) -> None:
    """Issue 15, items 1-2: entries whose header fields or Redis framing are hostile are listed as bad."""
    import msgpack

    header = msgpack.packb({"v": 2, "ns": "job", "key": "k", "host": "h", "rank": 0, "created": 1.0,
                            "size": 2**63, "blake3": 2**63}, use_bin_type=True)
    hostile = b"RCE2" + len(header).to_bytes(4, "big") + header + b"payload"
    file_url = f"file://{tmp_path / 'c'}"
    for url in (file_url, redis_url):
        store = recipecache.open_store(url, namespace="hostile")
        store.put("good", b"fine")
        store.backend.put(storage_key("hostile", "bad-header"), hostile)
        if url == redis_url:
            import redis

            client = redis.Redis.from_url(redis_url)
            client.set(f"rc:e:{storage_key('hostile', 'bad-manifest')}", b"RCM1" + bytes(29))
            client.hset(f"rc:e:{storage_key('hostile', 'wrong-type')}", "f", "v")
        bad = 1 if url == file_url else 3
        proc = run("ls", "--url", url, "--namespace", "hostile")
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert sum("corrupt" in line for line in proc.stdout.splitlines()) == bad, proc.stdout
        proc = run("verify", "--url", url, "--namespace", "hostile", "--json")
        assert proc.returncode == 1 and proc.stderr == "", proc.stderr
        assert len(json.loads(proc.stdout)["bad"]) == bad
        assert run("verify", "--url", url, "--namespace", "hostile", "--fix").returncode == 0
        assert run("verify", "--url", url, "--namespace", "hostile").returncode == 0
        assert store.get("good") == b"fine"


def test_password_on_the_command_line_is_warned_about_and_never_printed(redis_url: str) -> None:
    """A password in --url is readable by every user (ps): one warning line, the password redacted."""
    parts = redis_url.split("://", 1)
    with_password = f"{parts[0]}://default:not-the-password-{os.getpid()}@{parts[1]}"
    proc = run("stats", "--url", with_password)
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "set RECIPECACHE_URL instead" in warnings[0], proc.stderr
    assert f"not-the-password-{os.getpid()}" not in proc.stderr + proc.stdout
    assert "warning" not in run("stats", "--url", redis_url).stderr


LONG = "x" * 400


@pytest.mark.parametrize("argv", [
    ["recipecache", "ls", "--url", f"redis://{LONG}:6379/0"],
    ["recipecache", "ls", "--url", f"foo://{LONG}"],
    ["recipecache", "ls", "--url", f"redis://h:6379/0?timeout={LONG}"],
    ["recipecache", "ls", "--url", f"redis://h:{LONG}/0"],
    ["recipecache", "ls", "--url", "memory://", "--namespace", LONG],
    ["recipecache-run", "--url", f"redis://{LONG}:6379/0", "job.py"],
    ["recipecache-run", "--url", f"file:///tmp/x?max_size={LONG}", "job.py"],
    ["recipecache-run", "--url", "file://TMP/c", "--namespace", LONG, "job.py"],
    ["recipecache-run", "--url", "file://TMP/c", f"{LONG}.py"],
])
def test_a_long_value_is_shortened_in_its_error_line(argv: list[str], tmp_path: Path) -> None:
    """Issue 28: the 400-character value was repeated in full, some of them twice. Its start and its length
    say which value it was; the installed console scripts, as users run them."""
    (tmp_path / "job.py").write_text("")
    argv = [arg.replace("TMP", str(tmp_path)) for arg in argv]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert LONG[:100] not in proc.stderr and "... (4" in proc.stderr, proc.stderr
