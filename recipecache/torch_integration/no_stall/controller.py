"""No-stall: a graph that missed runs without inductor while one process compiles it behind the steps.

A JIT's tiers (the JVM's interpreter while C2 compiles, V8's Ignition while TurboFan
does) applied to torch.compile, with the store as the meeting point:

* A rank meets a graph (forward or backward, after dynamo and AOTAutograd traced it)
  whose FX entry is not in the store. Instead of compiling it inline, the hooks raise
  :class:`Deferred` from inside torch's ``fx_codegen_and_compile`` (the FX cache lookup
  has run and missed by then), and ``_compile_fx_inner`` returns a :class:`NoStallGraph`:
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
  its graphs (:class:`_Worker`), as torch's own subprocess compile keeps its pool: torch's
  import, the CPU's ISA pick and inductor's warm state are paid once, not per graph.
* At its next call after the artifact exists (the leader: its job finished; the others:
  the key's lease is gone, asked at most every :data:`POLL_S`), a process loads it through
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
  time it leads it. A state that cannot be sent at all (a custom pass in inductor's config)
  has the graph compiled inline at once, counted.
* A compile that fails, a worker that dies: counted (fallback ``no_stall_failed``, warned once),
  the lease released, and the graph eager meanwhile, but not for good: it switches as soon as
  any process publishes the key ("load, never lead"), and this process leads it again at most
  :data:`NO_STALL_TRIES` times in all, each after :data:`RETRY_S` seconds left to the others. A
  compile past its deadline (``RECIPECACHE_NO_STALL_TIMEOUT``) is ended the same way (fallback
  ``no_stall_timeout``). A load that misses or raises after our own compile: eager in this
  process, counted. Never a crash, never a hang.
* Compiles still running when the script ends are finished before the process exits,
  for at most the exit grace (:meth:`NoStall.finish`), then ended; those still queued are
  cancelled. Their leases are released either way.

Numerics are those of eager versus ``torch.compile``: the eager graph and the compiled one
may differ in the last bits, as any eager run and its compiled twin do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config

from ... import env
from ...reasons import Reason, Role
from ...store import Flight, Store
from .. import deferral
from ..deferral import Deferred, deferred_of
from ..metrics import Metrics
from . import global_state

log = logging.getLogger(__name__)

#: seconds between two looks of a ``busy`` process at the key's lease
POLL_S = 0.5
#: seconds finish() waits for a killed compile's thread to release its lease
KILLED_JOB_WAIT_S = 10.0
#: how many times one process leads one graph's compile (in a worker, or inline after a worker could not
#: give the rank's key); past that it only waits for another process's artifact
NO_STALL_TRIES = 2
#: seconds a process whose compile of a graph failed leaves its lead to the others before it takes it
#: again, and between two looks for the artifact of a graph it may no longer lead while nobody compiles it
RETRY_S = 5.0


#: ops a worker can look up by name: torch's own (the worker runs the same torch, never the user's
#: code, so ops a user library registers are not there). torch's wire format allows ``aten`` only
#: (``GraphPickler``'s default ``ops_filter``), which turns away most training graphs (``prims.iota``
#: of an ``arange``, for one)
_WORKER_OPS = ("torch.ops.aten.", "torch.ops.prims.", "torch.ops.fbgemm.")


def _worker_op(name: str) -> bool:
    return name.startswith(_WORKER_OPS)


#: namespaces of the ops that run collectives on a process group of the process (the compile of a graph calling
#: them asks the group, by name, for its size: only a process in the group can compile it)
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})


def needs_process_groups(gm: torch.fx.GraphModule, example_inputs: Any) -> str | None:
    """Why only this process can compile ``gm``, or None: a graph that runs collectives (inductor resolves their
    process groups by name while compiling), or that takes a device mesh or another opaque object (torch's wire
    format sends a mesh as None, so the worker's FX key would not be the rank's: measured on 2.13, a key mismatch
    on every TP backward)."""
    from torch._library.fake_class_registry import FakeScriptObject

    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
            return f"the graph runs collectives ({node.target}) on this process's groups"
    if any(isinstance(x, FakeScriptObject) for x in example_inputs):
        return "the graph takes an opaque object (a device mesh) that only this process holds"
    return None


def wire_input(
    gm: torch.fx.GraphModule, example_inputs: Any, inputs_to_check: Any, graph_kwargs: dict[str, Any]
) -> bytes | None:
    """torch's wire-format input of one graph compile (what ``_SerializedFxCompile.serialize_compile``
    builds), pickled with :data:`_WORKER_OPS` allowed; None if the graph cannot travel (torch's reasons:
    a higher-order op its cache bypasses, a Triton kernel wrapper, something unpicklable)."""
    from pickle import PicklingError

    from torch._inductor import compile_fx_ext as ext
    from torch._inductor.codecache import BypassFxGraphCache, FxGraphCache
    from torch.fx._graph_pickler import GraphPickler, Options

    try:
        FxGraphCache._check_for_hop(gm)
        if ext._graph_contains_triton_kernel_wrappers(gm):
            return None
        fields = {
            "gm": gm,
            "example_inputs": example_inputs,
            "inputs_to_check": inputs_to_check,
            "graph_kwargs": graph_kwargs,
            "tracing_context": torch._guards.TracingContext.try_get(),
            "config": inductor_config.save_config_portable(),
            "virtualized": ext._VirtualizedSerializer.serialize(),
            "deterministic_guard_for_testing": None,
            "logger_state": ext._LoggerState(),
            "lowering": ext._LoweringSerializer(),
            "fake_tensor_mode": ext._FakeTensorModeSerializer(ext._current_fake_mode()),
        }
        if "backend_configs" in {f.name for f in dataclasses.fields(ext._WireProtocolInput)}:  # torch >= 2.15
            fields["backend_configs"] = backend_configs()
        return GraphPickler.dumps(ext._WireProtocolInput(**fields), Options(ops_filter=_worker_op))
    except (AttributeError, BypassFxGraphCache, PicklingError, NotImplementedError) as exc:
        log.debug("recipecache: cannot send graph to a worker: %r", exc)
        return None


def backend_configs() -> dict[str, dict[str, Any]]:
    """The codegen configs of the out-of-tree backends registered here (``register_backend_for_device``'s
    ``device_custom_config``), by module, as torch 2.15's wire format carries them: the FX key covers them, and
    the worker compiles under them (``patch`` of each module, as torch's own child does)."""
    from torch._inductor.codegen.common import custom_backend_codegen_configs

    return {
        module.__name__: module.get_serializable_config_copy()
        for module in custom_backend_codegen_configs.values()
        if module is not None
    }


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
        return {
            "name": self.name,
            "shapes": self.shapes,
            "eager_calls": self.eager_calls,
            "eager_s": round(self.eager_s, 6),
            "switched_at": self.switched_at,
            "switch_s": round(self.switch_s, 6),
            "compile_s": round(self.compile_s, 6),
            **({"failed": self.failed} if self.failed else {}),
            **({"unfinished": self.unfinished} if self.unfinished else {}),
            **({"guard_rejected": self.guard_rejected} if self.guard_rejected else {}),
        }


@dataclass
class _Job:
    """One background compile: its key, its pickled input for the worker, the lease it holds."""

    key: str
    payload: bytes
    flight: Flight
    cancelled: bool = False
    future: Future[float] | None = None


class CompileTimeout(RuntimeError):
    """A compile behind ran past its deadline; its worker was ended."""


#: the frame of one message on the worker's pipes: its length, then that many bytes
_FRAME = struct.Struct("!Q")


def write_frame(stream: Any, payload: bytes) -> None:
    stream.write(_FRAME.pack(len(payload)))
    stream.write(payload)
    stream.flush()


#: The largest reply a worker sends (a small dict: seconds, an error message): a header claiming more is a
#: stream out of step, never a reason to allocate what it claims.
MAX_REPLY_BYTES = 64 * 1024 * 1024


def read_frame(stream: Any, limit: int | None = None) -> bytes | None:
    """One message from ``stream``; None at its end (or a message cut short: the writer died).

    ValueError for a message that says it is longer than ``limit`` bytes (nothing of it is read).
    """
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    size = _FRAME.unpack(head)[0]
    if limit is not None and size > limit:
        raise ValueError(f"a frame of {size} bytes (at most {limit})")
    payload = stream.read(size)
    return payload if len(payload) == size else None


class _Serial:
    """Runs submitted calls one after the other on one daemon thread.

    Not a ``ThreadPoolExecutor``: the interpreter joins those threads at exit *before* the
    ``atexit`` handlers run, so a stuck compile would hold the exit before :meth:`NoStall.finish`
    could apply the exit grace. A daemon thread is not joined; finish() waits for it, within the grace.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, call))
        return future

    def _loop(self) -> None:
        while True:
            future, call = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
                future.set_exception(exc)


class WorkerFailed(RuntimeError):
    """The worker answered with an error; ``inline``: no worker can compile this graph under the rank's key
    (a value of the rank's state it could not reproduce, or another key), so the rank compiles it itself."""

    def __init__(self, why: str, *, inline: bool, key_mismatch: bool) -> None:
        super().__init__(why)
        self.inline = inline
        self.key_mismatch = key_mismatch


#: the directory that holds the ``recipecache`` package (this module's name says how deep it sits in it)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[len(__name__.split(".")) - 1])


class _Worker:
    """This process's compile worker (:mod:`.worker`), kept for one graph after another.

    Each job travels on its stdin as one frame (:func:`write_frame`: the store settings, secret
    included, never touch the disk), its result comes back as one frame on its stdout; its own
    output goes to an unnamed temporary file whose tail explains a failure. End of file on its
    stdout means it died: the job in hand fails and the next job starts a new worker.
    """

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - kept open for the worker's life, closed in close()
        environ = dict(os.environ)
        for name in (env.EVENT_LOG, env.METRICS_FILE, env.METRICS_FLUSH):
            environ.pop(name, None)  # the parent records the background compile; the worker writes nothing of its own
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, environ.get("PYTHONPATH")) if p)
        self.expired = False
        # started in the package's root, which ``-m`` puts first on sys.path: never a module of the rank's directory.
        # In a process group of its own (this rank's session): a worker stopped (SIGSTOP) before it could ask to
        # die with the rank would otherwise outlive a rank killed meanwhile, stopped for good; the kernel ends
        # such a group when its parent dies (SIGHUP, then SIGCONT, to a group left orphaned with stopped members)
        own_group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}  # 3.10: none
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "recipecache.torch_integration.no_stall.worker", str(os.getpid())],
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=PACKAGE_ROOT,
            **own_group,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def compile(self, payload: bytes, timeout: float) -> dict[str, Any]:
        """Have the worker compile one job within ``timeout`` seconds; its result, or raise why there is none
        (:class:`CompileTimeout` past the deadline, having ended the worker)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        log_start = os.fstat(self.log.fileno()).st_size
        timer = threading.Timer(min(timeout, threading.TIMEOUT_MAX), self._expire)
        timer.daemon = True
        timer.start()
        try:
            write_frame(self.proc.stdin, payload)
            reply = read_frame(self.proc.stdout, MAX_REPLY_BYTES)
        except OSError:  # a broken pipe: it is gone
            reply = None
        except ValueError as exc:
            self.kill()
            raise RuntimeError(f"the worker's reply was not one: {exc}; its worker was ended") from None
        finally:
            timer.cancel()
        if self.expired:
            raise CompileTimeout(
                f"the compile ran past its deadline ({timeout:g} s, {env.NO_STALL_TIMEOUT}); its worker was ended"
            )
        if reply is None:
            self.kill()
            tail = os.pread(self.log.fileno(), 600, max(log_start, os.fstat(self.log.fileno()).st_size - 600))
            text = tail.decode(errors="replace").strip()
            raise RuntimeError(f"worker exited with status {self.proc.returncode}" + (f": ...{text}" if text else ""))
        try:
            result = pickle.loads(reply)  # noqa: S301 - our own child's answer on our own pipe
        except Exception as exc:  # noqa: BLE001 - whatever the bytes were, the stream is out of step
            result = exc
        if not isinstance(result, dict):
            self.kill()
            raise RuntimeError(f"the worker's reply was not a result ({type(result).__name__}); its worker was ended")
        return result

    def _expire(self) -> None:
        self.expired = True
        self.kill()

    def kill(self) -> None:
        """End it now, mid-compile or not."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Let it exit at the end of its input (within ``timeout`` seconds, else end it)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


