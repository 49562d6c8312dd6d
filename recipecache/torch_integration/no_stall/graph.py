"""The switching callable of no-stall: what ``_compile_fx_inner`` returns for a graph compiled behind the steps.

It runs the traced graph eagerly until the compiled graph exists, then loads it through torch's FX cache path
and runs it, for the inputs its guards accept (:class:`NoStallGraph`). Which graphs are compiled behind, and by
whom, is :mod:`.controller`'s; this module only looks, calls and switches, and reports what it did there.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import deferral
from ..deferral import Deferred, StandIn, deferred_of
from .protocol import needs_process_groups

if TYPE_CHECKING:
    from .controller import NoStall

log = logging.getLogger(__name__)

#: seconds between two looks of a ``busy`` process at the key's lease
POLL_S = 0.5
#: seconds a process whose compile of a graph failed leaves its lead to the others before it takes it
#: again, and between two looks for the artifact of a graph it may no longer lead while nobody compiles it
RETRY_S = 5.0


class CpuProbeWarmer:
    """Picks the CPU's vector ISA in the background, once, at the first CPU graph deferred.

    Loading a compiled CPU graph asks for it, and a process that never compiled has not
    picked it yet: on torch 2.13 that runs torch's probe libraries, seconds, which would
    otherwise land in the step that switches. It runs g++ or the probe in child processes,
    so the thread mostly waits without the interpreter lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warmed = False

    def warm(self, example_inputs: Any) -> None:
        """Start the pick now if ``example_inputs`` (a deferred graph's) hold a CPU tensor and none started yet."""
        with self._lock:
            if self._warmed or not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in example_inputs):
                return
            self._warmed = True
        threading.Thread(target=_pick_vec_isa, name="recipecache-isa", daemon=True).start()


def _pick_vec_isa() -> None:
    from torch._inductor import cpu_vec_isa

    try:
        cpu_vec_isa.pick_vec_isa()
    except Exception:  # the switch picks it itself
        log.debug("recipecache: background ISA pick failed", exc_info=True)


#: the view ops a backward graph runs eagerly as reshapes (:func:`views_as_reshapes`)
_VIEWS = ("view", "_unsafe_view")


