"""The torch side (2.13, 2.14): where recipecache plugs into torch.compile, and how it unplugs.

Line numbers and the reasons behind each hook are in docs/torch-integration-notes.md.
In short:

* torch's remote caches (FX graph, AOTAutograd, PGO, Triton autotuning) accept a backend class through
  ``RemoteCache.backend_override_cls``; ours talk to the store. Graphs are where
  single-flight happens: torch splits a compile into lookup (miss) ... ``put``, so a
  miss opens a :class:`~recipecache.store.Flight` (one process per key compiles, the
  others wait for its artifact) and the put merges the new graph into the key's entry
  and ends the flight.
* A graph key holds all its dynamic-shape guard variants (bounded), and torch's remote
  lookup reads only one entry per key, so ``FxGraphCache.iterate_over_candidates`` is
  wrapped: after torch's local candidates it offers every stored variant to torch's own
  guard evaluation (:meth:`Integration.fx_candidates`).
* Keys of artifacts holding compiled CPU code (graphs, AOTAutograd, ISA probes) carry the
  host-CPU fingerprint (:mod:`..host_cpu`): torch's own keys do not describe the CPU its
  ``-march=native`` kernels need.
* ``codecache.write`` is wrapped to learn which ``<hash>.main.so`` kernels the current
  graph loads (they are not in torch's entry), and ``VecISA.check_build`` to learn the
  CPU-feature probe libraries every fresh process would otherwise build with g++ (and,
  on a cold job, to share them between ranks as they are built; ``valid_vec_isa_list``
  to let each rank start probing at its own share of the list): :mod:`.isa_probes`.
* ``codecache._precompile_header`` is skipped for a kernel whose ``.so`` is already
  there (a hit installed it): torch builds the precompiled header (a ``g++ -E`` of the
  ATen headers, then a 150 MB ``.gch`` in ``$TMPDIR``) before it looks for the kernel's
  library, so without this a hit on a fresh node would pay seconds for a header nothing
  compiles against. The kernel's key was computed before the header is attached, so
  the skip changes no key; a compile still gets torch's fast precompiled-header build.
* ``codecache.compiled_fx_graph_hash`` is wrapped to record what each FX key is made of
  (:mod:`recipecache.runs.keyinfo`, for ``recipecache explain``) and what the graph is (its
  function and input shapes, the ``meta`` of the artifact it publishes).
* ``compile_fx.fx_codegen_and_compile`` is wrapped to count and time the graphs inductor
  actually compiles here; ``compile_fx._compile_fx_inner`` bounds one graph's compile, so
  a lease whose put never comes (the compile raised, the graph could not be pickled) is
  released when that compile ends rather than when its TTL runs out.
* Overlap: a graph whose lease another process holds is not waited for in torch's compile; a
  :class:`WaitingGraph` stands for it and waits at its first call, so this process goes on to
  compile the next graph (a forward's backward, with the output strides the forward's leader
  published once it lowered the graph) while the other one compiles the first.

Every hook runs the original torch code first or around it and swallows its own
failures (counted as fallback ``hook_error``): the cache may fail, training may not.
Which hooks are installed is :mod:`..compat`'s call: those whose torch interface is there;
the patch table that installs them, and the backend classes torch builds, are :mod:`..patches`.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch._functorch.config as functorch_config
from torch._inductor.runtime.runtime_utils import cache_dir

from ...errors import ConfigError
from ...keylog import KeyLog
from ...reasons import Reason, Role
from ...store import Flight, Store
from .. import deferral, describe, host_cpu, rank_binding
from ..artifact import Artifact, ArtifactError, Entry, collect, install, torch_pickle
from ..metrics import Metrics
from ..torch_settings import outside_torch_keys
from . import output_strides, pgo
from .isa_probes import IsaProbes

if TYPE_CHECKING:
    from ..no_stall.controller import NoStall

log = logging.getLogger(__name__)

#: prefix of every store key written here; bumping it retires all artifacts of an older format
KEY_PREFIX = "torch3:"
#: how many times one graph lookup waits for another process's new guard variant before
#: compiling its own without a lease (each wait needs the key to have changed meanwhile)
VARIANT_WAITS = 4
#: nice value of speculative background builds (a precompiled header a later compile may need): idle CPU only
BACKGROUND_NICE = 19
#: what ``recipecache ls`` calls each artifact kind (the ``kind`` of its envelope meta)
KIND_NAMES = {
    "fx": "graph",
    "aot": "aot",
    "pgo": "pgo",
    "isa": "cpu_probe",
    "autotune": "autotune",
    "strides": "output_strides",
}

R = TypeVar("R")

#: what torch writes between a kernel's source and its header build (the optional
#: optimized source, the header stub itself): still the same kernel
_SAME_KERNEL_WRITES = frozenset({"optimized.cpp", "h"})


class _Attempt(threading.local):
    """This thread's current FX graph, from torch's remote lookup to its put or the end of its compile."""

    def __init__(self) -> None:
        self.key: str | None = None
        #: the lease this thread holds for ``key`` (leader) or its lease-less local compile (fallback)
        self.flight: Flight | None = None
        #: the producer's compile seconds of the entry we served, until torch accepts it
        self.served_s: float | None = None
        #: the store counted this lookup a hit (``kind="fx"``) that is not yet known to be unused
        self.hit_counted = False
        self.compile_s = 0.0
        #: kernel libraries the graph loaded since the lookup (absolute paths)
        self.kernels: set[str] = set()
        #: the library of the kernel torch is loading on this thread (its source was the last
        #: one written): what a precompiled header would be built for
        self.loading_kernel: str | None = None
        #: every kernel library loaded on this thread while a precompiled function is built
        #: (:meth:`Integration.kernels_loaded`); outlives the graph attempts inside the build
        self.build_kernels: set[str] | None = None
        #: torch's FX key this thread computed last, its hash-detail lines, function name and
        #: input shapes; outlives end_attempt(), which runs between the key's computation
        #: and its lookup (fx_get takes it)
        self.described: tuple[str, list[str], str, str] | None = None
        #: the rank binding of the graph ``key`` names (:mod:`..rank_binding`), if its key is shared across ranks
        self.binding: rank_binding.Binding | None = None
        #: what ``key`` is (function name, input shapes), for the meta of its artifact
        self.what: tuple[str, str] = ("graph", "")
        #: overlap: this thread's compile may leave a graph another process compiles for its first call (set
        #: around torch's ``_compile_fx_inner``, not around the reload of such a graph; outlives end_attempt())
        self.deferrable = False
        #: overlap: the lease of the output strides of the forward this thread leads, published once lowered
        self.strides_flight: Flight | None = None
        #: overlap: the tracing context of the forward this thread last left for its first call, until AOTAutograd's
        #: backward stage of that compile asks (:meth:`Integration.backward_now`); outlives end_attempt()
        self.deferred_forward: Any = None


class Integration:
    """One enabled store: the state the hooks share (torch builds backends with no arguments)."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        wait_timeout: float | None,
        *,
        no_stall: NoStall | None = None,
        wait_for_lease: bool = True,
    ) -> None:
        #: graph artifacts (FX) are single-flighted and traced in the event log (the simulator
        #: replays it as the job's compile keys); AOTAutograd, PGO and probe entries are not
        #: compiles, so their lookups and puts stay out of the trace (``trace=False``)
        self.store = store
        self.metrics = metrics
        self.wait_timeout = wait_timeout
        #: no-stall's background compiles (:mod:`..no_stall.controller`), when enabled: a graph that missed is deferred to them
        self.no_stall = no_stall
        #: False: a graph whose lease another process holds is not waited for (role ``busy``): no-stall
        #: ranks run it eagerly meanwhile (:attr:`no_stall`), a no-stall worker (``wait_for_lease=False``,
        #: no :attr:`no_stall` of its own) compiles it for that holder
        self.wait_for_lease = wait_for_lease and no_stall is None
        #: overlap (set at install, where its hooks are on): a graph whose lease another process holds is waited
        #: for at its first call, not in the compile, so this process goes on to lead the next graph meanwhile
        #: (:meth:`defer`, :class:`WaitingGraph`)
        self.overlap = False
        #: the store key of the graph this process looked up last (the no-stall worker reports it)
        self.last_key: str | None = None
        #: this host's CPU fingerprint, in the key of every artifact holding compiled CPU code
        #: (:mod:`..host_cpu`; ConfigError for a malformed override)
        self.cpu = host_cpu.fingerprint()
        self.attempt = _Attempt()
        self._lock = threading.Lock()
        self._flights: dict[int, Flight] = {}
        #: this process has waited for another one's compile: a cold job, in which it may
        #: compile a later graph itself (see :meth:`warm_header`)
        self._followed = False
        #: precompiled headers being built (or built) in the background, by their arguments
        self._warm_headers: set[tuple[Any, ...]] = set()
        #: the hooks installed (:data:`..compat.HOOKS` whose interface this torch has)
        self.on: frozenset[str] = frozenset()
        self.keys = KeyLog.beside(store.events)
        #: torch's FX key -> the rank binding that shares it across ranks (:mod:`..rank_binding`), for the graphs
        #: that use this rank's process groups; torch's keys of these graphs name this rank's groups
        self._bindings: dict[str, rank_binding.Binding] = {}
        #: torch's FX keys of graphs that use this rank's groups and stay keyed per rank -> their identity
        #: across ranks (:attr:`..rank_binding.RankBound.identity`), for the key records
        self._rank_bound: dict[str, str | None] = {}
        #: the CPU-feature probe libraries, shared as artifacts of kind ``isa``
        self.probes = IsaProbes(
            store,
            metrics,
            wait_timeout,
            cpu_key=self.cpu_key,
            fetch=self.fetch,
            take=self._take,
            put=self._put,
            guarded=self.guarded,
        )

    def guarded(self, fn: Callable[..., R], *args: Any) -> R | None:
        """``fn(*args)``, or None with a counted ``hook_error`` if it raises: our bugs must not stop a compile."""
        try:
            return fn(*args)
        except Exception as exc:
            log.debug("recipecache hook %s failed", getattr(fn, "__name__", fn), exc_info=True)
            self.metrics.fallback(
                Reason.HOOK_ERROR, f"{getattr(fn, '__name__', fn)}: {exc!r}; torch goes on without it"
            )
            return None

    # -- keys ------------------------------------------------------------------------
    def cpu_key(self, torch_key: str) -> str:
        """Store key of an artifact that holds or names compiled CPU code: it carries the host-CPU fingerprint."""
        return f"{KEY_PREFIX}cpu-{self.cpu}:{torch_key}"

    def compile_key(self, torch_key: str) -> str:
        """Store key of a graph or AOTAutograd entry torch names ``torch_key``: :meth:`cpu_key` with the settings
        the compile reads that torch's key does not hash (:func:`..torch_settings.outside_torch_keys`, e.g.
        ``torch.fx.experimental._config.backed_size_oblivious``), so a process never gets a graph compiled
        under another value of them."""
        return self.cpu_key(f"settings-{outside_torch_keys()}:{torch_key}")

    def graph_key(self, torch_key: str) -> tuple[str, rank_binding.Binding | None]:
        """Store key of the graph torch names ``torch_key`` (``pt2:fx-graph-v1::<FX key>:c1``), and its rank binding.

        A graph that uses this rank's process groups is stored under its rank-independent
        key (:func:`..rank_binding.bind`), so every rank with a group of the same role shares it.
        """
        with self._lock:
            bindings = list(self._bindings.items())
        for fx_key, binding in bindings:
            if fx_key in torch_key:
                return self.compile_key(torch_key.replace(fx_key, binding.key)), binding
        return self.compile_key(torch_key), None

    # -- lookups ---------------------------------------------------------------------
    def fetch(self, kind: str, key: str) -> Artifact | None:
        """The (non-graph) artifact under ``key`` with its kernels installed, or None (counted by reason).

        PGO state is rewritten in place (:meth:`Store.update`), so it is never read from a node copy.
        """
        found = self.store.lookup(key, trace=False, node=kind != "pgo", kind=kind)
        if found.failed:
            assert found.reason is not None  # a failed lookup names its failure
            self.metrics.fallback(found.reason, f"store {self.store.url} did not answer; compiling locally")
        return self._take(kind, key, found.data)

    def _take(self, kind: str, key: str, data: memoryview | None) -> Artifact | None:
        """The artifact in ``data`` (what the store had under ``key``, an untraced lookup of ``kind``) with its
        kernels installed, or None; a hit it cannot use is counted as a miss."""
        if data is None:  # the store counted the miss
            self.metrics.changed()
            return None
        artifact = self._unpack(key, data, kind)
        if artifact is None or not self._install(key, artifact, artifact.entries[0]):
            self.store.record_unused_hit(
                key, Reason.BAD_ARTIFACT if artifact is None else Reason.INSTALL_FAILED, kind=kind, trace=False
            )
            self.metrics.changed()
            return None
        self.metrics.saved(artifact.entries[0].compile_s)
        return artifact

    def _unpack(self, key: str, data: memoryview, kind: str) -> Artifact | None:
        try:
            return Artifact.unpack(data, kind)
        except ArtifactError as exc:
            self.metrics.fallback(Reason.BAD_ARTIFACT, f"{key}: {exc}; compiling locally")
            return None

    def _install(self, key: str, artifact: Artifact, entry: Entry) -> bool:
        """Install the kernels ``entry`` loads into torch's cache dir; False (counted ``install_failed``) if refused or failed."""
        try:
            installed = install(artifact.files_of(entry), Path(cache_dir()))
        except (OSError, ConfigError) as exc:
            self.metrics.fallback(Reason.INSTALL_FAILED, f"{key}: {exc}; not installing its kernels, compiling locally")
            return False
        if installed:
            self.metrics.kernels(installed=installed)
        return True

    def _hold(self, flight: Flight) -> None:
        """This thread compiles the graph of ``flight`` (leader, or lease-less fallback); :meth:`fx_put` publishes."""
        self.attempt.flight = flight
        with self._lock:
            self._flights[id(flight)] = flight

    def _close_flight(self, flight: Flight) -> None:
        """Release ``flight``'s lease (if any) and forget it."""
        with self._lock:
            self._flights.pop(id(flight), None)
        flight.release()

    def _put(self, kind: str, key: str, blob: bytes, flight: Flight | None = None) -> None:
        """Publish an AOTAutograd or probe artifact (written once per key, so a plain put, or through the
        untraced ``flight`` that leads it); kept out of the trace."""
        meta = {"kind": KIND_NAMES[kind]}
        if flight is not None:
            flight.publish(blob, meta=meta)  # counted under the flight's kind
        else:
            self.store.put(key, blob, trace=False, meta=meta, kind=kind)
        self.metrics.changed()

    def end_attempt(self) -> None:
        """The thread's graph compile is over (or a new one starts): free its lease, reset its record."""
        attempt = self.attempt
        if attempt.flight is not None:
            flight, attempt.flight = attempt.flight, None
            self._close_flight(flight)
        if attempt.strides_flight is not None:
            flight, attempt.strides_flight = attempt.strides_flight, None
            self._close_flight(flight)
        attempt.key = None
        attempt.binding = None
        attempt.what = ("graph", "")
        attempt.served_s = None
        attempt.hit_counted = False
        attempt.compile_s = 0.0
        attempt.kernels.clear()

    def release_all(self) -> None:
        """Free every lease any thread still holds (disable, interpreter exit)."""
        with self._lock:
            flights = list(self._flights.values())
            self._flights.clear()
        for flight in flights:
            flight.release()

    # -- the three torch caches ----------------------------------------------------
    def fx_candidates(self, torch_key: str) -> Iterator[tuple[Any, bytes, bool]]:
        """The stored guard variants of one graph, one at a time, for torch's own guard evaluation.

        Stands in for the remote part of ``FxGraphCache.iterate_over_candidates`` (torch
        evaluates each candidate's guards and stops at the first that accepts its inputs),
        yielding what torch's remote branch yields: ``(graph, pickled graph, False)``. A
        variant's kernels are installed just before it is offered. Torch accepting one
        closes this generator at its ``yield``: a hit. Exhausting it is a miss: when torch
        rejected every stored variant, :meth:`Store.begin` with ``stale`` makes this
        process the compiler of the key's next variant, or has it wait for the process
        already compiling one and offers that one too. A leader's lease is held in
        :attr:`attempt` until :meth:`fx_put` merges the new variant in.
        """
        self.end_attempt()
        key, binding = self.graph_key(torch_key)
        attempt = self.attempt
        attempt.key = self.last_key = key
        attempt.binding = binding
        self.guarded(self.record_key, torch_key)
        try:
            yield from self._offer_variants(key)
        except GeneratorExit:  # torch's guards accepted the variant it was evaluating: the store counted the hit
            self.metrics.saved(attempt.served_s or 0.0)
            raise
        except Exception as exc:  # our failure: torch compiles as on a miss
            log.debug("recipecache: offering variants of %s failed", key, exc_info=True)
            self.metrics.fallback(Reason.HOOK_ERROR, f"fx_candidates: {exc!r}; torch goes on without it")
            self._unused_hit(key, Reason.HOOK_ERROR)
        self.metrics.changed()  # a miss, which the store counted

    def _unused_hit(self, key: str, reason: Reason | None, *, trace: bool = True) -> None:
        """The graph lookup of this thread's attempt will not use what it was served: if the store counted a hit,
        it becomes a miss for ``reason`` (once per lookup; ``trace=False`` where ``begin(stale=...)`` traced it)."""
        attempt = self.attempt
        if attempt.hit_counted and reason is not None:
            attempt.hit_counted = False
            self.store.record_unused_hit(key, reason, kind="fx", trace=trace)

    def _offer_variants(self, key: str) -> Iterator[tuple[Any, bytes, bool]]:
        attempt = self.attempt
        offered: set[bytes] = set()
        install_failed = False
        if self.wait_for_lease:  # a cold job's waiting ranks probe the CPU beside the rank that compiles
            self.guarded(self.probes.probe_while_waiting, lambda: self.store.compiling(key))
        overlap = self.overlap and attempt.deferrable and attempt.build_kernels is None
        flight = self.store.begin(
            key, wait_timeout=self.wait_timeout, kind="fx", wait=self.wait_for_lease and not overlap
        )
        attempt.hit_counted = flight.data is not None
        if overlap and flight.role is Role.LEADER:
            self.store.events.record("compile_start", key)  # the store records it only for a lookup that may wait
            if _output_strides_wanted():
                self._lead_strides(key)
        for waits in itertools.count():
            if flight.waited_s:
                self._followed = True
                self.metrics.changed()
            if flight.data is None:  # we compile it (leader, or unleased after a failure or timeout)
                # after begin(stale=...): the first lookup's hit was not used (the stale begin traced the miss)
                self._unused_hit(key, flight.miss_reason, trace=False)
                self._hold(flight)
                return
            artifact = self._unpack(key, flight.data, "fx")
            for entry in artifact.entries if artifact is not None else ():
                if entry.data in offered:
                    continue
                offered.add(entry.data)
                if not self._install(key, artifact, entry):  # type: ignore[arg-type]  # entries only when there is an artifact
                    install_failed = True
                    continue
                try:
                    content = torch_pickle(entry.data)
                    graph = pickle.loads(content)  # noqa: S301 - verified bytes, unpickled as torch's own remote branch does
                except Exception:  # torch skips an entry it cannot load, and so do we
                    log.warning("recipecache: cannot load a stored variant of %s; skipping it", key, exc_info=True)
                    continue
                if attempt.binding is not None:
                    try:  # the stored code names placeholders: this rank's own groups take their place
                        content = rank_binding.rebind_graph(graph, attempt.binding.groups)
                    except rank_binding.RankBound as exc:
                        self.metrics.fallback(Reason.RANK_BOUND, f"{key}: {exc}; compiling locally")
                        install_failed = True  # compile it here, unleased, as for a variant we cannot use
                        continue
                attempt.served_s = entry.compile_s
                yield graph, content, False
                attempt.served_s = None  # resumed: its guards rejected these inputs
            reason = Reason.BAD_ARTIFACT if artifact is None else Reason.GUARD_REJECTED
            if install_failed or waits == VARIANT_WAITS:
                # a variant we could not install may be the one we need: compile it here, unleased
                # (its put replaces the stored twin with the same guards), or stop waiting
                self._unused_hit(key, reason)
                return
            flight = self.store.begin(
                key,
                wait_timeout=self.wait_timeout,
                stale=flight.data,
                stale_reason=reason,
                kind="fx",
                wait=self.wait_for_lease,
            )

    def defer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Exception | None:
        """torch is about to compile the graph this thread looked up and missed; the
        :class:`~..deferral.Deferred` to raise instead, or None to compile it here. No-stall:
        :meth:`..no_stall.controller.NoStall.intercept`; overlap: another process holds the lease (:meth:`_overlap`).

        A no-stall leader's lease goes with its background compile (released when that ends), not with this attempt.
        A precompiled tier's build (``attempt.build_kernels`` set) is never deferred, as overlap leaves it:
        torch's ``aot_compile`` bundles the compiled graph itself into the artifact, and a stand-in fails its build
        (``precompile_failed`` on every function with ``--precompile --no-stall``, issue 43's corpus).
        """
        attempt = self.attempt
        flight = attempt.flight if attempt.key is not None else None
        if attempt.build_kernels is not None:
            return None
        if self.no_stall is not None:
            deferred = self.no_stall.intercept(flight, attempt.what, args, kwargs)
        elif flight is not None and flight.role is Role.BUSY:
            deferred = self._overlap(flight, args[0], args[1])
        else:
            return None
        if deferred is not None and flight is not None:
            with self._lock:
                self._flights.pop(id(flight), None)
            attempt.flight = None
        return deferred

    def _overlap(self, flight: Flight, gm: Any, example_inputs: list[Any]) -> deferral.Deferred:
        """Another process compiles this graph: wait for it at the graph's first call (:class:`WaitingGraph`).

        A forward's compile reports its output strides to AOTAutograd, which compiles the backward
        for saved activations of those strides (inductor may lay them out otherwise than eager):
        the backward's code and key depend on them. So for a forward this waits for the strides
        its leader publishes once inductor lowered the graph (seconds, before its kernels are
        built: :meth:`lowered`) and reports them as torch's own load would, once they passed
        :func:`.output_strides.check` (torch evaluates them: they are code). Without them (the
        leader died or gave up before, the record was refused) the Deferred says to wait now:
        the compile waits for the graph itself, as without overlap.
        """
        deferred = deferral.Deferred.here(flight.key, self.attempt.what)
        if not _output_strides_wanted():
            return deferred
        strides = self._leader_strides(flight.key, gm, example_inputs)
        if strides is None:
            deferred.later = False
            return deferred
        from types import SimpleNamespace

        from torch._inductor.utils import set_tracing_context_output_strides

        set_tracing_context_output_strides(example_inputs, SimpleNamespace(output_strides=strides))
        self.attempt.deferred_forward = deferred.context
        return deferred

    def backward_now(self) -> bool:
        """Whether AOTAutograd should compile the backward of the graph it is compiling now rather than at its first
        call: its forward was left for its first call here (:meth:`_overlap`). torch compiles a backward lazily,
        at its first call, after the forward ran; the forward being another process's compile, this one compiles
        the backward meanwhile. Asked once per backward stage."""
        import torch

        context, self.attempt.deferred_forward = self.attempt.deferred_forward, None
        return context is not None and context is torch._guards.TracingContext.try_get()

    def _lead_strides(self, key: str) -> None:
        """This thread leads forward ``key``'s compile: take the lease of its output strides, which
        :meth:`lowered` publishes (a process that finds the forward busy waits on it, :meth:`_leader_strides`)."""
        flight = self.store.begin(_strides_key(key), wait=False, trace=False, kind="strides")
        if flight.role is Role.LEADER:
            self.attempt.strides_flight = flight
            with self._lock:
                self._flights[id(flight)] = flight
        else:  # published already (an earlier job, the same graph), or another process leads it: nothing to do
            flight.release()

    def _leader_strides(self, key: str, gm: Any, example_inputs: list[Any]) -> output_strides.Strides | None:
        """The output strides of forward ``key`` (FX graph ``gm`` on ``example_inputs``) as its leader published them
        (torch's strings), or None: counted where the store counts it (its wait timed out or failed; or we became its
        leader: the forward's leader has not taken it, which this process does not wait for), or as a fallback here
        (a record that does not fit this graph, a hit the store counted turned into a miss)."""
        flight = self.store.begin(_strides_key(key), wait_timeout=self.wait_timeout, trace=False, kind="strides")
        data = flight.data
        flight.release()
        if data is None:
            return None
        strides = output_strides.check(bytes(data), key, output_strides.graph_outputs(gm), example_inputs)
        if isinstance(strides, str):
            self.store.record_unused_hit(_strides_key(key), Reason.BAD_ARTIFACT, kind="strides", trace=False)
            self.metrics.fallback(
                Reason.BAD_ARTIFACT, f"{key}: output strides refused ({strides}); waiting for the graph"
            )
            return None
        return strides

    def lowered(self, graph: Any) -> None:
        """Inductor lowered the graph this thread leads (its kernels are not built yet): publish its output strides
        if another process may wait for them (:meth:`_overlap`), as torch computes them for its compiled graph."""
        attempt = self.attempt
        flight = attempt.strides_flight
        if flight is None:
            return
        from torch._inductor.ir import IRNode
        from torch.fx.experimental.symbolic_shapes import SymExprPrinter, free_unbacked_symbols

        printer = SymExprPrinter()
        strides = [
            [printer.doprint(s) for s in out.get_layout().stride]
            if isinstance(out, IRNode) and out.has_tensor_output() and not free_unbacked_symbols(out.get_stride())
            else None
            for out in graph.graph_outputs or ()
        ]
        attempt.strides_flight = None
        with self._lock:
            self._flights.pop(id(flight), None)
        forward = flight.key.removesuffix(STRIDES_SUFFIX)
        flight.publish(output_strides.record(forward, strides), meta={"kind": KIND_NAMES["strides"]})

    @contextmanager
    def may_defer(self, graph_kwargs: dict[str, Any]) -> Iterator[None]:
        """Overlap: the compile in this block (torch's ``_compile_fx_inner`` with ``graph_kwargs``) may leave a graph
        another process compiles to its first call. Not an inference graph: no backward follows it to compile
        meanwhile, and AOTAutograd saves its entry in the compile (it would save none for a stand-in)."""
        attempt = self.attempt
        outer, attempt.deferrable = attempt.deferrable, self.overlap and not graph_kwargs.get("is_inference", False)
        try:
            yield
        finally:
            attempt.deferrable = outer

    def waiting_graph(self, deferred: deferral.Deferred, compile_again: Callable[[], Any]) -> Any:
        """What ``_compile_fx_inner`` returns for a graph :meth:`_overlap` deferred: a :class:`WaitingGraph`, or the
        graph itself, waited for now (still inside torch's compile of it, in its context)."""
        if not deferred.later:
            return compile_again()
        return WaitingGraph(deferred, compile_again)

    def fx_put(self, torch_key: str, data: bytes) -> None:
        """Merge the graph torch compiled here into its key's variants (compare-and-set), then free the lease."""
        key, binding = self.graph_key(torch_key)
        if binding is not None:
            try:  # stored with placeholders: the bytes name no real group
                data = binding.canonical_graph(data)
            except rank_binding.RankBound as exc:
                self.metrics.fallback(Reason.RANK_BOUND, f"{key}: {exc}; published under this rank's own key")
                self._forget_binding(torch_key)
                key = self.compile_key(torch_key)
        attempt = self.attempt
        files, missing = collect(attempt.kernels, Path(cache_dir()))
        if missing:
            self.metrics.fallback(
                Reason.KERNEL_MISSING,
                f"{len(missing)} kernel(s) of {key} not built when it was saved; "
                "publishing it without them (a hit compiles those)",
            )
        ours = attempt.key == key
        compile_s = attempt.compile_s if ours else 0.0
        variant = Entry(data, compile_s, tuple(f.path for f in files), _guards_of(data))
        meta = describe.graph_meta(*(attempt.what if ours else ("graph", "")), compile_s)

        def merged(current: memoryview | None) -> bytes:
            base = Artifact("fx", ())
            if current is not None:
                with suppress(ArtifactError):  # unreadable: replaced, the new variant is the only one we can vouch for
                    base = Artifact.unpack(current, "fx")
            return base.with_variant(variant, files).pack()

        # node=True: a node copy missing this variant is safe, since begin(stale=...) reads past it
        self.store.update(key, merged, trace=True, meta=meta, node=True, kind="fx")
        if ours and attempt.flight is not None:
            flight, attempt.flight = attempt.flight, None
            self._close_flight(flight)
        self.metrics.kernels(shipped=len(files))
        self.probes.publish_isa_probe()

    def aot_get(self, torch_key: str) -> bytes | None:
        """No lease: see docs/torch-integration-notes.md ("AOTAutograd entries are not leased").

        An entry naming graphs stored under keys shared across ranks says so (:meth:`aot_put`): their FX keys,
        which this process did not compute (a hit skips the trace), are bound to those keys and to this rank's
        own process groups before torch looks the graphs up."""
        artifact = self.fetch("aot", self.compile_key(torch_key))
        if artifact is None:
            return None
        if artifact.bound:
            groups = rank_binding.process_groups()
            with self._lock:
                for fx_key, shared in artifact.bound:
                    if fx_key not in self._rank_bound:
                        self._bindings.setdefault(fx_key, rank_binding.Binding(shared, {}, groups))
        return artifact.entry

    def aot_put(self, torch_key: str, data: bytes) -> None:
        """An entry naming graphs that use this rank's process groups names them by this rank's FX keys: it
        carries the shared key each is stored under (:meth:`aot_get`). Not for an entry naming a graph keyed per
        rank (``rank_bound``): a hit would look it up under a key no rank shares, where tracing again finds it."""
        bound: list[tuple[str, str]] = []
        if self._bindings or self._rank_bound:
            content = torch_pickle(data)
            with self._lock:
                bindings = list(self._bindings.items())
                rank_bound = list(self._rank_bound)
            if any(fx_key.encode() in content for fx_key in rank_bound):
                return
            bound = [(fx_key, binding.key) for fx_key, binding in bindings if fx_key.encode() in content]
        self._put("aot", self.compile_key(torch_key), Artifact.single("aot", data, bound=bound).pack())

    def autotune_get(self, torch_key: str) -> bytes | None:
        """A Triton kernel's best config (JSON, never code); torch's key hashes the kernel's source, GPU included."""
        artifact = self.fetch("autotune", KEY_PREFIX + torch_key)
        return None if artifact is None else artifact.entry

    def autotune_put(self, torch_key: str, data: bytes) -> None:
        self._put("autotune", KEY_PREFIX + torch_key, Artifact.single("autotune", data).pack())

    def pgo_get(self, torch_key: str) -> bytes | None:
        artifact = self.fetch("pgo", KEY_PREFIX + pgo.shared_key(torch_key))
        return None if artifact is None else artifact.entry

    def pgo_put(self, torch_key: str, data: bytes) -> None:
        """Merge this rank's decisions into the shared state with a compare-and-set: concurrent ranks lose none."""
        key = KEY_PREFIX + pgo.shared_key(torch_key)
        failures: list[Exception] = []

        def merged(current: memoryview | None) -> bytes | None:
            failures.clear()
            combined: bytes | None = data
            if current is not None:
                try:
                    stored = Artifact.unpack(current, "pgo").entry
                    combined = pgo.merge(data, stored)
                    if pgo.same_decisions(combined, stored):
                        combined = None  # the store has every decision of this rank already: write nothing
                except Exception as exc:  # noqa: BLE001 - torch's pickled state may fail in any way
                    failures.append(exc)  # replaced by this rank's state, which we can read
            return None if combined is None else Artifact.single("pgo", combined).pack()

        self.store.update(key, merged, meta={"kind": KIND_NAMES["pgo"]}, kind="pgo")  # counts a put only if it wrote
        if failures:
            self.metrics.fallback(Reason.PGO_MERGE_FAILED, f"{key}: {failures[0]!r}; published this rank's state")
        self.metrics.changed()

    # -- compile bookkeeping -------------------------------------------------------
    def describe_key(self, fx_key: str, details: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """torch computed an FX key (``compiled_fx_graph_hash(gm, example_inputs, fx_kwargs, ...)``): keep its
        components and what the graph is until its lookup."""
        gm = args[0] if args else kwargs["gm"]
        example_inputs = args[1] if len(args) > 1 else kwargs["example_inputs"]
        fx_kwargs = args[2] if len(args) > 2 else kwargs["fx_kwargs"]
        inputs_to_check = args[3] if len(args) > 3 else kwargs["inputs_to_check"]
        groups = self.guarded(rank_binding.process_groups)  # once: the key records and the binding both read them
        described = None if groups is None else self.guarded(rank_binding.describe_groups, gm, example_inputs, groups)
        if described:  # what of this rank's groups the key holds, for explain (torch's lines cut the code short)
            details = [*details, *described]
        self.attempt.described = (
            fx_key,
            details,
            describe.function_name(fx_kwargs),
            describe.input_shapes(example_inputs),
        )
        if (
            "rank_binding" in self.on
            and groups is not None
            and fx_key not in self._bindings
            and fx_key not in self._rank_bound
        ):
            self.guarded(self._bind, fx_key, gm, example_inputs, fx_kwargs, inputs_to_check, groups)

    def _bind(
        self,
        fx_key: str,
        gm: Any,
        example_inputs: Any,
        fx_kwargs: Any,
        inputs_to_check: Any,
        groups: rank_binding.Groups,
    ) -> None:
        """Share the key of a graph that uses this rank's process groups across ranks, if it can be bound to
        every rank's own groups (:mod:`..rank_binding`); else it stays keyed per rank, counted."""
        try:
            binding = rank_binding.bind(gm, example_inputs, fx_kwargs, inputs_to_check, groups)
        except rank_binding.RankBound as exc:
            with self._lock:
                self._rank_bound[fx_key] = exc.identity
            self.metrics.fallback(
                Reason.RANK_BOUND,
                f"graph {fx_key[:10]} uses this rank's process groups and is "
                f"compiled by every rank that traces it, not once per job: {exc}",
            )
            return
        if binding is not None:
            with self._lock:
                self._bindings[fx_key] = binding

    def _forget_binding(self, torch_key: str) -> None:
        with self._lock:
            for fx_key in [k for k in self._bindings if k in torch_key]:
                self._rank_bound[fx_key] = self._bindings.pop(fx_key).key

    def record_key(self, torch_key: str) -> None:
        """The store is asked for ``torch_key``: record what it is made of (for ``recipecache explain``).

        torch's remote cache wraps the FX key (``pt2:fx-graph-v1::<key>:c1``), so the key
        the hash hook saw is matched by containment. It is recorded under the store key
        :meth:`fx_get` made of ``torch_key`` (``attempt.key``, shared across ranks where bound).
        """
        described, self.attempt.described = self.attempt.described, None
        if described is None or described[0] not in torch_key:
            return
        fx_key, details, name, shapes = described
        attempt = self.attempt
        attempt.what = (name, shapes)
        if self.keys.enabled and attempt.key is not None:  # parsing torch's hash details costs a few ms per lookup
            identity = attempt.binding.key if attempt.binding is not None else self._rank_bound.get(fx_key)
            self.keys.record(
                attempt.key,
                details,
                name=name,
                shapes=shapes,
                identity=identity,
                context={**describe.process_context(), "cpu_key": self.cpu},
            )

    def compiled(self, seconds: float) -> None:
        """inductor codegen of one graph ran here for ``seconds``."""
        attempt = self.attempt
        attempt.compile_s += seconds
        if attempt.served_s is not None and attempt.key is not None:  # torch's guards rejected the entry we served
            self._unused_hit(attempt.key, Reason.GUARD_REJECTED)
            self.metrics.saved(-attempt.served_s)
            attempt.served_s = None
        self.store.record_compile(attempt.key, seconds)
        self.metrics.changed()

    def record_write(self, extension: str, path: str) -> None:
        attempt = self.attempt
        if extension == "main.cpp":
            attempt.loading_kernel = path[: -len("cpp")] + "so"
            attempt.kernels.add(attempt.loading_kernel)
            if attempt.build_kernels is not None:
                attempt.build_kernels.add(attempt.loading_kernel)
            return
        if extension not in _SAME_KERNEL_WRITES:
            attempt.loading_kernel = None
        if extension == "cpp":
            self.probes.record_source(path)

    @contextmanager
    def kernels_loaded(self) -> Iterator[set[str]]:
        """The kernel libraries this thread loads in the block, compiled or found: what a precompiled function
        built of inductor's graphs must carry, since torch's serialized graphs hold their source only."""
        attempt = self.attempt
        outer, attempt.build_kernels = attempt.build_kernels, set()
        try:
            yield attempt.build_kernels
        finally:
            if outer is not None:
                outer |= attempt.build_kernels
            attempt.build_kernels = outer

    def graph_cache_scope(self, gm: Any) -> AbstractContextManager[Any]:
        """Where inductor compiles one graph (``_compile_fx_inner``): inside a precompiled function's build, with
        torch's FX graph cache on, as on the normal path.

        ``aot_compile`` bundles inductor's graphs into AOTAutograd's entry and, to do so, turns
        the FX graph cache off (``bundled_autograd_cache``, which also enters the FX key). Its
        graphs would then reach the store only inside the precompiled artifact and an AOTAutograd
        entry under a key the normal path never computes: a fresh process that falls back (or
        runs without the tier) would compile every graph again. With the flag off for the
        graph's compile alone, the graph is looked up, single-flighted and published under the
        FX key the normal path computes, and AOTAutograd (outside this scope) still bundles the
        compiled graph it gets back. A graph without calls is left to torch's bundled path (off
        it, torch returns the module's own forward, which cannot be bundled).
        """
        from torch._dynamo.utils import count_calls

        if self.attempt.build_kernels is None or gm is None or count_calls(gm.graph) == 0:
            return nullcontext()
        return functorch_config.patch(bundled_autograd_cache=False)

    def kernel_is_built(self) -> bool:
        """Whether the library of the kernel torch is loading on this thread is already on disk."""
        library = self.attempt.loading_kernel
        return library is not None and Path(library).exists()

    def warm_header(self, build: Callable[[], object], arguments: tuple[Any, ...]) -> None:
        """Build a precompiled header this process skipped, in the background, if it is likely to need it.

        Only after this process waited for another one's compile (a cold job): it loaded
        that graph without the header, and if it compiles a later graph itself it would pay
        the header build (seconds of g++) on the job's critical path, while the rank that
        already has one waits for it. Built now, off the critical path, the later compile
        finds it (torch caches the result in-process; its build is file-locked, so a
        compile that asks meanwhile waits for this build instead of repeating it). A fresh
        process that only hits never waits, so it never builds one.

        The build runs at the lowest CPU priority (:data:`BACKGROUND_NICE`, this thread and
        the g++ it starts): it is speculative, and on a cold job every rank but the compiling
        one reaches it while that rank still compiles the job's next graph. Measured (issue
        27, 4 ranks on 2 cores, each in its own dirs): three followers' header builds at normal
        priority were most of the job's CPU beyond the one compile, beside that compile.
        """
        if not self._followed:
            return
        with self._lock:
            if arguments in self._warm_headers:
                return
            self._warm_headers.add(arguments)

        def run() -> None:
            _lower_this_threads_priority()
            try:
                build()
            except Exception:  # torch builds it itself when a compile needs it
                log.debug("recipecache: background header build failed", exc_info=True)

        threading.Thread(target=run, name="recipecache-header", daemon=True).start()

    def close(self) -> None:
        """Free every lease and this thread's attempt, close the key log: the hooks are off (disable, a failed enable)."""
        self.end_attempt()
        self.release_all()
        self.keys.close()


class WaitingGraph:
    """Inductor's output for a graph another process is compiling (overlap): at its first call, that graph.

    The first call waits for the lease holder's artifact and loads it (:func:`..deferral.reload`:
    torch's ``_compile_fx_inner`` again, whose lookup waits as a compile's would: a hit, or, if the
    holder died or the wait timed out, the take-over or a local compile, counted); every call then runs
    the loaded graph. Boxed calling convention, as an instance attribute (see
    :class:`..no_stall.graph.NoStallGraph`). What AOTAutograd's cache entry reads of a compiled
    graph (its FX key, debug lines and guards) is the loaded graph's, so the entry is saved once every
    graph it names is loaded (:meth:`when_loaded`, :func:`save_when_loaded`): a later job of fresh
    ranks skips AOTAutograd's trace as after an inline compile.
    """

    def __init__(self, deferred: deferral.Deferred, compile_again: Callable[[], Any]) -> None:
        self._boxed_call = True
        self._deferred = deferred
        self._compile_again = compile_again
        self._lock = threading.Lock()
        self._compiled: Callable[[list[Any]], Any] | None = None
        self._on_load: list[Callable[[], object]] = []

    def __call__(self, args: list[Any]) -> Any:
        compiled = self._compiled
        if compiled is None:
            compiled = self._load()
        return compiled(args)

    def _load(self) -> Callable[[list[Any]], Any]:
        with self._lock:
            if self._compiled is None:
                self._compiled = deferral.reload(self._deferred, self._compile_again)
                on_load, self._on_load = self._on_load, []
                for call in on_load:
                    try:
                        call()
                    except Exception:  # an AOTAutograd entry not saved: a later job traces again
                        log.warning("recipecache: saving an AOTAutograd entry after a load failed", exc_info=True)
            return self._compiled

    def when_loaded(self, call: Callable[[], object]) -> bool:
        """Run ``call`` once this graph is loaded; False if it is already (the caller runs it)."""
        with self._lock:
            if self._compiled is not None:
                return False
            self._on_load.append(call)
            return True

    @property
    def _fx_graph_cache_key(self) -> str | None:
        return getattr(self._compiled, "_fx_graph_cache_key", None)

    @property
    def _fx_graph_cache_debug_lines(self) -> list[str] | None:
        return getattr(self._compiled, "_fx_graph_cache_debug_lines", None)

    @property
    def guards_expr(self) -> str | None:
        return getattr(self._compiled, "guards_expr", None)

    @property
    def _time_taken_ns(self) -> int | None:
        return getattr(self._compiled, "_time_taken_ns", None)


def waiting_graph_in(compiled: Any) -> WaitingGraph | None:
    """The :class:`WaitingGraph` that ``compiled`` (AOTAutograd's compiled forward or backward, maybe wrapped) is,
    if it is one."""
    import inspect

    inner = inspect.unwrap(compiled) if compiled is not None else None
    return inner if isinstance(inner, WaitingGraph) else None


def save_when_loaded(save: Callable[[], R], graphs: list[WaitingGraph]) -> R | None:
    """``save()`` now if every graph in ``graphs`` is loaded, else once the last of them is (once)."""
    pending = [g for g in graphs if g._compiled is None]
    if not pending:
        return save()
    done = threading.Event()

    def again() -> None:
        if not done.is_set() and all(g._compiled is not None for g in graphs):
            done.set()
            save()

    for graph in pending:
        if not graph.when_loaded(again):
            again()
    return None


def _output_strides_wanted() -> bool:
    """Whether the graph being compiled reports its output strides (a forward: AOTAutograd compiles its backward
    for them, ``TracingContext.report_output_strides``)."""
    import torch

    context = torch._guards.TracingContext.try_get()
    return context is not None and context.output_strides is not None


#: what the store key of a forward's output strides adds to the forward's
STRIDES_SUFFIX = ":output-strides"


def _strides_key(key: str) -> str:
    """Store key of the output strides of the forward stored under ``key``."""
    return key + STRIDES_SUFFIX


def _lower_this_threads_priority() -> None:
    """This thread, and the processes it starts, at :data:`BACKGROUND_NICE` (Linux, where a thread has its own
    nice value; elsewhere nothing changes: the call would name the whole process)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as exc:  # a container that forbids it: the build runs at the process's priority
        log.debug("recipecache: background build at normal priority: %s", exc)


def _guards_of(entry: bytes) -> str | None:
    """torch's guard expression of an FX entry this process just produced ("" for none), None if unreadable.

    Our own process's bytes, unpickled as torch unpickles them on a hit, to tell a
    recompile of a stored variant (same guards) from a new variant.
    """
    try:
        graph = pickle.loads(torch_pickle(entry))  # noqa: S301 - this process's own bytes (above)
        guards = graph.guards_expr
    except Exception:  # not knowing only costs a slot among the variants
        log.debug("recipecache: cannot read the guards of a graph being published", exc_info=True)
        return None
    return "" if guards is None else guards if isinstance(guards, str) else None