class NoStall:
    """This process's background compiles and switching graphs (one per enabled integration)."""

    def __init__(self, store: Store, metrics: Metrics, exit_grace: float, compile_timeout: float) -> None:
        self.store = store
        self.metrics = metrics
        self.exit_grace = exit_grace
        #: seconds one compile behind may take before its worker is ended (:class:`CompileTimeout`)
        self.compile_timeout = compile_timeout
        # one compile at a time per process: forward and backward of one step would otherwise
        # fight over the same cores; they finish one after the other, the first switching early
        self._pool = _Serial("recipecache-behind")
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._worker: _Worker | None = None
        self._futures: list[Future[float]] = []
        self.graphs: dict[str, _Graph] = {}
        #: per graph key: how many times this process led its compile, when it may lead it again after a failure
        #: (``inf``: once it has looked at the free lease, :meth:`looked_after_failure`), and whether its next lead
        #: compiles inline (a worker could not give the rank's key)
        self._tries: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._inline: set[str] = set()
        self._closed = False
        #: the seconds :meth:`finish` gave the compiles in flight (for the report of those it ended)
        self._finish_s = exit_grace
        self._probe_warmed = False
        metrics.follow_no_stall(self.snapshot)

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
        if flight is None or flight.role not in (Role.LEADER, Role.BUSY) or self._closed:
            return None
        self._row(flight.key, what)
        self._warm_cpu_probe(args[1])
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
                self._failed(flight.key, what, f"{local}, which a worker does not have", inline=True)
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
            self._failed(flight.key, what, "torch cannot serialize this graph for a worker", inline=True)
            return None
        try:
            return wire, global_state.capture()
        except global_state.Uncarried as exc:
            self._failed(flight.key, what, f"a worker cannot get this process's state ({exc})", inline=True)
            return None

    def _warm_cpu_probe(self, example_inputs: Any) -> None:
        """Pick the CPU's vector ISA now, in the background, the first time a CPU graph is deferred.

        Loading a compiled CPU graph asks for it, and a process that never compiled has not
        picked it yet: on torch 2.13 that runs torch's probe libraries, seconds, which would
        otherwise land in the step that switches. It runs g++ or the probe in child processes,
        so the thread mostly waits without the interpreter lock.
        """
        with self._lock:
            if self._probe_warmed or not any(
                isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in example_inputs
            ):
                return
            self._probe_warmed = True

        def pick() -> None:
            from torch._inductor import cpu_vec_isa

            try:
                cpu_vec_isa.pick_vec_isa()
            except Exception:  # the switch picks it itself
                log.debug("recipecache: background ISA pick failed", exc_info=True)

        threading.Thread(target=pick, name="recipecache-isa", daemon=True).start()

    def graph(
        self, deferred: Deferred, reload: Callable[[], Any], gm: torch.fx.GraphModule, example_inputs: list[Any]
    ) -> NoStallGraph:
        """The switching callable ``_compile_fx_inner`` returns for the deferred graph."""
        self._row(deferred.key, deferred.what)
        return NoStallGraph(self, deferred, reload, gm, example_inputs)

    def _row(self, key: str, what: tuple[str, str]) -> _Graph:
        """The report's row of graph ``key`` (``what``: its name and input shapes), made at its first sight."""
        with self._lock:
            return self.graphs.setdefault(key, _Graph(key, *what))

    def snapshot(self) -> dict[str, Any]:
        """Per graph key, what no-stall did with it in this process (the metrics' ``behind.graphs``)."""
        with self._lock:
            return {key: graph.as_json() for key, graph in self.graphs.items()}

    # -- background compiles -------------------------------------------------------
    def _submit(self, flight: Flight, wire: bytes, state: dict[str, Any]) -> Future[float]:
        # sent on the worker's stdin, never written to disk: the settings hold the store's secret
        payload = pickle.dumps(
            {
                "settings": self.store.settings,
                "key": flight.key,
                "wire": wire,
                "state": state,
                "sys_path": list(sys.path),
            }
        )
        job = _Job(flight.key, payload, flight)
        self.store.events.record("compile_start", flight.key, behind=True)
        with self._lock:
            self._jobs[flight.key] = job
            job.future = future = self._pool.submit(lambda: self._run(job))
            self._futures.append(future)
        return future

    def _run(self, job: _Job) -> float:
        """Run one worker to its end; the compile's seconds, or raise why it failed (counted). Always frees the lease."""
        graph = self.graphs[job.key]
        try:
            seconds = self._work(job)
        except Exception as exc:
            if job.cancelled:  # ended by finish(), past the exit grace: not a failure of the compile
                self._unfinished(job, "it was still compiling")
                raise
            self._compile_failed(job.key, exc)
            reason = Reason.NO_STALL_TIMEOUT if isinstance(exc, CompileTimeout) else Reason.NO_STALL_FAILED
            self._failed(job.key, (graph.name, graph.shapes), f"the compile behind failed ({exc})", reason)
            raise
        finally:
            self._drop(job)
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

    def _work(self, job: _Job) -> float:
        """Have this process's worker compile ``job`` (starting one if none runs); its seconds, or raise why not."""
        deadline = time.monotonic() + self.compile_timeout  # one deadline, a retry in a fresh worker included
        result = self._worker_for(job).compile(job.payload, self.compile_timeout)
        if result.get("stale_worker"):  # an earlier job's state stuck in the kept worker: again in a fresh one
            result = self._worker_for(job, fresh=True).compile(job.payload, max(deadline - time.monotonic(), 0.0))
        if result.get("error"):
            raise WorkerFailed(
                result["error"], inline=bool(result.get("inline")), key_mismatch=bool(result.get("key_mismatch"))
            )
        for reason in result.get("unpublished", ()):
            self.metrics.fallback(
                Reason(reason),
                f"the no-stall worker compiled {job.key} but could not publish it; "
                "this process loads it from torch's local cache, other processes compile it again",
            )
        return float(result["compile_s"])

    def _worker_for(self, job: _Job, *, fresh: bool = False) -> _Worker:
        """The worker to compile ``job``: the kept one if it lives (and not ``fresh``), else a new one."""
        with self._lock:  # never a new worker once finish() has cancelled the jobs
            if job.cancelled:
                raise RuntimeError("the process was exiting")
            started = fresh or self._worker is None or not self._worker.alive()
            if started:
                if self._worker is not None:
                    self._worker.close(0.0)
                self._worker = _Worker()
            worker = self._worker
        if started:
            self.metrics.no_stall(workers=1)  # not under our lock: a metrics flush reads our snapshot
        return worker  # type: ignore[return-value]  # made above if there was none

    def _drop(self, job: _Job) -> None:
        """A job ended (or was cancelled before it began): free its lease, so another process may compile the graph."""
        job.flight.release()
        with self._lock:
            self._jobs.pop(job.key, None)

    def _failed(
        self,
        key: str,
        what: tuple[str, str],
        why: str,
        reason: Reason = Reason.NO_STALL_FAILED,
        *,
        inline: bool = False,
    ) -> None:
        """Count and say why graph ``key`` is not compiled behind the steps; ``inline``: this process compiles it
        now instead (the others run it without inductor until it is published), else it runs without inductor."""
        self._row(key, what).failed = why
        self.metrics.no_stall(failed=1)
        outcome = (
            "this process compiles it inline; the others run it without inductor until it is published"
            if inline
            else "it runs without inductor"
        )
        self.metrics.fallback(reason, f"{what[0]} {what[1]} ({key}): {why}; {outcome}")

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
        with self._lock:
            jobs = list(self._jobs.values())
            for job in jobs:
                job.cancelled = True
            worker = self._worker
        if jobs:
            log.warning(
                "recipecache: ending the compile(s) behind of %s: past the exit grace",
                ", ".join(job.key for job in jobs),
            )
        for job in jobs:
            if job.future is not None and job.future.cancel():
                self._unfinished(job, "it was still queued")
                self._drop(job)
        if jobs and worker is not None:
            worker.kill()
        for job in jobs:
            if job.future is not None:
                with contextlib.suppress(Exception):
                    job.future.result(timeout=KILLED_JOB_WAIT_S)
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def close(self) -> None:
        """End every worker at once (disable)."""
        self.finish(0.0)


