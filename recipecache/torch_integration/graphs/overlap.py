"""Overlap: a graph whose lease another process holds is not waited for in torch's compile.

A :class:`WaitingGraph` stands for it and waits at its first call, so this process goes on to
compile the next graph (a forward's backward, with the output strides the forward's leader
published once it lowered the graph) while the other one compiles the first. The hooks that
tell where (``_compile_fx_inner``, inductor's lowering, AOTAutograd's backward stage and cache
entry) are in :mod:`..patches`; the no-stall deferral that shares ``_compile_fx_inner``'s
stand-in mechanism is :mod:`..deferral`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ...reasons import Reason, Role
from ...store import Flight, Store
from .. import deferral
from ..metrics import Metrics
from . import output_strides
from .artifacts import KIND_NAMES
from .attempt import Attempt, Leases

log = logging.getLogger(__name__)

#: what the store key of a forward's output strides adds to the forward's
STRIDES_SUFFIX = ":output-strides"


class Overlap:
    """The overlap of one enabled store: graphs left for their first call, and the output strides that let this
    process compile a backward while another compiles its forward."""

    def __init__(self, store: Store, metrics: Metrics, wait_timeout: float | None, leases: Leases) -> None:
        self.store = store
        self.metrics = metrics
        self.wait_timeout = wait_timeout
        self.leases = leases
        self.attempt: Attempt = leases.attempt
        #: set at install, where its hooks are on: a graph whose lease another process holds is waited for at its
        #: first call, not in the compile, so this process goes on to lead the next graph meanwhile
        #: (:meth:`defer_busy`, :class:`WaitingGraph`)
        self.enabled = False

    def defer_busy(self, flight: Flight, gm: Any, example_inputs: list[Any]) -> deferral.Deferred:
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
        if not strides_wanted():
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
        call: its forward was left for its first call here (:meth:`defer_busy`). torch compiles a backward lazily,
        at its first call, after the forward ran; the forward being another process's compile, this one compiles
        the backward meanwhile. Asked once per backward stage."""
        import torch

        context, self.attempt.deferred_forward = self.attempt.deferred_forward, None
        return context is not None and context is torch._guards.TracingContext.try_get()

    def lead_strides(self, key: str) -> None:
        """This thread leads forward ``key``'s compile: take the lease of its output strides, which
        :meth:`lowered` publishes (a process that finds the forward busy waits on it, :meth:`_leader_strides`)."""
        flight = self.store.begin(_strides_key(key), wait=False, trace=False, kind="strides")
        if flight.role is Role.LEADER:
            self.attempt.strides_flight = flight
            self.leases.keep(flight)
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
        if another process may wait for them (:meth:`defer_busy`), as torch computes them for its compiled graph."""
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
        self.leases.forget(flight)
        forward = flight.key.removesuffix(STRIDES_SUFFIX)
        flight.publish(output_strides.record(forward, strides), meta={"kind": KIND_NAMES["strides"]})

    @contextmanager
    def may_defer(self, graph_kwargs: dict[str, Any]) -> Iterator[None]:
        """Overlap: the compile in this block (torch's ``_compile_fx_inner`` with ``graph_kwargs``) may leave a graph
        another process compiles to its first call. Not an inference graph: no backward follows it to compile
        meanwhile, and AOTAutograd saves its entry in the compile (it would save none for a stand-in)."""
        attempt = self.attempt
        outer, attempt.deferrable = attempt.deferrable, self.enabled and not graph_kwargs.get("is_inference", False)
        try:
            yield
        finally:
            attempt.deferrable = outer

    def waiting_graph(self, deferred: deferral.Deferred, compile_again: Callable[[], Any]) -> Any:
        """What ``_compile_fx_inner`` returns for a graph :meth:`defer_busy` deferred: a :class:`WaitingGraph`, or the
        graph itself, waited for now (still inside torch's compile of it, in its context)."""
        if not deferred.later:
            return compile_again()
        return WaitingGraph(deferred, compile_again)


class WaitingGraph(deferral.StandIn):
    """Inductor's output for a graph another process is compiling (overlap): at its first call, that graph.

    The first call waits for the lease holder's artifact and loads it (:func:`..deferral.reload`:
    torch's ``_compile_fx_inner`` again, whose lookup waits as a compile's would: a hit, or, if the
    holder died or the wait timed out, the take-over or a local compile, counted); every call then runs
    the loaded graph. Boxed calling convention, as an instance attribute (see
    :class:`..no_stall.graph.NoStallGraph`). AOTAutograd's cache entry naming it is saved once it is
    loaded (:class:`..deferral.StandIn`).
    """

    def __init__(self, deferred: deferral.Deferred, compile_again: Callable[[], Any]) -> None:
        super().__init__()
        self._boxed_call = True
        self._deferred = deferred
        self._compile_again = compile_again

    def __call__(self, args: list[Any]) -> Any:
        compiled = self._compiled
        if compiled is None:
            compiled = self._load()
        return compiled(args)

    def _load(self) -> Callable[[list[Any]], Any]:
        with self._lock:
            if self._compiled is None:
                self._loaded(deferral.reload(self._deferred, self._compile_again))
            assert self._compiled is not None
            return self._compiled


def strides_wanted() -> bool:
    """Whether the graph being compiled reports its output strides (a forward: AOTAutograd compiles its backward
    for them, ``TracingContext.report_output_strides``)."""
    import torch

    context = torch._guards.TracingContext.try_get()
    return context is not None and context.output_strides is not None


def _strides_key(key: str) -> str:
    """Store key of the output strides of the forward stored under ``key``."""
    return key + STRIDES_SUFFIX
