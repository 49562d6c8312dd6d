"""A graph's compile left for later: what the features that return a stand-in for inductor's output share.

Two features keep a rank from compiling a graph inline when its FX lookup missed: no-stall
(:mod:`.no_stall.controller`: the graph runs without inductor while a worker compiles it) and the
graph store's overlap (:mod:`.graphs.integration`: another process compiles it, this one goes on tracing
and waits at the graph's first call). Both raise :class:`Deferred` from inside torch's
``fx_codegen_and_compile``, the patched ``_compile_fx_inner`` turns it into a boxed callable, and
that callable later runs torch's ``_compile_fx_inner`` again (:func:`reload`), which then hits.
Both callables are stand-ins (:class:`StandIn`): AOTAutograd's cache entry naming one is saved once the graph it
stands for is loaded (:func:`save_when_loaded`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch._inductor.config as inductor_config

log = logging.getLogger(__name__)

R = TypeVar("R")


class Deferred(Exception):
    """Raised by the hooks inside torch's compile of one graph: do not compile it here and now.

    torch wraps it (``InductorError``); :func:`deferred_of` finds it again.
    """

    def __init__(
        self,
        key: str,
        what: tuple[str, str],
        job: Future[float] | None,
        config: dict[str, Any],
        context: Any,
        compile_context: Any = None,
    ) -> None:
        super().__init__(f"compile of {key} deferred")
        self.key = key
        self.what = what
        #: the background compile this process started (no-stall's leader), or None (another process compiles it)
        self.job = job
        self.config = config
        self.context = context
        #: dynamo's compile context (the compile id a lookup's records are named by), None outside a compile
        self.compile_context = compile_context
        #: overlap: False when the graph is to be waited for at once, in the compile (its stand-in could not be
        #: made safely: :meth:`.graphs.overlap.Overlap.waiting_graph`)
        self.later = True
        #: no-stall: a backward left uncompiled until its forward, compiled behind, is loaded, and AOTAutograd's stage
        #: that traces it again on that forward's layouts (:class:`.no_stall.graph.BackwardStage`)
        self.follows: Any = None

    @classmethod
    def here(cls, key: str, what: tuple[str, str], job: Future[float] | None = None) -> Deferred:
        """Deferred from inside torch's compile: with the inductor config and tracing context a reload needs."""
        guards = torch._guards
        return cls(
            key,
            what,
            job,
            inductor_config.save_config_portable(),
            guards.TracingContext.try_get(),
            guards.CompileContext.try_get(),
        )


def deferred_of(exc: BaseException) -> Deferred | None:
    """The :class:`Deferred` that ``exc`` is or wraps (torch re-raises it as ``InductorError``), else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, Deferred):
            return current
        seen.add(id(current))
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
    return None


def reload(deferred: Deferred, compile_again: Callable[[], Any]) -> Any:
    """torch's ``_compile_fx_inner`` again (``compile_again``), in the context of the deferred attempt: a hit now,
    or a compile here, which needs the debug context torch's ``compile_fx_inner`` gives it."""
    from torch._inductor.debug import DebugContext

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.utils._python_dispatch._disable_current_modes())
        stack.enter_context(DebugContext())
        stack.enter_context(inductor_config.patch(deferred.config))
        stack.enter_context(torch._guards.tracing(deferred.context))
        if deferred.compile_context is not None:
            stack.enter_context(torch._guards.compile_context(deferred.compile_context))
        return compile_again()


class StandIn:
    """What ``_compile_fx_inner`` returned for a deferred graph, until the compiled graph is loaded into it.

    What AOTAutograd's cache entry reads of a compiled graph (its FX key, debug lines and guards) is the loaded
    graph's, None before: the entry is saved once every graph it names is loaded (:meth:`when_loaded`,
    :func:`save_when_loaded`), so a later process of fresh ranks skips AOTAutograd's trace, as after an inline
    compile. The subclass sets ``_compiled`` through :meth:`_loaded`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compiled: Callable[[list[Any]], Any] | None = None
        self._on_load: list[Callable[[], object]] = []

    def _loaded(self, compiled: Callable[[list[Any]], Any]) -> None:
        """``compiled`` is loaded (the caller holds ``_lock``): run what waited for it."""
        self._compiled = compiled
        on_load, self._on_load = self._on_load, []
        for call in on_load:
            try:
                call()
            except Exception:  # an AOTAutograd entry not saved: a later job traces again
                log.warning("recipecache: saving an AOTAutograd entry after a load failed", exc_info=True)

    def when_loaded(self, call: Callable[[], object]) -> bool:
        """Run ``call`` once this graph is loaded; False if it is already (the caller runs it)."""
        with self._lock:
            if self._compiled is not None:
                return False
            self._on_load.append(call)
            return True

    def awaits_load(self) -> bool:
        """Whether something (an AOTAutograd entry) waits for this graph to be loaded."""
        return bool(self._on_load)

    def fits_its_entry(self) -> bool:
        """Whether AOTAutograd's entry naming the loaded graph may be saved (a subclass may know better)."""
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


def stand_in_of(compiled: Any) -> StandIn | None:
    """The :class:`StandIn` that ``compiled`` (AOTAutograd's compiled forward or backward, maybe wrapped) is, if it
    is one."""
    inner = inspect.unwrap(compiled) if compiled is not None else None
    return inner if isinstance(inner, StandIn) else None


def save_when_loaded(save: Callable[[], R], graphs: list[StandIn]) -> R | None:
    """``save()`` now if every graph in ``graphs`` is loaded, else once the last of them is (once); never where one
    of them does not fit the entry (:meth:`StandIn.fits_its_entry`)."""

    def save_if_fit() -> R | None:
        if all(g.fits_its_entry() for g in graphs):
            return save()
        log.info("recipecache: an AOTAutograd entry naming a graph compiled later was not saved: it does not fit it")
        return None

    pending = [g for g in graphs if g._compiled is None]
    if not pending:
        return save_if_fit()
    done = threading.Event()

    def again() -> None:
        if not done.is_set() and all(g._compiled is not None for g in graphs):
            done.set()
            save_if_fit()

    for graph in pending:
        if not graph.when_loaded(again):
            again()
    return None