def _wait_s(deadline: float) -> float:
    """Seconds from now to ``deadline`` (``time.monotonic()``), as a wait's timeout: never negative, never
    past what a lock's wait takes (``threading.TIMEOUT_MAX``: an exit grace of 1e10 s would overflow it)."""
    return min(max(deadline - time.monotonic(), 0.0), threading.TIMEOUT_MAX)


class NoStallGraph:
    """Inductor's output for one graph while it compiles elsewhere: eager until the compiled graph exists.

    Boxed calling convention (``_boxed_call``), like the ``OutputCode`` it stands for; an
    instance attribute, since torch wraps the backward's callable (``functools.wraps`` copies
    the instance's ``__dict__``, not its class's). It carries no ``_fx_graph_cache_key``, so
    AOTAutograd does not save an entry pointing at it; the next process finds the graph's FX
    entry through its own trace.
    """

    def __init__(
        self,
        no_stall: NoStall,
        deferred: Deferred,
        reload: Callable[[], Any],
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
    ) -> None:
        from torch._inductor.codecache import FxGraphCache
        from torch.fx._lazy_graph_module import _LazyGraphModule

        self._boxed_call = True
        self._no_stall = no_stall
        self._key = deferred.key
        self._what = deferred.what
        self._reload = reload
        #: the first attempt, whose inductor config and tracing context the load runs under
        self._deferred = deferred
        self._job = deferred.job
        self._next_poll = time.monotonic() + POLL_S
        #: when this process last looked the graph up again, and whether it saw another one compile it since
        self._looked = time.monotonic()
        self._saw_lease = False
        self._lock = threading.Lock()
        self._compiled: Callable[[list[Any]], Any] | None = None
        #: our own compile published the graph, yet it did not load (or the process is exiting): eager for good
        self._given_up = False
        _LazyGraphModule.force_recompile(gm)  # as torch's own eager output of an empty graph
        self._eager = gm.forward
        # the inputs the FX cache's guards speak of (torch's ``_filter_backed_symints``), by position
        symints = FxGraphCache._filter_backed_symints(example_inputs)
        self._symint_positions = [i for i, x in enumerate(example_inputs) if any(x is s for s in symints)]
        self._shape_env = symints[0].node.shape_env if symints else None
        #: the compiled graph's guards (``guards_expr``), set at the switch; None: it accepts every input
        self._guards: str | None = None
        #: the same, compiled once: ``eval`` of the text would compile it at every call (~7x slower)
        self._guards_code: Any = None

    def __call__(self, args: list[Any]) -> Any:
        compiled = self._compiled
        if compiled is None and not self._given_up and self._due():
            compiled = self._switch()
        if compiled is not None:
            if self._accepts(args):
                return compiled(args)
            return self._rejected(args)
        start = time.perf_counter()
        out = self._eager(*args)
        seconds = time.perf_counter() - start
        self._no_stall.store.events.record("eager", self._key, seconds)
        self._no_stall.metrics.no_stall(eager_calls=1, eager_s=seconds)
        with self._no_stall._lock:
            graph = self._no_stall.graphs[self._key]
            graph.eager_calls += 1
            graph.eager_s += seconds
        return out

    def _accepts(self, args: list[Any]) -> bool:
        """Whether the compiled graph's guards accept these inputs.

        Inductor adds guards to the shape environment while it compiles (a lowering that
        specializes a dynamic size: ``Eq(s0, 32)``); inline, they join dynamo's guards, so an
        input they reject recompiles. Compiled behind, they stay in the worker's shape
        environment, and dynamo's guards were built without them: the FX cache's
        ``guards_expr`` of the loaded graph holds them, evaluated here on the call's sizes.
        """
        if self._guards_code is None or self._shape_env is None:
            return True
        values = [args[i] for i in self._symint_positions]
        return bool(self._shape_env.evaluate_guards_expression(self._guards_code, values))

    def _rejected(self, args: list[Any]) -> Any:
        """A call the compiled graph's guards reject: run it without inductor (right, if slower), counted."""
        no_stall = self._no_stall
        no_stall.metrics.no_stall(guard_rejected=1)
        with no_stall._lock:
            graph = no_stall.graphs[self._key]
            graph.guard_rejected += 1
            first = graph.guard_rejected == 1
        if first:
            log.warning(
                "recipecache: %s %s: inductor specialized the graph compiled behind (%s); inputs it rejects "
                "run without inductor",
                *self._what,
                self._guards,
            )
        return self._eager(*args)

    def _due(self) -> bool:
        """Whether to try the switch now: our job ended; or (looked at every POLL_S) the key's lease is gone and the
        artifact may be there or ours to make: another process's compile just ended, this process may lead the
        graph, or it last looked the graph up RETRY_S ago."""
        if self._job is not None:
            return self._job.done()
        now = time.monotonic()
        if now < self._next_poll:
            return False
        self._next_poll = now + POLL_S
        no_stall = self._no_stall
        if no_stall.store.compiling(self._key):
            self._saw_lease = True
            return False
        no_stall.looked_after_failure(self._key)
        saw_lease, self._saw_lease = self._saw_lease, False
        if saw_lease or no_stall.may_lead(self._key) or now >= self._looked + RETRY_S:
            self._looked = now
            return True
        return False

    def _switch(self) -> Callable[[list[Any]], Any] | None:
        with self._lock:
            if self._compiled is not None or self._given_up:
                return self._compiled
            no_stall = self._no_stall
            job, self._job = self._job, None
            if job is not None:
                if job.cancelled():  # the process is exiting
                    self._given_up = True
                    return None
                if job.exception() is not None:  # counted by the job: eager until a process publishes the graph
                    self._looked = time.monotonic()
                    return None
            start = time.perf_counter()
            try:
                compiled = self._load()
            except Exception as exc:  # noqa: BLE001 - Deferred included: see below
                deferred = deferred_of(exc)
                if deferred is None or job is not None:
                    # our own compile published it, yet loading missed or raised: do not try again
                    self._given_up = True
                    why = "its artifact was not found after the compile" if deferred is not None else repr(exc)
                    no_stall._failed(self._key, self._what, f"cannot load the compiled graph ({why})")
                    return None
                # not there yet (the holder failed, or its lease expired): we lead now, or wait for the new holder
                self._job = deferred.job
                return None
            seconds = time.perf_counter() - start
            self._guards = getattr(compiled, "guards_expr", None) or None
            self._guards_code = None if self._guards is None else compile(self._guards, "<inductor guards>", "eval")
            self._compiled = compiled
            no_stall.store.events.record("switch", self._key, seconds)
            no_stall.metrics.no_stall(switches=1)
            with no_stall._lock:
                graph = no_stall.graphs[self._key]
                graph.switched_at, graph.switch_s = time.time(), seconds
            log.info("recipecache: %s %s now runs compiled (switch took %.3f s)", *self._what, seconds)
            return compiled

    def _load(self) -> Callable[[list[Any]], Any]:
        """torch's ``_compile_fx_inner`` again, in the context of the first attempt (:func:`..deferral.reload`)."""
        return deferral.reload(self._deferred, self._reload)
