"""Filesystem specifics: LRU order, size cap on put, permissions, symlinks, interrupted writes, stuck lease locks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import filelock
import pytest

import recipecache
from recipecache.tools import admin, cli
from recipecache.backends import filesystem
from recipecache.backends.filesystem import STALE_TEMP_S, FilesystemBackend
from recipecache.backends import open_backend
from recipecache.keys import storage_key
from recipecache.reasons import Reason, Role
from recipecache.store_admin import StoreAdmin
from recipecache.errors import BackendError, ConfigError
from harness.paths import REPO

T = TypeVar("T")

NS = "t"


def k(n: int) -> str:
    return f"{NS}/{n:064x}"


def test_eviction_is_least_recently_used(tmp_path: Path) -> None:
    b = FilesystemBackend(tmp_path / "c")
    for i in range(4):
        b.put(k(i), bytes(1000))
        os.utime(b.layout.object_path(k(i)), (1000 + i, 1000 + i))
    b.get(k(0))  # now the most recently used
    b.evict(2000)
    assert sorted(e.key for e in b.scan(NS)) == sorted([k(0), k(3)])


def test_size_cap_from_url_applies_on_put(tmp_path: Path) -> None:
    b = open_backend(f"file://{tmp_path / 'c'}?max_size=10KB")
    for i in range(30):
        b.put(k(i), bytes(1000))
    assert sum(e.size for e in b.scan(NS)) <= 10_000


def test_refuses_group_writable_root(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        FilesystemBackend(root)


def test_refuses_symlinked_root(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symlink"):
        FilesystemBackend(tmp_path / "link")


def test_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    b = FilesystemBackend(tmp_path / "c")
    b.put(k(1), b"real")
    secret = tmp_path / "outside"
    secret.write_bytes(b"not yours")
    path = b.layout.object_path(k(1))
    path.unlink()
    path.symlink_to(secret)
    assert b.get(k(1)) is None
    assert not path.is_symlink(), "the planted link is removed"
    assert secret.read_bytes() == b"not yours"


def test_special_files_are_never_read(tmp_path: Path) -> None:
    """Issue 18.4: a FIFO (any special file) where an entry or a lease belongs is skipped, never opened for
    reading: get, compare-and-set, lease lookups and prune all return, and a put replaces it."""
    root = tmp_path / "c"
    b = FilesystemBackend(root)
    b.put(k(1), b"entry")
    entry, lease = b.layout.object_path(k(1)), b.layout.lease_path(k(2))
    entry.unlink()
    os.mkfifo(entry)
    lease.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(lease)
    old = time.time() - 2 * STALE_TEMP_S
    os.utime(lease, (old, old))
    assert finishes(lambda: b.get(k(1))) is None
    assert finishes(lambda: b.delete_if(k(1), b"entry")) is False
    assert finishes(lambda: b.lease_holder(k(2))).remaining_s < 0, "an unreadable lease counts as expired"
    assert finishes(lambda: [e.key for e in b.scan(NS)]) == []
    assert finishes(lambda: admin.prune(StoreAdmin(recipecache.open_store(f"file://{root}", namespace=NS)), 0)) == 0
    assert not lease.exists(), "prune swept the expired 'lease'"
    assert finishes(lambda: b.put_if(k(1), None, b"new")), "no value there to compare with"
    assert b.get(k(1)) == b"new" and stat.S_ISREG(entry.lstat().st_mode)


_KILL_BEFORE_RENAME = """
import os, sys
from recipecache.backends.filesystem import FilesystemBackend
b = FilesystemBackend(sys.argv[1])
def die(*a, **kw):
    os._exit(9)  # the writer dies after writing the temp file, before publishing it
