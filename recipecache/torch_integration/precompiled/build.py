"""The tier's builds: one process traces and compiles a function whole, publishes the artifact, and shares it.

A build is the normal path's compile, not a second one (the module docstring of :mod:`.tier`):
torch's default inductor backend as ``torch.compile`` builds it (:class:`Inductor`), through the
store's graph hooks, with the tier's guard filter recording what torch's saved guards leave out
(:class:`.traced_values.Recorder`). What cannot be precompiled is published as a verdict, so the
other processes go straight to the normal path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ...reasons import REFUSED, PrecompileDetail
from ...store import Flight, Store
from .. import describe, rank_binding
from ..artifact import collect
from ..metrics import Metrics
from . import code_digest, guard_state
from .compiled_function import KIND_NAME, Precompiled, grouped_key, versioned_key
from .keys import CompileSettings, traced_code
from .traced_values import Recorder, modules_installed, scopes_installed, values_of
from .variant import Fallback, Variant

if TYPE_CHECKING:
    from .dispatcher import Target

log = logging.getLogger(__name__)


class Inductor(torch._TorchCompileInductorWrapper):
    """torch's default inductor backend, as ``torch.compile`` builds it, noting whether its graph takes sizes.

    ``aot_compile_fullgraph`` bundles what an instance of torch's wrapper returns
    (AOTAutograd's entry with inductor's graphs), so a subclass keeps that; the note is
    for the metrics and the artifact (``dynamic``).
    """

    takes_sizes = False

    def __call__(self, model_: Any, inputs_: Any, **kwargs: Any) -> Any:
        self.takes_sizes = any(not isinstance(x, torch.Tensor) for x in inputs_)
        return super().__call__(model_, inputs_, **kwargs)


def inductor_backend(settings: CompileSettings) -> Inductor:
    """The backend ``aot_compile`` gets: the one ``torch.compile`` builds for the user's mode, options and dynamic."""
    return Inductor(settings.mode or "default", settings.options, settings.dynamic)


def no_kernels() -> AbstractContextManager[set[str]]:
    """What :attr:`Tier.kernels_loaded` is without the graph hooks' kernel log: nothing collected."""
    return nullcontext(set())


def share_shape_decisions() -> None:
    """Publish torch's automatic-dynamic state after a build, as torch does after each of its own compiles.

    ``aot_compile_fullgraph`` traces as dynamo does (it reads and updates the state: which
    dimensions changed size) but leaves the upload to its caller. Without it a process that
    later traces on the normal path (a fallback, a job without the tier) starts from nothing:
    it compiles a static graph where the tier's builds compiled the dynamic one, and misses
    the graph store. The state is read once, at a process's first trace, so ranks tracing
    side by side in a cold job still decide from their own. A failure only costs that match.
    """
    from torch._dynamo.pgo import put_code_state

    try:
        put_code_state()
    except Exception:  # torch swallows its own upload failures; so do we
        log.debug("recipecache: uploading the automatic-dynamic state failed", exc_info=True)


