"""The compile pool (:mod:`recipecache.compile_pool`): offers, claims and results through the store, on each default
backend (a filesystem store, a real redis-server), and the offering process's side of it
(:class:`recipecache.torch_integration.no_stall.sharing.Sharing`) over a store in memory:

* an offer is listed for every process of the namespace until withdrawn, with who offered it;
* one claim at a time: whoever holds it compiles; a claim nobody renews expires (a dead taker);
* a result reaches the offering process; an offer sealed under another secret is refused (never unpickled);
* the offering process ends its job when the taker published, and takes it back when the taker died or failed.
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest

from recipecache.compile_pool import CompilePool, Result
from recipecache.settings import StoreSettings
from recipecache.store import Store


def _store(url: str, secret: bytes | None = None) -> Store:
    return Store.open(StoreSettings(url, namespace="pool", secret=secret))


def test_an_offer_is_seen_by_every_process_until_withdrawn(store_url: str) -> None:
    rank0, rank1 = CompilePool(_store(store_url), member="r0"), CompilePool(_store(store_url), member="r1")
    assert rank1.offers() == {}
    assert rank0.offer("fx-a", b"job a") and rank0.offer("fx-b", b"job b") and rank1.offer("fx-c", b"job c")
    assert rank1.offers() == {"fx-a": "r0", "fx-b": "r0", "fx-c": "r1"}
    assert bytes(rank1.payload("fx-b") or b"") == b"job b"
    rank0.withdraw("fx-a")
    assert rank1.offers() == {"fx-b": "r0", "fx-c": "r1"} and rank1.payload("fx-a") is None


def test_one_claim_at_a_time_and_a_dead_takers_claim_expires(store_url: str) -> None:
    offering, taker = CompilePool(_store(store_url), member="r0"), CompilePool(_store(store_url), member="r1", ttl=0.5)
    offering.offer("fx-a", b"job")
    claim = taker.claim("fx-a")
    assert claim is not None and offering.claim("fx-a") is None and offering.claimed("fx-a")
    taker.report("fx-a", Result(compiled=True, compile_s=2.5, by="r1"))
    assert "fx-a" not in taker.offers(), "a published graph is taken by nobody again (it was, 12 times in a row)"
    claim.release()
    assert not offering.claimed("fx-a")
    assert offering.result("fx-a") == Result(compiled=True, compile_s=2.5, by="r1")
    # a taker that dies stops renewing: its claim expires, and the offering process claims the graph itself
    dead = taker.claim("fx-b")
    assert dead is not None
    dead._stop.set()  # its renewals end, as they do when the process dies
    deadline = time.monotonic() + 10
    while offering.claimed("fx-b") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not offering.claimed("fx-b") and offering.claim("fx-b") is not None


def test_waiting_on_a_claim_ends_when_it_is_released(store_url: str) -> None:
    """The offering process waits on its taker's claim; the release ends the wait (on Redis it wakes the waiter;
    a filesystem store has no wake-up, and its wait is one poll)."""
    offering, taker = CompilePool(_store(store_url), member="r0"), CompilePool(_store(store_url), member="r1")
    claim = taker.claim("fx-a")
    assert claim is not None
    threading.Timer(0.3, claim.release).start()
    start = time.monotonic()
    offering.wait_claimed("fx-a", 60.0 if store_url.startswith("redis") else 1.0)
    assert time.monotonic() - start < 30.0, "the release ended the wait"
    assert not offering.claimed("fx-a")
    offering.wait_claimed("fx-a", 60.0)  # nobody holds it: at once


def test_an_offer_sealed_under_another_secret_is_refused(tmp_path: Any) -> None:
    url = f"file://{tmp_path / 'store'}"
    CompilePool(_store(url, secret=b"a forger's own key 0123"), member="r9").offer("fx-a", b"code every rank would run")
    ours = CompilePool(_store(url, secret=b"the job's secret 0123456"), member="r1")
    assert ours.payload("fx-a") is None  # never handed to a worker
    assert ours.offers() == {}  # the forged index does not verify either


# -- the offering process's side ---------------------------------------------------------------------
@dataclass
class _Job:
    key: str
    future: Future[float] = field(default_factory=Future)
    cancelled: bool = False
    offered: bool = True


class _Workers:
    def __init__(self) -> None:
        self.submitted: list[Any] = []

    def submit(self, call: Any) -> None:
        self.submitted.append(call)


@dataclass
class _NoStall:
    """What :class:`Sharing` asks of its process: never idle here, so it takes nothing; records how jobs ended."""

    store: Store
    dropped: list[str] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)
    counted: list[dict[str, float]] = field(default_factory=list)
    workers: _Workers = field(default_factory=_Workers)

    @property
    def metrics(self) -> _NoStall:
        return self

    def no_stall(self, **counts: float) -> None:
        self.counted.append(counts)

    def idle(self) -> bool:
        return False

    def drop(self, job: _Job) -> None:
        self.dropped.append(job.key)

    def submit_taken(self, key: str, what: Any, payload: bytes, cancelled: Any) -> Future[float]:
        self.taken.append(key)
        done: Future[float] = Future()
        done.set_result(1.0)
        return done


@pytest.mark.parametrize("taker_ends", ["published", "failed", "died"])
def test_the_offering_process_follows_its_taker_to_the_end(taker_ends: str) -> None:
    from recipecache.torch_integration.no_stall.sharing import Sharing

    store = _store("memory://")
    no_stall = _NoStall(store)
    sharing = Sharing(no_stall, CompilePool(store, member="r0"))  # type: ignore[arg-type]
    taker = CompilePool(store, member="r1", ttl=0.6)
    try:
        assert sharing.offer("fx-a", {"key": "fx-a"}, ("f", "f32[2]"))
        claim = taker.claim("fx-a")
        assert claim is not None and sharing.claim("fx-a") is None
        job = _Job("fx-a")
        following = threading.Thread(target=sharing._follow, args=(job,))
        following.start()
        time.sleep(0.3)
        assert not job.future.done() and following.is_alive()  # it waits while the claim lives
        if taker_ends == "died":
            claim._stop.set()
        else:
            compiled = taker_ends == "published"
            taker.report("fx-a", Result(compiled=compiled, compile_s=1.0, by="r1", error="" if compiled else "oops"))
            claim.release()
        following.join(timeout=30)
        assert taker.offers() == {}  # withdrawn: nobody takes it again
        if taker_ends == "published":  # the job ends here: the graph is in the store
            assert job.future.result() == 0.0 and no_stall.dropped == ["fx-a"]
            assert no_stall.counted == [{"pool_handed": 1}] and not no_stall.workers.submitted
        else:  # one takeover: compiled here, after what is queued
            assert not job.future.done() and len(no_stall.workers.submitted) == 1 and not job.offered
            assert no_stall.counted == [{"pool_takeovers": 1}]
    finally:
        sharing.stop()


def test_an_offer_whose_process_is_gone_is_withdrawn_not_taken() -> None:
    """An offering process holds its graph's lease until the graph is compiled; an offer without one outlived its
    process (killed before it withdrew it, maybe in an earlier job): a taker withdraws it and compiles nothing."""
    from recipecache.torch_integration.no_stall.sharing import Sharing

    store = _store("memory://")
    gone = CompilePool(store, member="r0")
    job = pickle.dumps({"key": "k", "what": ("f", "f32[2]")})
    gone.offer("fx-stale", job)
    held = store.begin("fx-live", wait=False)  # a live offering process leads fx-live
    gone.offer("fx-live", job)
    no_stall = _NoStall(store)
    sharing = Sharing(no_stall, CompilePool(store, member="r1"))  # type: ignore[arg-type]
    try:
        sharing._take_one()
        assert no_stall.taken == ["fx-live"] and gone.offers() == {}  # the stale one withdrawn, the live one taken
        assert gone.payload("fx-stale") is None and gone.payload("fx-live") is not None  # (its process withdraws it)
        assert gone.result("fx-live") == Result(compiled=True, compile_s=1.0, by="r1")
    finally:
        sharing.stop()
        held.release()