def views_as_reshapes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of backward graph ``gm`` whose ``view`` ops are ``reshape``s, to run without inductor.

    AOTAutograd traced the backward on the tensors the forward saves as eager computes them. Once the
    forward runs compiled (it switched first, or a fresh process loaded it from the store) while its
    backward still runs here, the saved tensors come with inductor's strides, on which a ``view`` can fail
    ("view size is not compatible with input tensor's size and stride": torchvision's ResNet under DDP,
    whose fresh job loaded a forward its cold job had published and not the backward). A reshape is that
    view wherever the strides allow one and a copy elsewhere; a backward's outputs are gradients, whose
    aliasing nothing relies on. ``gm`` itself stays as traced: it is what the compile and its key are of.
    """
    graph = copy.deepcopy(gm.graph)
    views = {getattr(torch.ops.aten, name).default for name in _VIEWS}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in views:
            node.target = torch.ops.aten.reshape.default
    return torch.fx.GraphModule(gm, graph)


def _physical_order(strides: list[int]) -> list[int]:
    """The dims of a tensor from its outermost to its innermost in memory (``torch.empty_permuted``'s layout)."""
    return sorted(range(len(strides)), key=lambda d: (-strides[d], d))


def _hint(value: Any) -> int | None:
    """An int, or a symbolic size's value where the graph was traced (None: it has none)."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)
    return hint if isinstance(hint, int) else None


def _output_strides(gm: torch.fx.GraphModule) -> list[tuple[str, ...] | None]:
    """The strides of traced graph ``gm``'s outputs, written as inductor writes a compiled graph's (``output_strides``:
    ``str`` of each, an int or a size expression); None for an output that is no tensor, or that nothing describes."""
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    strides: list[tuple[str, ...] | None] = []
    for value in values:
        traced = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        strides.append(tuple(str(stride) for stride in traced.stride()) if isinstance(traced, torch.Tensor) else None)
    return strides


class TracedLayouts:
    """The memory layouts a graph's tensor inputs had where it was traced, which its compiled code asserts.

    A graph compiled behind was traced on the layouts eager computes; the compiled graph asserts them
    (``assert_size_stride``). Once a forward runs compiled, inductor may lay its outputs out otherwise (on the CPU
    every convolution's activations and weights go channels-last), and those outputs are its backward's inputs:
    AOTAutograd traces a backward on the compiled forward's layouts only when it knows them, and a forward compiled
    behind reported none. A backward compiled behind then asserted eager's layouts on inductor's and raised as soon as
    both had switched (a two-conv net, the step after the switch). :meth:`restride` copies each input that comes in
    another layout into the traced one: the values the compiled graph expects, where it expects them. Static strides
    are matched exactly; symbolic ones by the order of the dims in memory, as traced.
    """

    def __init__(self, example_inputs: list[Any]) -> None:
        #: (position, strides) of the inputs traced with static strides; (position, dims' order in memory) of the rest
        self._static: list[tuple[int, tuple[int, ...]]] = []
        self._ordered: list[tuple[int, list[int]]] = []
        for position, traced in enumerate(example_inputs):
            if not isinstance(traced, torch.Tensor):
                continue
            strides = [_hint(stride) for stride in traced.stride()]
            sizes = [_hint(size) for size in traced.shape]
            if any(stride == 0 and size != 1 for stride, size in zip(strides, sizes, strict=True)):
                continue  # traced as a broadcast view, which no copy can be: the compiled graph sees it as it comes
            if all(isinstance(stride, int) for stride in traced.stride()):
                self._static.append((position, tuple(traced.stride())))
            elif None not in strides and None not in sizes:
                self._ordered.append((position, _physical_order(strides)))  # type: ignore[arg-type]

    def restride(self, args: list[Any]) -> int:
        """Copy every input of ``args`` (in place in the list) that is not laid out as traced into the traced layout;
        how many were copied."""
        copied = 0
        for position, strides in self._static:
            arg = args[position]
            if isinstance(arg, torch.Tensor) and arg.dim() == len(strides) and arg.stride() != strides:
                args[position] = _copied(
                    arg, torch.empty_strided(arg.shape, strides, dtype=arg.dtype, device=arg.device)
                )
                copied += 1
        for position, order in self._ordered:
            arg = args[position]
            if not isinstance(arg, torch.Tensor) or arg.dim() != len(order):
                continue
            sizes = list(arg.shape)
            if [d for d in _physical_order(list(arg.stride())) if sizes[d] > 1] != [d for d in order if sizes[d] > 1]:
                args[position] = _copied(
                    arg, torch.empty_permuted(arg.shape, order, dtype=arg.dtype, device=arg.device)
                )
                copied += 1
        return copied


def _copied(arg: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``target`` holding ``arg``'s values, copied outside autograd (only where a copy is due: a call that needs
    none, every call of a switched graph in the common case, enters no grad-mode context)."""
    with torch.no_grad():
        return target.copy_(arg)


class BackwardStage:
    """AOTAutograd's backward stage of one compile whose forward is compiled behind, kept to be run again once that
    forward is loaded.

    AOTAutograd traces a backward on the layouts its forward's compiled code gives the saved activations
    (``_aot_stage2b_bw_compile`` restrides them), and only where the forward's compile reports them; a forward
    compiled behind reports none, so its backward was traced on eager's layouts. Compiled and keyed on those, it
    was another graph than the one a next process traces after loading that forward from the store (on the CPU
    inductor lays convolutions' activations out channels-last): torchvision's and diffusers' fresh no-stall jobs
    compiled their backwards again. So the backward waits, eager, for its forward's compiled graph, and is then
    traced as torch traces it after a hit: torch's own stage, run again with the loaded forward's output strides
    (torch's ``set_tracing_context_output_strides``), gives the inputs; nothing of torch's layout rules is
    copied here.
    """

    def __init__(self, stage: Callable[..., Any], arguments: dict[str, Any], forward: NoStallGraph) -> None:
        self._stage = stage
        self._arguments = arguments
        #: the forward compiled behind whose layouts the backward awaits
        self.forward = forward
        #: the backward's inputs as traced (the values of its graph's placeholders)
        self._traced = [node.meta.get("val") for node in arguments["bw_module"].graph.nodes if node.op == "placeholder"]

    def is_for(self, example_inputs: list[Any]) -> bool:
        """Whether the backward compiled on ``example_inputs`` is this stage's: torch compiles it on the very tensors
        the stage traced (several compiles share one tracing context: DDP's optimizer compiles a graph per bucket)."""
        given = {id(value) for value in example_inputs}
        traced = [value for value in self._traced if isinstance(value, torch.Tensor)]
        return bool(traced) and all(id(value) in given for value in traced)

    def ready(self) -> bool:
        """Whether the backward may be compiled now: its forward is loaded, or will never be (it runs eagerly)."""
        return self.forward.loaded_or_given_up()

    def inputs(self, example_inputs: list[Any]) -> list[Any] | None:
        """The backward's compile inputs ``example_inputs`` (traced on eager's layouts) as AOTAutograd traces them on
        the loaded forward's output layouts; None where the forward is not loaded (they stay as traced)."""
        import dataclasses

        strides = self.forward.reported_output_strides()
        if strides is None:
            return None
        aot_config = dataclasses.replace(self._arguments["aot_config"], force_non_lazy_backward_lowering=False)
        arguments = {
            **self._arguments,
            "fwd_output_strides": strides,
            "aot_config": aot_config,
            "bw_compiler": _placeholder_compiler,
        }
        lazy_info, _ = self._stage(**arguments)
        layouts = {id(old): new for old, new in zip(self._traced, lazy_info.placeholder_list, strict=True)}
        return [layouts.get(id(value), value) for value in example_inputs]

    def key_of(self, backward: Any) -> str | None:
        """The store key of ``backward``, the compiled graph of this stage's backward loaded from the store: its FX key
        in its forward's store key (both graphs' keys are made alike), or None where they do not say it."""
        forward_fx, backward_fx = self.forward._fx_graph_cache_key, getattr(backward, "_fx_graph_cache_key", None)
        if not forward_fx or not backward_fx or forward_fx not in self.forward.key:
            return None
        return self.forward.key.replace(forward_fx, backward_fx)


def _requiring_grad(value: Any, requires_grad: bool) -> Any:
    """``value``, or where it is a tensor whose ``requires_grad`` is no longer ``requires_grad``, an alias of it that
    has it (the same sizes, strides and storage)."""
    if not isinstance(value, torch.Tensor) or value.requires_grad == requires_grad:
        return value
    alias = value.detach()
    return alias.requires_grad_(True) if requires_grad else alias


def _placeholder_compiler(gm: Any, example_inputs: list[Any]) -> Callable[..., None]:
    """The backward compiler :class:`BackwardStage` hands torch's stage: only its inputs are wanted (a stage that
    saves sizes compiles at once, with the restrided inputs), never a compiled graph."""

    def never_called(*args: Any) -> None:
        raise RuntimeError("a placeholder backward was called")

    return never_called


class NoStallGraph(StandIn):
    """Inductor's output for one graph while it compiles elsewhere: eager until the compiled graph exists.

    Boxed calling convention (``_boxed_call``), like the ``OutputCode`` it stands for; an
    instance attribute, since torch wraps the backward's callable (``functools.wraps`` copies
    the instance's ``__dict__``, not its class's). AOTAutograd's entry naming it is saved once
    the compiled graph is loaded (:class:`..deferral.StandIn`): at the switch, or at exit
    (:meth:`load_at_exit`), so that the next process skips AOTAutograd's trace.
    """

    def __init__(
        self,
        no_stall: NoStall,
        deferred: Deferred,
        compile_with: Callable[[list[Any]], Any],
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        *,
        backward: bool = False,
    ) -> None:
        from torch._inductor.codecache import FxGraphCache
        from torch.fx._lazy_graph_module import _LazyGraphModule

        super().__init__()
        self._boxed_call = True
        self._no_stall = no_stall
        self._key = deferred.key
        self._what = deferred.what
        self._compile_with = compile_with
        #: the inputs the compile and its key are of (a backward's: restrided once its forward is loaded)
        self._example_inputs = example_inputs
        #: a backward awaiting its forward's compiled layouts before it is compiled (:class:`BackwardStage`)
        self._follows: BackwardStage | None = deferred.follows
        #: its inputs' ``requires_grad`` as torch compiles it now (the key holds it; DDP's optimizer sets it later on
        #: a tensor the next bucket's graph takes, which is one of this backward's inputs)
        self._requires_grad = [isinstance(v, torch.Tensor) and v.requires_grad for v in example_inputs]
        #: a forward: a backward was traced on its compiled layouts (:meth:`fits_its_entry`)
        self._followed = False
        #: the first attempt, whose inductor config and tracing context the load runs under
        self._deferred = deferred
        self._job = deferred.job
        self._next_poll = time.monotonic() + POLL_S
        #: when this process last looked the graph up again, and whether it saw another one compile it since
        self._looked = time.monotonic()
        self._saw_lease = False
        #: our own compile published the graph, yet it did not load (or the process is exiting): eager for good
        self._given_up = False
        _LazyGraphModule.force_recompile(gm)  # as torch's own eager output of an empty graph
        self._eager = views_as_reshapes(gm).forward if backward else gm.forward
        #: the graph runs collectives or takes a device mesh: once the script destroyed its process groups it can no
        #: longer be keyed as the ranks share it (the mesh's groups are gone), nor compiled
        self.uses_process_groups = needs_process_groups(gm, example_inputs) is not None
        # the inputs the FX cache's guards speak of (torch's ``_filter_backed_symints``), by position
        symints = FxGraphCache._filter_backed_symints(example_inputs)
        self._symint_positions = [i for i, x in enumerate(example_inputs) if any(x is s for s in symints)]
        self._shape_env = symints[0].node.shape_env if symints else None
        self._layouts = TracedLayouts(example_inputs)
        #: a forward's outputs' strides as traced, as inductor writes a compiled graph's (None: a backward)
        self._traced_output_strides = None if backward else _output_strides(gm)
        #: calls after the switch whose inputs came in another layout than traced (:class:`TracedLayouts`)
        self._restrided = 0
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
                if self._layouts.restride(args):
                    self._restrided += 1
                    if self._restrided == 1:
                        log.info(
                            "recipecache: %s %s: inputs come laid out otherwise than traced (a forward compiled since);"
                            " copied to the traced layout for the compiled graph",
                            *self._what,
                        )
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

    def fits_its_entry(self) -> bool:
        """Whether AOTAutograd's entry pairing this graph with its backward may be saved: a forward only where it
        lays its outputs out as traced. Its backward was traced on those layouts (AOTAutograd had no compiled ones
        to trace it on), and its compiled code asserts them: a forward inductor laid out otherwise (convolutions on
        the CPU go channels-last) would hand a next process's backward, loaded through the entry, inputs it rejects.
        Such a next process traces the backward on the loaded forward's layouts instead, as without the entry."""
        traced = self._traced_output_strides
        if traced is None or self._followed:
            return True
        compiled = getattr(self._compiled, "output_strides", None)
        if compiled is None or len(compiled) != len(traced):
            return False
        return all(c is None or t is None or tuple(map(str, c)) == t for c, t in zip(compiled, traced, strict=True))

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
        """Whether to try the switch now: a backward awaiting its forward's layouts, once that forward is loaded; our
        job ended; or (looked at every POLL_S) the key's lease is gone and the artifact may be there or ours to
        make: another process's compile just ended, this process may lead the graph, or it last looked the graph up
        RETRY_S ago."""
        if self._follows is not None:
            return self._follows.ready()
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
            if self._follows is not None:
                return self._follow()
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
            return self._switched(compiled, time.perf_counter() - start)

    def _switched(self, compiled: Callable[[list[Any]], Any], seconds: float) -> Callable[[list[Any]], Any]:
        """The compiled graph is loaded (the caller holds ``_lock``): run it from now on, for the inputs its guards
        accept; counted and logged."""
        no_stall = self._no_stall
        self._guards = getattr(compiled, "guards_expr", None) or None
        self._guards_code = None if self._guards is None else compile(self._guards, "<inductor guards>", "eval")
        self._loaded(compiled)
        no_stall.store.events.record("switch", self._key, seconds)
        no_stall.metrics.no_stall(switches=1)
        with no_stall._lock:
            graph = no_stall.graphs[self._key]
            graph.switched_at, graph.switch_s = time.time(), seconds
        log.info("recipecache: %s %s now runs compiled (switch took %.3f s)", *self._what, seconds)
        return compiled

    def _follow(self) -> Callable[[list[Any]], Any] | None:
        """A backward whose forward is now loaded (or never will be): trace it on that forward's layouts
        (:class:`BackwardStage`) and compile it as any graph that missed: a hit loads it now; a miss is compiled
        behind (or left to the process that leads it) under the key of the restrided graph, which this graph's row
        and lease now follow. The caller holds ``_lock``."""
        stage, self._follows = self._follows, None
        assert stage is not None
        try:
            restrided = stage.inputs(self._example_inputs)
        except Exception:  # torch's stage refused the strides: compiled as traced, as before the forward loaded
            log.warning("recipecache: %s %s: tracing it on its forward's layouts failed", *self._what, exc_info=True)
            restrided = None
        if restrided is not None:
            stage.forward._followed = True
        inputs = restrided if restrided is not None else self._example_inputs
        self._example_inputs = [_requiring_grad(v, flag) for v, flag in zip(inputs, self._requires_grad, strict=True)]
        self._layouts = TracedLayouts(self._example_inputs)
        start = time.perf_counter()
        try:
            compiled = self._load()
        except Exception as exc:  # noqa: BLE001 - Deferred included: see below
            deferred = deferred_of(exc)
            if deferred is None:
                self._given_up = True
                self._no_stall._failed(self._key, self._what, f"cannot compile it ({exc!r})")
                return None
            self._no_stall.rekey(self._key, deferred.key, self)
            self._key, self._deferred, self._job = deferred.key, deferred, deferred.job
            self._looked = time.monotonic()
            return None
        key = stage.key_of(compiled)  # a hit: another process compiled it since
        if key is not None:
            self._no_stall.rekey(self._key, key, self)
            self._key = key
        return self._switched(compiled, time.perf_counter() - start)

    @property
    def key(self) -> str:
        """The graph's store key (a backward awaiting its forward's layouts: its forward's, suffixed: ``AWAITING_SUFFIX``)."""
        return self._key

    def follows_its_forward(self) -> BackwardStage | None:
        """The stage of a backward that awaits its forward's layouts (:class:`BackwardStage`), else None."""
        return self._follows

    def follow_now(self) -> None:
        """At exit: compile a backward awaiting its forward's layouts now, if that forward is loaded (or never will
        be): :meth:`_follow`."""
        with self._lock:
            if self._follows is not None and self._follows.ready():
                self._follow()

    def wait_for_compile(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the graph's compile to end: this process's, or the lease holder's."""
        job, end = self._job, time.monotonic() + timeout
        if job is not None:
            with contextlib.suppress(Exception):  # failures are counted where they are seen
                job.result(timeout=timeout)
            return
        while time.monotonic() < end and self._compiled is None and self._no_stall.store.compiling(self._key):
            time.sleep(min(POLL_S, max(end - time.monotonic(), 0.0)))

    def loaded_or_given_up(self) -> bool:
        """Whether the compiled graph is loaded, or never will be here."""
        return self._compiled is not None or self._given_up

    def reported_output_strides(self) -> list[Any] | None:
        """A loaded forward's output strides as torch's load reports them to AOTAutograd (``output_strides`` of the
        tracing context, torch's ``set_tracing_context_output_strides``), None where it is not loaded."""
        from torch._inductor.utils import set_tracing_context_output_strides

        compiled, context = self._compiled, self._deferred.context
        if compiled is None or getattr(compiled, "output_strides", None) is None or context is None:
            return None
        with torch._guards.tracing(context), torch._guards.TracingContext.report_output_strides() as strides:
            set_tracing_context_output_strides(self._example_inputs, compiled)
        return list(strides) if strides is not None else None

    def _load(self) -> Callable[[list[Any]], Any]:
        """torch's ``_compile_fx_inner`` again, in the context of the first attempt (:func:`..deferral.reload`)."""
        return deferral.reload(self._deferred, lambda: self._compile_with(self._example_inputs))

    def load_at_exit(self) -> bool:
        """The script has ended: load the compiled graph if it is published, without switching (no call follows),
        for what waits for the load (an AOTAutograd entry, :meth:`awaits_load`). Whether it loaded.

        Only where the graph is there: our own compile (or the compile pool's taker for us) ended well, or, for a
        graph another process led, its lease is gone. A miss then is never compiled here
        (:meth:`.controller.NoStall.intercept` defers every graph while the process loads at exit) and is no
        failure: the graph stays as it was.
        """
        with self._lock:
            if self._compiled is not None or self._given_up or self._follows is not None:
                return False
            job = self._job
            if job is not None and (not job.done() or job.cancelled() or job.exception() is not None):
                return False
            if job is None and self._no_stall.store.compiling(self._key):
                return False
            try:
                self._loaded(self._load())
            except Exception:  # not there after all (a Deferred), or not loadable: left as it is
                log.debug("recipecache: %s %s did not load at exit", *self._what, exc_info=True)
                return False
            return True