os.replace = die
b.put(sys.argv[2], b"x" * 5_000_000)
"""


def test_interrupted_write_is_never_visible(tmp_path: Path) -> None:
    b = FilesystemBackend(tmp_path / "c")
    b.put(k(1), b"old")
    proc = subprocess.run([sys.executable, "-c", _KILL_BEFORE_RENAME, str(tmp_path / "c"), k(1)], check=False)
    assert proc.returncode == 9
    assert b.get(k(1)) == b"old"
    temps = [p for p in (tmp_path / "c").rglob(".tmp-*")]
    assert temps, "the dead writer left its temp file behind"
    old = time.time() - STALE_TEMP_S - 10
    for t in temps:
        os.utime(t, (old, old))
    b.evict(10**9)
    assert not list((tmp_path / "c").rglob(".tmp-*")), "stale temp files are cleaned"


def test_stray_files_are_not_listed_and_do_not_stop_eviction(tmp_path: Path) -> None:
    b = open_backend(f"file://{tmp_path / 'c'}?max_size=10KB")
    b.put(k(0), bytes(1000))
    fan = b.layout.object_path(k(0)).parent  # type: ignore[attr-defined]
    (fan / "README").write_text("someone's notes")
    (fan / ("ff" + "0" * 62)).write_bytes(b"filed under the wrong fan directory")
    (fan.parent.parent / "not a namespace").mkdir()
    (fan.parent.parent / "not a namespace" / "00").mkdir()
    (fan.parent.parent / "not a namespace" / "00" / ("00" * 32)).write_bytes(b"x")
    assert [e.key for e in b.scan(None)] == [k(0)]
    for i in range(1, 30):
        b.put(k(i), bytes(1000))  # eviction runs on these puts and must not trip over the strays
    assert sum(e.size for e in b.scan(NS)) <= 10_000
    assert (fan / "README").exists(), "what is not ours is left alone"


def test_vacuum_removes_idle_lease_locks_and_stale_leftovers(tmp_path: Path) -> None:
    clock = [time.time()]
    b = FilesystemBackend(tmp_path / "c", clock=lambda: clock[0])
    for i in range(3):
        assert b.lease_add(k(i), "me", 30)
    b.lease_release(k(0), "me")
    b.lease_release(k(1), "me")
    locks = sorted((tmp_path / "c" / "leases" / NS).glob("*.lease.lock"))
    assert len(locks) >= 2, "filelock leaves a .lock file per key it ever locked"
    assert b.vacuum() == 0, "fresh locks may be in use: nothing goes"
    old = time.time() - 2 * STALE_TEMP_S
    for path in (tmp_path / "c" / "leases" / NS).iterdir():
        os.utime(path, (old, old))
    clock[0] += 3 * STALE_TEMP_S  # the lease of key 2 expired long ago (its holder died)
    assert b.vacuum() >= 3
    leases = tmp_path / "c" / "leases" / NS
    assert not (leases / f"{k(2).split('/')[1]}.lease").exists(), "the long-expired lease is gone"
    # the locks of keys 0 and 1 went; key 2's was just taken to remove its lease, so it waits for the next sweep
    assert [p.name for p in leases.glob("*.lock")] == [f"{k(2).split('/')[1]}.lease.lock"]
    assert b.lease_add(k(2), "next", 30), "a lease can be taken after the sweep"


_READ_ONLY_READER = """
import json, logging, os, sys
import recipecache
logging.basicConfig(level=logging.WARNING)
root = sys.argv[1]
try:  # the premise: this mount refuses access-time updates
    os.utime(os.path.join(root, "objects"))
    premise = "utime worked"
except OSError as exc:
    premise = exc.strerror
store = recipecache.open_store("file://" + root, namespace="ro")
hits = [bytes(store.get(f"k{i}") or b"") for i in range(3)]
print(json.dumps({"premise": premise, "hits": [h.decode() for h in hits], "stats": store.stats()}))
"""


def test_read_only_store_serves_hits(tmp_path: Path) -> None:
    """Issue 15.4: a pre-warmed store on a read-only mount; os.utime fails, the data read is good.

    Tests run as root, and root may utime any file, so permissions cannot make utime fail.
    A read-only bind mount does, honestly (EROFS, as on a read-only pre-warmed volume): the
    reader runs in its own mount and user namespace (``unshare -rm``), where it may bind the
    store read-only over itself without touching the rest of the machine.
    """
    root = tmp_path / "c"
    store = recipecache.open_store(f"file://{root}", namespace="ro")
    for i in range(3):
        store.put(f"k{i}", f"artifact {i}".encode())
    mount = f'mount --bind -o ro "$1" "$1" && exec "{sys.executable}" -c "$2" "$1"'
    try:
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", mount, "sh", str(root), _READ_ONLY_READER],
                              capture_output=True, text=True, timeout=60, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    except FileNotFoundError:
        pytest.skip("needs unshare (util-linux)")
    if proc.returncode != 0 and "mount" in proc.stderr:
        pytest.skip(f"this machine allows no private read-only mount: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["premise"] == "Read-only file system"
    assert out["hits"] == ["artifact 0", "artifact 1", "artifact 2"]
    assert out["stats"]["hits"] == 3 and out["stats"]["misses"] == 0
    assert proc.stderr.count("cannot record access times") == 1, "one warning, not one per read"


def test_vacuum_removes_idle_value_locks(tmp_path: Path) -> None:
    """put_if/delete_if leave one .value.lock per key (filelock never deletes it); vacuum sweeps idle ones."""
    b = FilesystemBackend(tmp_path / "c")
    assert b.put_if(k(1), None, b"v1")
    assert b.delete_if(k(1), b"v1")
    locks = list((tmp_path / "c" / "leases" / NS).glob("*.value.lock"))
    assert len(locks) == 1
    assert b.vacuum() == 0, "a fresh lock may be in use"
    old = time.time() - 2 * STALE_TEMP_S
    os.utime(locks[0], (old, old))
    assert b.vacuum() == 1 and not locks[0].exists()
    assert b.put_if(k(1), None, b"v2") and b.get(k(1)) == b"v2", "the key's lock is made again when needed"

def test_prune_during_another_eviction_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18.14: ``recipecache prune`` while a put elsewhere evicts waits for that eviction, then prunes;
    an eviction lock held past the wait is one line (backend_slow), not a filelock.Timeout traceback."""
    root = tmp_path / "c"
    url = f"file://{root}"
    store = recipecache.open_store(url, namespace=NS)
    for i in range(3):
        assert store.put(f"k{i}", bytes(1000))
    evicting = filelock.FileLock(root / ".evict.lock", thread_local=False)  # another process's eviction
    evicting.acquire()
    threading.Timer(1.0, evicting.release).start()
    assert cli.main(["prune", "--max-size", "0", "--url", url]) == 0
    assert StoreAdmin(store).scan(all_namespaces=True) == []
    monkeypatch.setattr(filesystem, "EVICT_LOCK_TIMEOUT_S", 0.2)
    capsys.readouterr()
    with evicting:
        status = cli.main(["prune", "--max-size", "0", "--url", url])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1 and err.startswith("recipecache: error: backend_slow: "), err