@dataclass
class Builder:
    """Precompiles a function as the leader of its key's flight, publishes it, and copies it under keys it serves."""

    store: Store
    metrics: Metrics
    #: collects the kernel libraries this thread loads in a block (:attr:`.tier.Tier.kernels_loaded`)
    kernels_loaded: Callable[[], AbstractContextManager[set[str]]]
    #: counts a signature sent to the normal path (:meth:`.tier.Tier.fallback`)
    fallback: Callable[..., Fallback]

    def lead(
        self, target: Target, key: str, flight: Flight, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Variant | Fallback:
        """This process compiles ``key`` (``flight`` holds its lease) and publishes it, or falls back (the store
        counted the miss)."""
        if flight.miss_reason in REFUSED:
            flight.release()
            return self.fallback(flight.miss_reason, f"{key}: the stored artifact was refused")
        if flight.reason is not None:  # the store could not coordinate: no lease, nowhere to publish
            return self.fallback(flight.reason, f"{key}: the store did not answer", counted_by_store=True)
        with flight:
            return self._precompile(target, key, flight, args, kwargs)

    def _precompile(
        self, target: Target, key: str, flight: Flight, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Variant | Fallback:
        from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph
        from torch._dynamo.exc import UncapturedHigherOrderOpError, Unsupported, UserError
        from torch._dynamo.hooks import Hooks
        from torch._inductor.runtime.runtime_utils import cache_dir

        start = time.perf_counter()
        verdict: PrecompileDetail | None = None
        why = ""
        backend = inductor_backend(target.settings)
        recorder = Recorder()
        guard_state.install()
        with traced_code(target.code) as codes, self.kernels_loaded() as kernels:
            try:
                fn = aot_compile_fullgraph(
                    target.traced,
                    (args, kwargs),
                    hooks=Hooks(guard_filter_fn=recorder),
                    backend=backend,
                    dynamic=target.settings.dynamic,
                )
                entry = AOTCompiledFunction.serialize(fn).serialized_data
            except (Unsupported, UserError, UncapturedHigherOrderOpError) as exc:
                verdict, why = (
                    PrecompileDetail.GRAPH_BREAK,
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                )
            except Exception as exc:  # noqa: BLE001 - a failed precompile is a fallback, never an error
                return self.fallback(
                    PrecompileDetail.PRECOMPILE_FAILED, f"{target.name} could not be precompiled", error=exc
                )
        if verdict is None and recorder.unchecked:
            verdict, why = PrecompileDetail.UNCHECKED_VALUE, f"it reads {', '.join(recorder.unchecked[:3])}"
        seconds = time.perf_counter() - start
        if verdict is None:
            share_shape_decisions()
        # the trace (the simulator's input) sees the precompile as this key's compile; the store's
        # compile counters already count the graphs inductor compiled for it
        self.store.events.record("compile", flight.key, seconds)
        sources = code_digest.of_traced(codes)
        meta = {
            **describe.graph_meta(target.name, describe.input_shapes(pytree.tree_leaves((args, kwargs))), seconds),
            "kind": KIND_NAME,
        }
        if verdict is not None:  # the same sources trace the same way everywhere: tell the other processes
            self._publish(flight, key, Precompiled(b"", sources, seconds, verdict), meta)
            return self.fallback(verdict, f"{target.name} cannot be precompiled: {why}")
        files, missing = collect(kernels, Path(cache_dir()))  # a kernel not read is rebuilt by its receivers
        # torch pickles the compiled graphs' source as it is: the group names their collectives take are in it
        groups = rank_binding.groups_named(entry.decode("latin-1"), rank_binding.process_groups())
        artifact = Precompiled(
            entry,
            sources,
            seconds,
            files=tuple(files),
            dynamic=backend.takes_sizes,
            pins=tuple(recorder.pins),
            groups=tuple(sorted(groups.items())),
            modules=modules_installed(fn, target.globals),
            scopes=scopes_installed(target.globals),
        )
        self._publish(flight, key, artifact, meta)
        self.metrics.kernels(shipped=len(files))
        fn.disable_guard_check()
        log.info(
            "recipecache: precompiled %s in %.1f s (%d traced files, %d kernels, %d not shipped)",
            target.name,
            seconds,
            len(sources),
            len(files),
            len(missing),
        )
        variant = Variant(
            fn, target.prefix, values_of(fn, recorder.pins, target.globals), backend.takes_sizes, artifact
        )
        refused = variant.refusal(args, kwargs, loading=True)
        return (
            variant
            if refused is None
            else self.fallback(refused[0], f"{target.name}'s fresh precompile refuses its own call: {refused[1]}")
        )

    def _publish(self, flight: Flight, key: str, artifact: Precompiled, meta: dict[str, Any]) -> None:
        """Under ``key`` (the latest version) through the flight, under the key naming its sources, and for code
        with collectives under the key naming its process groups (where ranks of its groups look when ``key``
        holds another group's)."""
        blob = artifact.pack()
        versioned = versioned_key(key, artifact.sources)
        if flight.key != versioned:
            self.store.put(versioned, blob, trace=False, meta=meta)
        grouped = grouped_key(key, {role: name for name, role in artifact.groups}) if artifact.groups else None
        if grouped is not None and flight.key != grouped:
            self.store.put(grouped, blob, trace=False, meta=meta)
        if flight.key != key:
            self.store.put(key, blob, trace=False, meta=meta)
        # counted under the flight's kind: the copies above are no artifacts of their own
        flight.publish(blob, meta=meta)
        self.metrics.changed()

    def share(self, target: Target, key: str, variant: Variant, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Publish ``variant`` under ``key`` too, unless something is there: it serves that signature here without
        a lookup (a dynamic graph's guards accept the size), so no process would publish one under it otherwise.

        Which keys a process looks up depends on the order it meets signatures in (the first
        size of a dimension gets a static graph, later ones the dynamic graph's guards); a
        process that meets this signature first (a fresh rank, or a rank whose steps come in
        another order) then loads the artifact that served it here, instead of missing and
        precompiling afresh. Written only where the key is empty, so an artifact published
        under it is never replaced (who loads it gets what its producer ran); not counted as
        a put of its own (it is a copy, as the versioned copy in :meth:`_publish`).
        """
        if variant.artifact is None:
            return
        blob = variant.artifact.pack()
        meta = {
            **describe.graph_meta(target.name, describe.input_shapes(pytree.tree_leaves((args, kwargs))), 0.0),
            "kind": KIND_NAME,
        }
        self.store.update(key, lambda current: blob if current is None else None, meta=meta)
