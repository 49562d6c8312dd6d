"""No-stall: a graph that missed runs without inductor while one process compiles it behind the steps.

A JIT's tiers (the JVM's interpreter while C2 compiles, V8's Ignition while TurboFan
does) applied to torch.compile, with the store as the meeting point:

* A rank meets a graph (forward or backward, after dynamo and AOTAutograd traced it)
  whose FX entry is not in the store. Instead of compiling it inline, the hooks raise
  :class:`Deferred` from inside torch's ``fx_codegen_and_compile`` (the FX cache lookup
  has run and missed by then), and ``_compile_fx_inner`` returns a :class:`.graph.NoStallGraph`:
  a boxed callable (inductor's calling convention) that runs the traced graph module
  eagerly, as torch's ``aot_eager`` backend does, until the compiled graph is there.
* Exactly one process of the job compiles it: the one that took the key's lease
  (``Store.begin(wait=False)``; the others get role ``busy`` at once, never waiting). It
  sends the graph, with torch's own wire format for out-of-process compiles
  (``_SerializedFxCompile.serialize_compile``: ``GraphPickler`` carries the FakeTensors
  and the shape environment), to a worker process (:mod:`.worker`), which runs
  torch's whole ``_compile_fx_inner`` with recipecache enabled: the entry and its kernels
  land in the store exactly as an inline compile's would, so a later job of fresh ranks
  hits it and compiles nothing. The worker is a fresh interpreter started with ``-m``
  (never the user's script), so the compile holds no lock of the training process and,
  on a GPU node, runs on otherwise idle CPU cores. A process keeps its one worker for all
  its graphs (:class:`.pool.WorkerPool`), as torch's own subprocess compile keeps its pool: torch's
  import, the CPU's ISA pick and inductor's warm state are paid once, not per graph.
* At its next call after the artifact exists (the leader: its job finished; the others:
  the key's lease is gone, asked at most every :data:`.graph.POLL_S`), a process loads it through
  torch's FX cache path: it runs ``_compile_fx_inner`` again with the graph, inputs and
  arguments it kept, under the tracing context and inductor config of the first attempt,
  which now hits. From then on the compiled graph runs, for the inputs its guards accept:
  guards inductor added while compiling (a size it specialized) stayed in the worker, so
  dynamo's guards lack them; the FX entry's ``guards_expr`` is checked at each call, and a
  call it rejects runs without inductor (counted ``guard_rejected``).
* The worker compiles under the rank's global torch state (:mod:`.global_state`: configs,
  precision and determinism flags, default dtype, thread count, environment), sent with each
  graph: its FX key is the rank's by construction. It still checks: another key, or a value it cannot
  reproduce, fails the compile (counted) and this process compiles the graph itself the next
  time it leads it. A state that cannot be sent at all (a custom pass in inductor's config),
  a graph torch cannot serialize or one running collectives on this process's groups is
  compiled inline at once, counted ``no_stall_inline``.
* A compile that fails, a worker that dies: counted (fallback ``no_stall_failed``, warned once),
  the lease released, and the graph eager meanwhile, but not for good: it switches as soon as
  any process publishes the key ("load, never lead"), and this process leads it again at most
  :data:`NO_STALL_TRIES` times in all, each after :data:`RETRY_S` seconds left to the others. A
  compile past its deadline (``RECIPECACHE_NO_STALL_TIMEOUT``) is ended the same way (fallback
  ``no_stall_timeout``). A load that misses or raises after our own compile: eager in this
  process, counted. Never a crash, never a hang.
* Compiles still running when the script ends are finished before the process exits,
  for at most the exit grace (:meth:`NoStall.finish`), then ended; those still queued are
  cancelled. Their leases are released either way. Graphs published meanwhile are loaded (no
  switch: no call follows), so AOTAutograd saves its entries naming them for the next process.

This module is the controller (:class:`NoStall`: which graphs are compiled behind, by whom, and what became of
them); beside it :mod:`.protocol` (what travels to the worker, and how), :mod:`.pool` (the compile thread and the
kept worker), :mod:`.graph` (the switching callable) and :mod:`.worker` (the worker process).

Numerics are those of eager versus ``torch.compile``: the eager graph and the compiled one
may differ in the last bits, as any eager run and its compiled twin do.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import metrics_schema as schema
from ...compile_pool import CompilePool
from ...lease import HeldLease
from ...reasons import Reason, Role
from ...store import Flight, Store
from .. import describe
from ..deferral import Deferred
from ..metrics import Metrics
from . import global_state
from .graph import RETRY_S, BackwardStage, CpuProbeWarmer, NoStallGraph
from .pool import CompileTimeout, WorkerPool
from .protocol import needs_process_groups, wire_input
from .sharing import Sharing

log = logging.getLogger(__name__)
#: seconds finish() waits for a killed compile's thread to release its lease
KILLED_JOB_WAIT_S = 10.0
#: how many times one process leads one graph's compile (in a worker, or inline after a worker could not
#: give the rank's key); past that it only waits for another process's artifact
NO_STALL_TRIES = 2
#: how a worker hooks torch up for its compile (:func:`.patches.hooked_for_worker`, handed in by ``enable()``
#: and sent with each job by name, so that the worker imports nothing above its feature): given the worker's
#: store, metrics and lease wait, it yields the integration whose ``last_key`` is the key the worker computed
HookUp = Callable[[Store, Metrics, float | None], AbstractContextManager[Any]]
#: what the key of a backward awaiting its forward's layouts (its report row's, its events') adds to the forward's:
#: its own key is computed once that forward is loaded (:meth:`NoStall.awaiting_forward`)
AWAITING_SUFFIX = ":backward-awaiting-forward"


@dataclass
class _Graph:
    """What this process knows of one graph compiled behind (the report's row)."""

    key: str
    name: str
    shapes: str
    eager_calls: int = 0
    eager_s: float = 0.0
    #: wall-clock time (Unix seconds) this process switched to the compiled graph, and the switch's seconds
    switched_at: float | None = None
    switch_s: float = 0.0
    #: seconds this process's background compile of the graph took
    compile_s: float = 0.0
    failed: str | None = None
    #: why this process's compile behind was ended unfinished at exit (past the exit grace): nothing published
    unfinished: str | None = None
    #: calls after the switch whose inputs the compiled graph's guards rejected (run without inductor)
    guard_rejected: int = 0

    def as_json(self) -> dict[str, Any]:
        """The row in the metrics (:data:`~recipecache.metrics_schema.NO_STALL_GRAPHS`); what did not happen left out."""
        happened = {
            schema.GRAPH_FAILED: self.failed,
            schema.GRAPH_UNFINISHED: self.unfinished,
            schema.GRAPH_GUARD_REJECTED: self.guard_rejected,
        }
        return schema.record(
            {
                schema.GRAPH_NAME: self.name,
                schema.GRAPH_SHAPES: self.shapes,
                schema.GRAPH_EAGER_CALLS: self.eager_calls,
                schema.GRAPH_EAGER_S: round(self.eager_s, 6),
                schema.GRAPH_SWITCHED_AT: self.switched_at,
                schema.GRAPH_SWITCH_S: round(self.switch_s, 6),
                schema.GRAPH_COMPILE_S: round(self.compile_s, 6),
                **{field: value for field, value in happened.items() if value},
            }
        )


@dataclass
class _Job:
    """One background compile: its key, its pickled input for the worker, the lease it holds, and its outcome
    (``future``: the compile's seconds here, 0.0 when a taker of the compile pool compiled it)."""

    key: str
    payload: bytes
    flight: Flight
    future: Future[float] = field(default_factory=Future)
    cancelled: bool = False
    #: offered to the compile pool (:mod:`.sharing`): claimed before it compiles here, withdrawn when it ends
    offered: bool = False


class WorkerFailed(RuntimeError):
    """The worker answered with an error; ``inline``: no worker can compile this graph under the rank's key
    (a value of the rank's state it could not reproduce, or another key), so the rank compiles it itself."""

    def __init__(self, why: str, *, inline: bool, key_mismatch: bool) -> None:
        super().__init__(why)
        self.inline = inline
        self.key_mismatch = key_mismatch


class NoStall:
    """This process's background compiles and switching graphs (one per enabled integration)."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        exit_grace: float,
        compile_timeout: float,
        *,
        hook_up: HookUp,
        compile_pool: CompilePool | None = None,
    ) -> None:
        """``compile_pool``: where this process offers the compiles queued behind its busy worker and takes those of
        others while its worker is idle (:mod:`.sharing`); None: it compiles only what it leads."""
        self.store = store
        self.metrics = metrics
        self.exit_grace = exit_grace
        #: seconds one compile behind may take before its worker is ended (:class:`CompileTimeout`)
        self.compile_timeout = compile_timeout
        self._hook_up = hook_up
        self.workers = WorkerPool(metrics)
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._futures: list[Future[float]] = []
        self.graphs: dict[str, _Graph] = {}
        #: per graph key: how many times this process led its compile, when it may lead it again after a failure
        #: (``inf``: once it has looked at the free lease, :meth:`looked_after_failure`), and whether its next lead
        #: compiles inline (a worker could not give the rank's key)
        self._tries: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._inline: set[str] = set()
        self._closed = False
        #: every graph's stand-in (:meth:`graph`), for the loads at exit (:meth:`_load_at_exit`)
        self._stand_ins: list[NoStallGraph] = []
        #: per tracing context (one per dynamo graph; DDP's optimizer compiles a graph per bucket in it): the forward
        #: last compiled behind, until AOTAutograd's backward stage of its compile; the stages kept to trace their
        #: backwards again on their forwards' compiled layouts (:class:`.graph.BackwardStage`)
        self._forwards: weakref.WeakKeyDictionary[Any, NoStallGraph] = weakref.WeakKeyDictionary()
        self._stages: weakref.WeakKeyDictionary[Any, list[BackwardStage]] = weakref.WeakKeyDictionary()
        #: set while :meth:`_load_at_exit` runs: a graph that misses then is deferred, never compiled
        self._loading_at_exit = False
        #: the seconds :meth:`finish` gave the compiles in flight (for the report of those it ended)
        self._finish_s = exit_grace
        self._cpu_probe = CpuProbeWarmer()
        metrics.follow_no_stall(self.snapshot)
        self._sharing = None if compile_pool is None else Sharing(self, compile_pool)

    # -- the hook side ------------------------------------------------------------
    def intercept(
        self, flight: Flight | None, what: tuple[str, str], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Deferred | None:
        """torch is about to compile a graph that missed (``fx_codegen_and_compile(*args, **kwargs)``).

        ``flight`` is this thread's single-flight of the graph's key: a leader sends the graph
        to a worker, a ``busy`` process leaves it to the lease holder; both get a
        :class:`Deferred` to raise. None (compile inline as usual): no flight (torch bypassed
        its cache for this graph), a lease-less fallback (the store failed: nothing to meet
        at), or a graph torch's wire format cannot carry.
        """
        if self._loading_at_exit:  # not there after all: loaded at exit or not at all, never compiled now
            if flight is not None and flight.role is Role.LEADER:
                flight.release()
            return Deferred.here("" if flight is None else flight.key, what)
        if flight is None or flight.role not in (Role.LEADER, Role.BUSY) or self._closed:
            return None
        self._row(flight.key, what)
        self._cpu_probe.warm(args[1])
        job = None
        if flight.role is Role.LEADER:
            lead = self._lead(flight)
            if lead is None:
                return Deferred.here(flight.key, what)  # left to the others: we wait for the artifact
            if lead == "inline":
                self.store.events.record("compile_start", flight.key)
                return None
            gm, example_inputs, inputs_to_check = args[:3]
            graph_kwargs = {k: v for k, v in kwargs.items() if k != "compile_region_name"}
            local = needs_process_groups(gm, example_inputs)
            if local is not None:
                self._counted_inline(flight.key, what, f"{local}, which a worker does not have")
                self.store.events.record("compile_start", flight.key)
                return None
            sent = self._sendable(flight, what, wire_input(gm, example_inputs, inputs_to_check, graph_kwargs))
            if sent is None:
                self.store.events.record("compile_start", flight.key)
                return None
            job = self._submit(flight, *sent)
        return Deferred.here(flight.key, what, job)

    def _lead(self, flight: Flight) -> str | None:
        """How this process leads the graph whose lease it took: ``worker``, ``inline`` (a worker could not give
        the rank's key), or None: it led it :data:`NO_STALL_TRIES` times, or its last compile failed less than
        :data:`RETRY_S` ago; the lease is released for another process, and this one waits for its artifact."""
        with self._lock:
            tries = self._tries.get(flight.key, 0)
            if not self.may_lead(flight.key):
                lead = None
            else:
                self._tries[flight.key] = tries + 1
                lead = "inline" if flight.key in self._inline else "worker"
        if lead is None:
            flight.release()
        elif tries:
            self.metrics.no_stall(retries=1)
        return lead

    def may_lead(self, key: str) -> bool:
        """Whether this process may lead graph ``key``'s compile now (:meth:`_lead`)."""
        return self._tries.get(key, 0) < NO_STALL_TRIES and time.monotonic() >= self._retry_at.get(key, 0.0)

    def looked_after_failure(self, key: str) -> None:
        """This process saw graph ``key``'s lease free: if its compile of it failed, it may lead it again
        :data:`RETRY_S` from now. Counted from a look, not from the failure, so that in a data-parallel job every
        other rank calls the graph (and looks at the free lease) at least once before this one takes it again."""
        with self._lock:
            if self._retry_at.get(key) == float("inf"):
                self._retry_at[key] = time.monotonic() + RETRY_S

    def _sendable(
        self, flight: Flight, what: tuple[str, str], wire: bytes | None
    ) -> tuple[bytes, dict[str, Any]] | None:
        """The graph's wire input and this process's global state (:mod:`.global_state`), or None (counted):
        a worker could not compile it under this process's key, which compiles it inline."""
        if wire is None:
            self._counted_inline(flight.key, what, "torch cannot serialize this graph for a worker")
            return None
        try:
            return wire, global_state.capture()
        except global_state.Uncarried as exc:
            self._counted_inline(flight.key, what, f"a worker cannot get this process's state ({exc})")
            return None

    def graph(
        self,
        deferred: Deferred,
        compile_with: Callable[[list[Any]], Any],
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        *,
        backward: bool = False,
    ) -> NoStallGraph:
        """The switching callable ``_compile_fx_inner`` returns for the deferred graph (``backward``: AOTAutograd's
        backward of a forward, which may run compiled meanwhile); ``compile_with(inputs)`` runs torch's compile of
        the graph again on ``inputs``."""
        self._row(deferred.key, deferred.what)
        stand_in = NoStallGraph(self, deferred, compile_with, gm, example_inputs, backward=backward)
        context = deferred.context
        if not backward and context is not None and context.output_strides is not None:  # AOTAutograd's forward
            self._forwards[context] = stand_in
        with self._lock:
            self._stand_ins.append(stand_in)
        return stand_in

    def backward_stage(self, stage: Callable[..., Any], arguments: dict[str, Any]) -> None:
        """AOTAutograd is about to run its backward stage ``stage(**arguments)`` (``_aot_stage2b_bw_compile``): where
        the forward of this compile is compiled behind, keep the stage, so that the backward is traced again on that
        forward's layouts before it is compiled (:class:`.graph.BackwardStage`)."""
        context = torch._guards.TracingContext.try_get()
        forward = self._forwards.pop(context, None) if context is not None else None
        if forward is not None and not arguments.get("fwd_output_strides"):  # reported none (an empty list)
            self._stages.setdefault(context, []).append(BackwardStage(stage, dict(arguments), forward))

    def awaiting_forward(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], compile_with: Callable[[list[Any]], Any]
    ) -> NoStallGraph | None:
        """What ``_compile_fx_inner`` returns for a backward whose forward is compiled behind: a stand-in that runs it
        eagerly, neither looked up nor compiled, until that forward is loaded, and then traces it on the forward's
        layouts (:class:`.graph.BackwardStage`); None for any other graph (compiled as usual).

        Not even its key is computed before: a key computed on eager's layouts is one no process compiles, and
        computing it (torch reads its inputs' symbolic strides) may leave facts in the shape environment that a
        fresh process, whose forward hits, does not have when it traces the same backward: the keys of dynamic
        backwards differed. Its row in the report is named by its forward's key until then.
        """
        stage = self._awaits_its_forward(example_inputs)
        if stage is None:
            return None
        what = (describe.function_name({"is_backward": True}), describe.input_shapes(example_inputs))
        deferred = Deferred.here(stage.forward.key + AWAITING_SUFFIX, what)
        deferred.follows = stage
        return self.graph(deferred, compile_with, gm, example_inputs, backward=True)

    def _awaits_its_forward(self, example_inputs: list[Any]) -> BackwardStage | None:
        """The kept stage of the backward torch is compiling on ``example_inputs`` (taken: its compile is left to it),
        if its forward is compiled behind; else None."""
        context = torch._guards.TracingContext.try_get()
        stages = (self._stages.get(context) if context is not None else None) or []
        stage = next((s for s in stages if s.is_for(example_inputs)), None)
        if stage is not None:
            stages.remove(stage)
        return stage

    def rekey(self, old: str, new: str, stand_in: NoStallGraph) -> None:
        """``stand_in``, a backward that ran under key ``old`` while it awaited its forward, is now graph ``new`` (traced
        on its forward's layouts): its eager calls move to the new key's row, which the report shows."""
        with self._lock:
            row = self.graphs.get(old)
            if row is None or old == new:
                return
            target = self.graphs.setdefault(new, _Graph(new, row.name, row.shapes))
            if not any(g is not stand_in and g._key == old for g in self._stand_ins):
                del self.graphs[old]
                target.eager_calls += row.eager_calls
                target.eager_s += row.eager_s

    def _row(self, key: str, what: tuple[str, str]) -> _Graph:
        """The report's row of graph ``key`` (``what``: its name and input shapes), made at its first sight."""
        with self._lock:
            return self.graphs.setdefault(key, _Graph(key, *what))

    def snapshot(self) -> dict[str, Any]:
        """Per graph key, what no-stall did with it in this process (the metrics' ``no_stall.graphs``)."""
        with self._lock:
            return {key: graph.as_json() for key, graph in self.graphs.items()}

    # -- background compiles -------------------------------------------------------
    def _submit(self, flight: Flight, wire: bytes, state: dict[str, Any]) -> Future[float]:
        fields = {
            "key": flight.key,
            "wire": wire,
            "state": state,
            "sys_path": list(sys.path),
            "hook_up": self._hook_up,  # pickled by name: the worker imports it
        }
        # sent on the worker's stdin, never written to disk: the settings hold the store's secret
        job = _Job(flight.key, pickle.dumps({**fields, "settings": self.store.settings}), flight)
        self.store.events.record("compile_start", flight.key, behind=True)
        with self._lock:
            self._jobs[flight.key] = job
            self._futures.append(job.future)
        if self._sharing is not None and not self.workers.idle():  # it would wait here: any idle process may take it
            graph = self.graphs[flight.key]
            job.offered = self._sharing.offer(flight.key, fields, (graph.name, graph.shapes))
        self.workers.submit(lambda: self._start(job))
        return job.future

    def _start(self, job: _Job) -> None:
        """This process's worker got to ``job`` (unless finish() cancelled it meanwhile): compile it here, or, if a
        taker of the compile pool claimed it first (or already compiled it), follow that taker."""
        if not job.future.set_running_or_notify_cancel():
            return
        claim = None
        if job.offered:
            assert self._sharing is not None
            claim = self._sharing.claim(job.key)
            if claim is None or self._sharing.ended_at_taker(job.key):  # a taker has it, or has compiled it
                if claim is not None:
                    claim.release()
                self._sharing.follow(job)
                return
        self.compile_here(job, claim)

    def compile_here(self, job: _Job, claim: HeldLease | None = None) -> None:
        """Compile ``job`` in this process's worker and end it (``claim``: its claim in the compile pool)."""
        try:
            job.future.set_result(self._run(job))
        except BaseException as exc:  # noqa: BLE001 - counted by _run; read by the graph's switch
            job.future.set_exception(exc)
        finally:
            if claim is not None:
                claim.release()
            if job.offered:
                assert self._sharing is not None
                self._sharing.withdraw(job.key)

    def idle(self, at_exit: bool = False) -> bool:
        """Whether this process's worker has nothing to compile (and the process is not exiting, unless ``at_exit``:
        its own compiles ended within the exit grace, it takes others', :meth:`.sharing.Sharing.take_at_exit`)."""
        return self.workers.idle() and (at_exit or not self._closed)

    def submit_taken(
        self, key: str, what: tuple[str, str], payload: bytes, cancelled: Callable[[], bool]
    ) -> Future[float]:
        """Compile another process's graph ``key`` (``what``: its name and shapes), taken from the compile pool, in
        this process's worker after what is queued here; its seconds, counted here (a job's compile seconds are
        where its compiles ran). At exit it gets the grace, as this process's own compiles do."""

        def run() -> float:
            seconds = self._work(key, payload, cancelled)
            self.store.events.record("compile", key, seconds, behind=True, taken=True)
            self.metrics.no_stall(compiles=1, compile_s=seconds, pool_taken=1)
            row = self._row(key, what)
            with self._lock:
                row.compile_s += seconds
            return seconds

        future = self.workers.submit(run)
        with self._lock:
            self._futures.append(future)
        return future

    def _run(self, job: _Job) -> float:
        """Run one worker to its end; the compile's seconds, or raise why it failed (counted). Always frees the lease."""
        graph = self.graphs[job.key]
        try:
            seconds = self._work(job.key, job.payload, lambda: job.cancelled)
        except Exception as exc:
            if job.cancelled:  # ended by finish(), past the exit grace: not a failure of the compile
                self._unfinished(job, "it was still compiling")
                raise
            self._compile_failed(job.key, exc)
            reason = Reason.NO_STALL_TIMEOUT if isinstance(exc, CompileTimeout) else Reason.NO_STALL_FAILED
            self._failed(job.key, (graph.name, graph.shapes), f"the compile behind failed ({exc})", reason)
            raise
        finally:
            self.drop(job)
        self.store.events.record("compile", job.key, seconds, behind=True)
        self.metrics.no_stall(compiles=1, compile_s=seconds)
        with self._lock:
            graph.compile_s += seconds
        return seconds

    def _compile_failed(self, key: str, exc: Exception) -> None:
        """Our compile of ``key`` failed: lead it again only after a wait (:meth:`looked_after_failure`), and
        inline if the worker could not give this process's key."""
        inline = isinstance(exc, WorkerFailed) and exc.inline
        with self._lock:
            self._retry_at[key] = float("inf")
            if inline:
                self._inline.add(key)
        if isinstance(exc, WorkerFailed) and exc.key_mismatch:
            self.metrics.no_stall(key_mismatches=1)

    def _work(self, key: str, payload: bytes, cancelled: Callable[[], bool]) -> float:
        """Have this process's worker compile graph ``key`` from the pickled job ``payload`` (starting one if none runs, unless
        ``cancelled()``); its seconds, or raise why not."""
        result = self.workers.compile(payload, self.compile_timeout, cancelled)
        if result.get("error"):
            raise WorkerFailed(
                result["error"], inline=bool(result.get("inline")), key_mismatch=bool(result.get("key_mismatch"))
            )
        for reason in result.get("unpublished", ()):
            self.metrics.fallback(
                Reason(reason),
                f"the no-stall worker compiled {key} but could not publish it; "
                "this process loads it from torch's local cache, other processes compile it again",
            )
        return float(result["compile_s"])

    def drop(self, job: _Job) -> None:
        """A job ended (or was cancelled before it began): free its lease, so another process may compile the graph."""
        job.flight.release()
        with self._lock:
            self._jobs.pop(job.key, None)

    def _failed(self, key: str, what: tuple[str, str], why: str, reason: Reason = Reason.NO_STALL_FAILED) -> None:
        """Count and say why graph ``key``'s compile behind the steps failed: it runs without inductor."""
        self._row(key, what).failed = why
        self.metrics.no_stall(failed=1)
        self.metrics.fallback(reason, f"{what[0]} {what[1]} ({key}): {why}; it runs without inductor")

    def _counted_inline(self, key: str, what: tuple[str, str], why: str) -> None:
        """Count and say why no worker can compile graph ``key`` (``why``): this process compiles it inline, on its
        step's path, now; the others run it without inductor until it is published. By design, not a failure."""
        self.metrics.no_stall(inline=1)
        self.metrics.fallback(
            Reason.NO_STALL_INLINE,
            f"{what[0]} {what[1]} ({key}): {why}; this process compiles it inline; the others run it without "
            "inductor until it is published",
        )

    def _unfinished(self, job: _Job, state: str) -> None:
        """Count and say that ``job`` was ended at exit, past the exit grace (``state``: queued or compiling):
        nothing is published, so the next process that meets the graph compiles it."""
        graph = self.graphs[job.key]
        why = f"{state} {self._finish_s:g} s after the script ended (the exit grace); nothing published"
        graph.unfinished = why
        self.metrics.no_stall(unfinished=1)
        self.metrics.fallback(
            Reason.NO_STALL_UNFINISHED,
            f"{graph.name} {graph.shapes} ({job.key}): {why}; the next job that meets it compiles it",
        )

    # -- exit ----------------------------------------------------------------------
    def finish(self, timeout: float) -> None:
        """Let the compiles in flight finish and publish, for at most ``timeout`` seconds; then end them.

        Runs at exit: the next job then starts warm, and the exit is never held longer. A compile
        still queued is cancelled and its lease freed; the one running is ended, and waited for
        (briefly) to free its own.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout > 0:
            self._follow_at_exit(deadline)
        with self._lock:
            self._finish_s = timeout
            self._closed = True
            futures = list(self._futures)
            pending = [f for f in futures if not f.done()]
        if pending:
            log.info("recipecache: finishing %d compile(s) behind before exit (at most %.0f s)", len(pending), timeout)
        for future in futures:
            with contextlib.suppress(
                Exception
            ):  # failures are counted where they are seen; here only the deadline counts
                future.result(timeout=_wait_s(deadline))
        if self._sharing is not None and all(future.done() for future in futures):
            self._sharing.take_at_exit(deadline)
        with self._lock:
            futures = list(self._futures)  # with those taken at exit
            jobs = list(self._jobs.values())
            for job in jobs:
                job.cancelled = True  # before the kill: the pool starts no worker for a cancelled job
        if jobs:
            log.warning(
                "recipecache: ending the compile(s) behind of %s: past the exit grace",
                ", ".join(job.key for job in jobs),
            )
        for job in jobs:
            if job.future.cancel():
                self._unfinished(job, "it was still queued")
                self.drop(job)
                if job.offered:
                    assert self._sharing is not None
                    self._sharing.withdraw(job.key)
        if jobs or not all(future.done() for future in futures):  # one of them another process's (the pool)
            self.workers.kill()
        for job in jobs:
            with contextlib.suppress(Exception):
                job.future.result(timeout=KILLED_JOB_WAIT_S)
        self._load_at_exit(deadline)
        if self._sharing is not None:
            self._sharing.stop()
        self.workers.close()

    def _follow_at_exit(self, deadline: float) -> None:
        """Within the exit grace, compile behind the backwards that await their forwards' layouts, once those forwards'
        compiles (here or by the lease holder) end and they load. A short job ends before such a forward switches:
        without this its backward would never be compiled, and the next job would compile it."""
        with self._lock:
            reachable = self._reachable_at_exit()
            waiting = [(g, g.follows_its_forward()) for g in reachable]
        for backward, stage in waiting:
            if stage is None or stage.forward not in reachable or time.monotonic() >= deadline:
                continue
            stage.forward.wait_for_compile(_wait_s(deadline))
            with self._only_loading():
                stage.forward.load_at_exit()
            backward.follow_now()

    def _reachable_at_exit(self) -> list[NoStallGraph]:
        """The graphs standing in that may still be keyed and loaded at exit; the caller holds ``_lock``.

        Not those that use process groups once the script destroyed them (``dist.destroy_process_group()``, as most
        end): a device mesh no longer names its groups, so torch's FX key falls back to pickling this rank's mesh
        whole, a key no other rank shares, looked up and missed in vain (test_collectives: 9 graph keys, not 7).
        """
        import torch.distributed as dist

        groups_gone = dist.is_available() and not dist.is_initialized()
        return [g for g in self._stand_ins if not (groups_gone and g.uses_process_groups)]

    @contextlib.contextmanager
    def _only_loading(self) -> Iterator[None]:
        """Graphs looked up in this block are loaded where published, never compiled: a miss is deferred
        (:meth:`intercept`), its lease freed. For the loads at exit."""
        self._loading_at_exit = True
        try:
            yield
        finally:
            self._loading_at_exit = False

    def _load_at_exit(self, deadline: float) -> None:
        """Load, within the exit grace, the published graphs that ran here without inductor and never switched, for
        the AOTAutograd entries that wait for them (:meth:`.graph.NoStallGraph.load_at_exit`).

        A graph compiled behind in a short job is often published after the script ended, in the exit grace: no
        call switches to it, and AOTAutograd's entry naming it would never be saved. The next process would then
        trace the graph through AOTAutograd again before its FX lookup hits (Lightning's fresh no-stall job: 2
        AOTAutograd misses, iterations 0+1 1.8x the graph store's fresh job).
        """
        with self._lock:
            reachable = self._reachable_at_exit()
            waiting = [g for g in reachable if g.awaits_load()]
            left = [g for g in self._stand_ins if g not in reachable and (g.awaits_load() or g.follows_its_forward())]
        if left:
            log.info(
                "recipecache: %d graph(s) using process groups neither loaded nor compiled at exit: the script "
                "destroyed its process groups first; the next job compiles them",
                len(left),
            )
        loaded = 0
        with self._only_loading():
            for stand_in in waiting:
                if time.monotonic() >= deadline:
                    break
                loaded += stand_in.load_at_exit()
        if loaded:
            log.info("recipecache: loaded %d graph(s) compiled behind at exit, for their AOTAutograd entries", loaded)

    def close(self) -> None:
        """End every worker at once (disable)."""
        self.finish(0.0)


def _wait_s(deadline: float) -> float:
    """Seconds from now to ``deadline`` (``time.monotonic()``), as a wait's timeout: never negative, never
    past what a lock's wait takes (``threading.TIMEOUT_MAX``: an exit grace of 1e10 s would overflow it)."""
    return min(max(deadline - time.monotonic(), 0.0), threading.TIMEOUT_MAX)