# -- a stuck holder of a lease's lock ----------------------------------------------------
_HOLD_LOCK = """
import sys, time, filelock
lock = filelock.FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(3600)  # stuck while holding it, as a stopped process or a hung mount would be
"""


@pytest.fixture
def stuck_lock() -> Iterator[Callable[[Path], None]]:
    """Start a process that takes a lease's ``.lock`` and never lets go, until the test ends."""
    holders: list[subprocess.Popen[str]] = []

    def hold(lease: Path) -> None:
        # resolved: the backend names its files through its root's fd (/proc/self/fd/N), which is this process's
        holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, f"{lease.resolve()}.lock"], stdout=subprocess.PIPE, text=True)
        holders.append(holder)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"

    yield hold
    for holder in holders:
        holder.kill()
        holder.wait()


def finishes(fn: Callable[[], T]) -> T:
    """``fn()``'s result (or exception), insisting that it returns at all: a stuck lock once blocked forever."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("value", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert outcome, "blocked on the stuck lock"
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


def test_stuck_lease_lock_costs_a_follower_no_more_than_its_deadline(tmp_path: Path, stuck_lock) -> None:
    store = recipecache.open_store(f"file://{tmp_path / 'c'}", namespace=NS)
    backend = store.backend
    assert isinstance(backend, FilesystemBackend)
    name = storage_key(NS, "graph")
    assert backend.lease_add(name, "leader", 30)  # a leader holds the key ...
    stuck_lock(backend.layout.lease_path(name))  # ... and a process is stuck holding the lease's lock
    flight = finishes(lambda: store.begin("graph", wait_timeout=0.5))
    assert flight.role is Role.FALLBACK and flight.reason is Reason.WAIT_TIMEOUT
    assert 0.5 <= flight.waited_s


def test_stuck_lease_lock_is_no_takeover(tmp_path: Path, stuck_lock) -> None:
    now = [1000.0]
    backend = FilesystemBackend(tmp_path / "c", clock=lambda: now[0])
    name = k(7)
    assert backend.lease_add(name, "dead", 1)
    now[0] += 10  # the holder's lease expired
    stuck_lock(backend.layout.lease_path(name))
    assert finishes(lambda: backend.lease_add(name, "next", 1)) is False  # not taken; the follower polls again


def test_stuck_lease_lock_makes_renew_and_release_slow_errors(tmp_path: Path, stuck_lock,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filesystem, "LEASE_LOCK_TIMEOUT_S", 0.2, raising=False)
    backend = FilesystemBackend(tmp_path / "c")
    name = k(8)
    assert backend.lease_add(name, "mine", 30)
    stuck_lock(backend.layout.lease_path(name))
    for op in (lambda: backend.lease_renew(name, "mine", 30), lambda: backend.lease_release(name, "mine")):
        with pytest.raises(BackendError) as err:
            finishes(op)
        assert err.value.reason is Reason.BACKEND_SLOW
