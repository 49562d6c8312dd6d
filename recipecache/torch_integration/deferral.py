"""A graph's compile left for later: what the features that return a stand-in for inductor's output share.

Two features keep a rank from compiling a graph inline when its FX lookup missed: no-stall
(:mod:`.no_stall.controller`: the graph runs without inductor while a worker compiles it) and the
graph store's overlap (:mod:`.graphs.integration`: another process compiles it, this one goes on tracing
and waits at the graph's first call). Both raise :class:`Deferred` from inside torch's
``fx_codegen_and_compile``, the patched ``_compile_fx_inner`` turns it into a boxed callable, and
that callable later runs torch's ``_compile_fx_inner`` again (:func:`reload`), which then hits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch._inductor.config as inductor_config


class Deferred(Exception):
    """Raised by the hooks inside torch's compile of one graph: do not compile it here and now.

    torch wraps it (``InductorError``); :func:`deferred_of` finds it again.
    """

    def __init__(
        self, key: str, what: tuple[str, str], job: Future[float] | None, config: dict[str, Any], context: Any
    ) -> None:
        super().__init__(f"compile of {key} deferred")
        self.key = key
        self.what = what
        #: the background compile this process started (no-stall's leader), or None (another process compiles it)
        self.job = job
        self.config = config
        self.context = context
        #: overlap: False when the graph is to be waited for at once, in the compile (its stand-in could not be
        #: made safely: :meth:`.graphs.overlap.Overlap.waiting_graph`)
        self.later = True

    @classmethod
    def here(cls, key: str, what: tuple[str, str], job: Future[float] | None = None) -> Deferred:
        """Deferred from inside torch's compile: with the inductor config and tracing context a reload needs."""
        return cls(key, what, job, inductor_config.save_config_portable(), torch._guards.TracingContext.try_get())


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
        return compile_again()
