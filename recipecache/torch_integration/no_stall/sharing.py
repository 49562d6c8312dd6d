"""This process's part in the compile pool (:mod:`recipecache.compile_pool`): it offers the compiles queued behind its
busy worker, follows the taker of one it offered, and takes another process's while its own worker is idle.

A taken compile runs in this process's kept worker exactly as one of its own graphs would (:mod:`.worker`): under
the offering process's global torch state and against its key, which the worker checks; it is published through
the normal path, so the offering process, and every other one, loads it from the store. The offering process keeps
the graph's lease meanwhile: the others go on polling it as for any compile behind.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import TYPE_CHECKING, Any

from ...compile_pool import CompilePool, Result
from ...lease import HeldLease
from .graph import POLL_S

if TYPE_CHECKING:
    from .controller import NoStall, _Job

log = logging.getLogger(__name__)

#: seconds between two looks at the offers of a process whose worker is idle
TAKE_POLL_S = 0.5


class Sharing:
    """The compile pool as one no-stall process (:class:`.controller.NoStall`) takes part in it."""

    def __init__(self, no_stall: NoStall, pool: CompilePool) -> None:
        self._no_stall = no_stall
        self._pool = pool
        self._stop = threading.Event()
        #: offers this process's worker could not compile: left to their offering process, never taken again
        self._passed: set[str] = set()
        #: set while this process takes an offer; and once it is exiting with its own compiles ended
        self._taking = threading.Event()
        self._at_exit = threading.Event()
        self._thread = threading.Thread(target=self._take_loop, name="recipecache-pool", daemon=True)
        self._thread.start()

    # -- the offering process ---------------------------------------------------------
    def offer(self, key: str, fields: dict[str, Any], what: tuple[str, str]) -> bool:
        """Offer graph ``key`` (``fields``: the worker's job, without this process's store settings, which hold its
        secret; ``what``: the graph's name and shapes, for the taker's report)."""
        return self._pool.offer(key, pickle.dumps({**fields, "what": what}))

    def claim(self, key: str) -> HeldLease | None:
        return self._pool.claim(key)

    def withdraw(self, key: str) -> None:
        self._pool.withdraw(key)

    def ended_at_taker(self, key: str) -> bool:
        """Whether a taker's compile of ``key`` has ended (its result is there): the offering process follows it
        to the end instead of compiling the graph again."""
        return self._pool.result(key) is not None

    def follow(self, job: _Job) -> None:
        """Another process claimed ``job`` first: wait for it in the background, so this process's worker goes on
        with what is queued behind."""
        threading.Thread(target=self._follow, args=(job,), name="recipecache-pool-follow", daemon=True).start()

    def _follow(self, job: _Job) -> None:
        """End ``job`` when its taker published it; take it back when the taker failed, or died (its claim expired
        unrenewed) or the store could not say: one takeover, compiled here."""
        no_stall = self._no_stall
        while self._pool.claimed(job.key):
            if job.cancelled:  # exiting past the grace: the taker publishes it for the next process that meets it
                no_stall.drop(job)
                job.future.set_exception(RuntimeError("the process was exiting while a taker compiled it"))
                return
            self._pool.wait_claimed(job.key, POLL_S)
        result = self._pool.result(job.key)
        self._pool.withdraw(job.key)
        if result is not None and result.compiled:
            no_stall.drop(job)
            no_stall.metrics.no_stall(pool_handed=1)
            log.info("recipecache: %s was compiled for this process by %s", job.key, result.by)
            job.future.set_result(0.0)
            return
        why = result.error if result is not None else "its taker ended without a result (it died, or the store failed)"
        log.warning("recipecache: the compile pool did not compile %s (%s); compiling it here", job.key, why)
        job.offered = False  # withdrawn: nobody takes it meanwhile, and this process compiles it unclaimed
        no_stall.metrics.no_stall(pool_takeovers=1)
        no_stall.workers.submit(lambda: no_stall.compile_here(job))

    # -- the taker --------------------------------------------------------------------
    def stop(self) -> None:
        """Take nothing more (the process is exiting)."""
        self._stop.set()

    def take_at_exit(self, deadline: float) -> None:
        """This process is exiting, its own compiles ended: go on taking other processes' offers until none is left
        unclaimed or ``deadline`` (``time.monotonic()``, the end of its exit grace) passes. A process that finished
        its script early, or met fewer graphs, compiles what another still has queued, and the job's graphs are
        published sooner; one still compiling at the deadline is ended with the worker, and its offering process
        takes the graph back (:meth:`_follow`)."""
        self._at_exit.set()
        while time.monotonic() < deadline and not self._stop.is_set():
            if not self._taking.is_set() and not any(not self._pool.claimed(key) for key in self._others_offers()):
                return
            time.sleep(TAKE_POLL_S)

    def _take_loop(self) -> None:
        while not self._stop.wait(TAKE_POLL_S):
            try:
                if self._no_stall.idle(at_exit=self._at_exit.is_set()):
                    self._taking.set()
                    try:
                        self._take_one()
                    finally:
                        self._taking.clear()
            except Exception:  # the pool is an extra: this process's own compiles go on without it
                log.warning("recipecache: the compile pool's taker failed; it looks again", exc_info=True)

    def _others_offers(self) -> dict[str, str]:
        """The offers this process may take (graph key -> offering member): other processes', less those its worker
        could not compile."""
        return {
            key: member
            for key, member in self._pool.offers().items()
            if member != self._pool.member and key not in self._passed
        }

    def _take_one(self) -> None:
        """Claim the first offer of another process this one may take, compile it and say how that ended."""
        for key, member in self._others_offers().items():
            if not self._no_stall.store.compiling(key):
                # its offering process holds the graph's lease until the graph is compiled: none does, so the offer
                # outlived its process (killed before it could withdraw it), in this job or an earlier one
                self._pool.withdraw(key)
                continue
            claim = self._pool.claim(key)
            if claim is None:
                continue
            try:
                data = self._pool.payload(key)  # verified before anything of it is unpickled
                if data is None:  # withdrawn meanwhile, or refused: its offering process compiles it
                    continue
                self._pool.report(key, self._compile(key, data, member))
            finally:
                claim.release()
            return

    def _compile(self, key: str, data: memoryview, offered_by: str) -> Result:
        job = pickle.loads(data)  # noqa: S301 - sealed (and signed, with a secret) in the job's store: verified
        what = tuple(job.pop("what"))
        job["settings"] = self._no_stall.store.settings
        try:
            seconds = self._no_stall.submit_taken(key, what, pickle.dumps(job), self._stop.is_set).result()
        except Exception as exc:  # noqa: BLE001 - counted by the offering process, which compiles it itself
            self._passed.add(key)
            log.warning("recipecache: could not compile %s for %s: %s", key, offered_by, exc)
            return Result(compiled=False, compile_s=0.0, by=self._pool.member, error=str(exc))
        log.info("recipecache: compiled %s for %s in %.1f s", key, offered_by, seconds)
        return Result(compiled=True, compile_s=seconds, by=self._pool.member)
