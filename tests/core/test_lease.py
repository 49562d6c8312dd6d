"""Single-flight's follower loop over the in-memory backend: waking instead of polling, progress
lines that name the holder, and the release-aware mode the node tier uses. Real processes and
real servers run the same algorithm in test_singleflight.py and test_node_tier.py."""

from __future__ import annotations

import logging
import threading

import pytest
from support.lease_spy import finds_lease_held

from recipecache.backends.memory import MemoryBackend
from recipecache.lease import PROGRESS_EVERY_S, SingleFlight, describe_holder, new_token
from recipecache.reasons import Role

NAME = "ns/7f2c" + "0" * 60
HOLDER = "0123abcd:1:4242:host-h"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class PollingMemory(MemoryBackend):
    """The memory backend without wake-ups, as the filesystem backend is: waiters poll."""

    def lease_wait(self, name: str, token: str, timeout: float) -> None:
        return None


def test_token_names_its_holder() -> None:
    assert describe_holder(HOLDER) == "rank 1 on host host-h"
    assert describe_holder(new_token()).startswith("rank 0 on host ")
    assert describe_holder("deadbeef") == "another process"


def test_waiter_logs_when_the_wait_starts_and_every_15_s(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    backend = PollingMemory(clock=clock)
    assert backend.lease_add(NAME, HOLDER, 3600)
    flight = SingleFlight(backend, ttl=30, clock=clock, sleep=clock.sleep)
    start = clock.now
    caplog.set_level(logging.INFO, logger="recipecache.lease")
    outcome = flight.run(NAME, lambda: b"done" if clock.now - start >= 40 else None, timeout=600)
    assert outcome.role is Role.FOLLOWER and outcome.value == b"done"
    lines = [r.getMessage() for r in caplog.records if r.name == "recipecache.lease"]
    assert lines[0] == "recipecache: rank 0 waiting for graph 7f2c.. compiled by rank 1 on host host-h"
    assert lines[1:] == [f"recipecache: rank 0 waiting {s} s for graph 7f2c.. compiled by rank 1 on host host-h"
                         for s in (int(PROGRESS_EVERY_S), int(2 * PROGRESS_EVERY_S))]


def test_waiter_is_woken_by_the_release_not_by_polling() -> None:
    backend = MemoryBackend()
    published: list[bytes] = []
    fetches = 0
    leader_holds = threading.Event()
    follower_waits = finds_lease_held(backend)

    def fetch() -> bytes | None:
        nonlocal fetches
        fetches += 1
        return published[0] if published else None

    def leader() -> None:
        assert backend.lease_add(NAME, HOLDER, 30)
        leader_holds.set()
        # issue 28: published only once the follower waits (on a loaded machine it looked after a fixed 1 s, found
        # the artifact at once and looked once), then compiling on; a poller would look ~6 times meanwhile
        assert follower_waits.wait(60)
        threading.Event().wait(1.0)
        published.append(b"artifact")
        backend.lease_release(NAME, HOLDER)

    thread = threading.Thread(target=leader)
    thread.start()
    leader_holds.wait()
    outcome = SingleFlight(backend, ttl=30).run(NAME, fetch, timeout=60)
    thread.join()
    assert outcome.role is Role.FOLLOWER and outcome.value == b"artifact" and outcome.waited_s > 0
    assert fetches == 2, "one look before the wait, one after the wake"


def test_release_without_a_result_ends_the_wait_in_release_aware_mode() -> None:
    clock = FakeClock()
    backend = PollingMemory(clock=clock)
    assert backend.lease_add(NAME, HOLDER, 30)
    looks = 0

    def fetch() -> None:
        nonlocal looks
        looks += 1
        if looks == 3:
            backend.lease_release(NAME, HOLDER)  # the holder found nothing to publish

    flight = SingleFlight(backend, ttl=30, clock=clock, sleep=clock.sleep, activity=None, takeover_on_release=False)
    outcome = flight.run(NAME, fetch, timeout=600)
    assert outcome.role is Role.TIMEOUT and outcome.released and outcome.waited_s < 30
    assert backend.lease_holder(NAME) is None, "the follower did not take the lease"
    # the default mode takes a released lease and becomes the leader (someone must compile)
    assert backend.lease_add(NAME, HOLDER, 30)
    looks = 0
    outcome = SingleFlight(backend, ttl=30, clock=clock, sleep=clock.sleep).run(NAME, fetch, timeout=600)
    assert outcome.role is Role.LEADER and outcome.takeover
    assert outcome.lease is not None
    outcome.lease.release()


def test_a_dead_holder_is_taken_over_in_release_aware_mode() -> None:
    clock = FakeClock()
    backend = PollingMemory(clock=clock)
    assert backend.lease_add(NAME, HOLDER, 5)  # and then it dies: nobody renews or releases
    flight = SingleFlight(backend, ttl=30, clock=clock, sleep=clock.sleep, activity=None, takeover_on_release=False)
    outcome = flight.run(NAME, lambda: None, timeout=600)
    assert outcome.role is Role.LEADER and outcome.takeover and 5 <= outcome.waited_s < 7
    assert outcome.lease is not None
    outcome.lease.release()


def test_follower_deadline_holds_while_the_holder_renews() -> None:
    clock = FakeClock()
    backend = PollingMemory(clock=clock)
    assert backend.lease_add(NAME, HOLDER, 3600)
    outcome = SingleFlight(backend, ttl=30, clock=clock, sleep=clock.sleep).run(NAME, lambda: None, timeout=20)
    assert outcome.role is Role.TIMEOUT and not outcome.released and 20 <= outcome.waited_s < 21
