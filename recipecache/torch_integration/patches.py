"""The patch table: what enable() changes in torch, how it is put back, and the backend classes torch builds.

torch builds its remote-cache backends itself, with no arguments, so they find the
enabled :class:`~.graphs.integration.Integration` through this module's ``_active``; every wrapper
here does torch's own work and hands what it learned to that integration's parts, which know
keys, flights and artifacts (:mod:`.graphs.integration`). Which hooks are installed is
:mod:`.compat`'s call; the table is grouped by its hook names, each entry one
``(owner, attribute, new value)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo.config as dynamo_config
import torch._dynamo.pgo as dynamo_pgo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._functorch._aot_autograd import graph_compile
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
from torch._inductor import codecache, compile_fx, cpu_vec_isa, remote_cache
from torch._inductor.cpu_vec_isa import VecISA

from ..reasons import Reason
from ..store import Store
from . import compat, deferral, describe, every_thread, rank_binding
from .graphs.integration import Integration
from .metrics import Metrics

if TYPE_CHECKING:
    from .no_stall.controller import NoStall

log = logging.getLogger(__name__)

#: job id enable() gives torch when none is set (PGO does nothing without one)
JOB_ID = "recipecache"

#: stands for "the class had no attribute of its own" among the originals install() saves
_INHERITED = object()

_active: Integration | None = None
#: (owner, attribute, value before enable()) of every patch installed, in installation order
_originals: list[tuple[Any, str, Any]] = []
#: (config entry, its every-thread value before enable()) of every setting hook ``every_thread`` made
_defaults: list[tuple[Any, Any]] = []


#: one change enable() makes in torch: (owner, attribute, new value)
Patch = tuple[Any, str, Any]


def table(integration: Integration, on: Collection[str]) -> list[Patch]:
    """(owner, attribute, new value) for everything enable() changes in torch, for the hooks ``on``.

    ``on``: names of :data:`.compat.HOOKS` whose interface this torch has. The originals
    of the others may be missing (None here); their wrappers are never installed. Every
    group is built (each resolves the torch attributes it names), then those of ``on`` kept.
    """
    groups: dict[str, list[Patch]] = {
        "compile_scope": _compile_scope(integration),
        "graphs": _graphs(integration),
        "autograd": _autograd(integration),
        "pgo": _pgo(integration, on),
        "kernels": _kernels(integration),
        "precompiled_header": _precompiled_header(integration),
        "cpu_probes": _cpu_probes(integration),
        "autotune": _autotune(),
        "compile_count": _compile_count(integration),
        "overlap": _overlap(integration),
        "key_records": _key_records(integration),
    }
    return [patch for name, patches in groups.items() if name in on for patch in patches]


def _compile_scope(integration: Integration) -> list[Patch]:
    """Hook ``compile_scope``: each ``_compile_fx_inner`` runs in the graph's cache scope, and a graph deferred inside
    it (no-stall, overlap) comes back as its stand-in, which compiles it again later."""
    original_inner: Any = getattr(compile_fx, "_compile_fx_inner", None)

    def run_inner(*args: Any, **kwargs: Any) -> Any:
        integration.guarded(integration.leases.end_attempt)
        scope = integration.guarded(integration.kernels.graph_cache_scope, args[0] if args else kwargs.get("gm"))
        try:
            with scope or contextlib.nullcontext():
                return original_inner(*args, **kwargs)
        finally:
            integration.guarded(integration.leases.end_attempt)

    def _compile_fx_inner(*args: Any, **kwargs: Any) -> Any:
        no_stall = integration.no_stall
        if no_stall is None and not integration.overlap.enabled:
            return run_inner(*args, **kwargs)
        # a stand-in's loads run this compile again (a hit then), on these inputs or a backward's restrided ones
        gm, example_inputs, rest = args[0], list(args[1]), args[2:]

        def compile_with(inputs: list[Any]) -> Any:
            return run_inner(gm, inputs, *rest, **kwargs)

        if no_stall is not None and kwargs.get("is_backward"):
            awaiting = integration.guarded(no_stall.awaiting_forward, gm, example_inputs, compile_with)
            if awaiting is not None:  # its forward is compiled behind: neither looked up nor compiled yet
                return awaiting
        try:
            with integration.overlap.may_defer(kwargs):
                return run_inner(*args, **kwargs)
        except Exception as exc:
            deferred = deferral.deferred_of(exc)
            if deferred is None:
                raise
            if no_stall is not None:  # no-stall: eager meanwhile
                return no_stall.graph(
                    deferred, compile_with, gm, example_inputs, backward=bool(kwargs.get("is_backward"))
                )
            # overlap: waits at its first call
            return integration.overlap.waiting_graph(deferred, functools.partial(compile_with, example_inputs))

    return [(compile_fx, "_compile_fx_inner", _compile_fx_inner)]


def _graphs(integration: Integration) -> list[Patch]:
    """Hook ``graphs``: the FX graph cache's remote tier is the store, and torch's guards see every stored variant."""
    original_iterate: Any = getattr(getattr(codecache.FxGraphCache, "iterate_over_candidates", None), "__func__", None)
    # how torch names a graph in a remote cache
    remote_key: Any = getattr(remote_cache.RemoteFxGraphCache, "_get_key", None)

    def iterate_over_candidates(cls: type, local: bool, remote: Any, key: str) -> Iterator[tuple[Any, bytes, bool]]:
        ours = remote is not None and isinstance(remote.backend, FxBackend)
        yield from original_iterate(cls, local, None if ours else remote, key)  # local candidates first
        if ours:
            yield from integration.graphs.fx_candidates(remote_key(remote, key))

    return [
        (inductor_config, "fx_graph_remote_cache", True),
        (remote_cache.RemoteFxGraphCache, "backend_override_cls", FxBackend),
        # torch reads one remote entry per graph key; this offers its guards every stored variant
        (codecache.FxGraphCache, "iterate_over_candidates", classmethod(iterate_over_candidates)),
    ]


def _autograd(integration: Integration) -> list[Patch]:
    """Hook ``autograd``: AOTAutograd's remote cache is the store; graphs taking a device mesh get keys every job
    shares."""
    original_reduce_fake: Any = getattr(codecache.FxGraphCachePickler, "_reduce_fake_script_object", None)

    def reduce_fake_script_object(pickler: Any, fake: Any) -> Any:
        """torch's keys of graphs taking a device mesh: the mesh as what the code depends on, the same in every job
        (:func:`.rank_binding.rank_mesh_reduction`); AOTAutograd's entries of those graphs then hit in later jobs."""
        real = object.__getattribute__(fake, "real_obj")
        reduced = integration.guarded(rank_binding.rank_mesh_reduction, real) if rank_binding.is_mesh(real) else None
        return original_reduce_fake(pickler, fake) if reduced is None else reduced

    return [
        (functorch_config, "enable_remote_autograd_cache", True),
        (remote_cache.RemoteAOTAutogradCache, "backend_override_cls", AotBackend),
        (codecache.FxGraphCachePickler, "_reduce_fake_script_object", reduce_fake_script_object),
    ]


def _pgo(integration: Integration, on: Collection[str]) -> list[Patch]:
    """Hook ``pgo``: dynamo's profile-guided dynamism travels through the store (under a job id, set if none is).

    A frame's first trace at the sizes the job that learned its decision traced static first is traced static
    again, not dynamic as the shared decision says (:class:`.graphs.pgo.Replay`): that job's graphs, in its order.
    """
    original_update: Any = getattr(dynamo_pgo, "update_automatic_dynamic", None)

    def replayed(tx: Any, name: str, entry: Any, decided: Any) -> Any:
        code_id = dynamo_pgo.CodeId.make(tx.f_code, tx.closure)  # as torch names the frame's state
        return integration.side_caches.pgo_replay.entry_for(code_id, name, entry, decided)

    def update_automatic_dynamic(tx: Any, name: str, entry: Any, **kwargs: Any) -> Any:
        decided = original_update(tx, name, entry, **kwargs)  # reads the shared state at the process's first trace
        if getattr(tx, "distributed_state", None) is not None:  # compiler collectives decide across ranks
            return decided
        replay = integration.guarded(replayed, tx, name, entry, decided)
        return decided if replay is None else replay

    return [
        (dynamo_config, "automatic_dynamic_remote_pgo", True),
        (remote_cache.RemoteDynamoPGOCache, "backend_override_cls", PgoBackend),
        (dynamo_pgo, "update_automatic_dynamic", update_automatic_dynamic),
        *([(torch.compiler.config, "job_id", JOB_ID)] if "pgo" in on and torch.compiler.config.job_id is None else []),
    ]


def _kernels(integration: Integration) -> list[Patch]:
    """Hook ``kernels``: every kernel source torch writes is recorded, to ship with the graph that built it."""
    original_write: Any = getattr(codecache, "write", None)

    def write(content: Any, extension: str, *args: Any, **kwargs: Any) -> tuple[str, str]:
        result = original_write(content, extension, *args, **kwargs)
        integration.guarded(integration.kernels.record_write, extension, result[1])
        return result

    return [(codecache, "write", write)]


def _precompiled_header(integration: Integration) -> list[Patch]:
    """Hook ``precompiled_header``: the header is skipped for a kernel already built (and built in the background)."""
    original_precompile_header: Any = getattr(codecache, "_precompile_header", None)

    def _precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        if integration.guarded(integration.kernels.kernel_is_built):
            # nothing is compiled against it: torch loads the library as it is. Should a
            # build happen after all, -include of the plain header is still correct.
            integration.guarded(
                integration.kernels.warm_header,
                lambda: original_precompile_header(header, hashable_cmd_line, **compile_command),
                (header, hashable_cmd_line, frozenset(compile_command.items())),
            )
            return header
        return original_precompile_header(header, hashable_cmd_line, **compile_command)

    return [
        # part of the FX key, so it must be equal on every rank: torch's default, whose
        # precompiled header makes every cold kernel's g++ fast (a hit skips the header)
        (inductor_config, "cpp_cache_precompile_headers", True),
        (codecache, "_precompile_header", _precompile_header),
    ]


def _cpu_probes(integration: Integration) -> list[Patch]:
    """Hook ``cpu_probes``: the CPU-feature probe libraries are shared through the store, probed in rank order."""
    original_check_build: Any = getattr(VecISA, "check_build", None)
    original_valid_isas: Any = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    original_probe_load: Any = getattr(VecISA, "_probe_load", None)

    def check_build(isa: VecISA, code: str) -> bool:
        integration.guarded(integration.probes.install_isa_probe)
        return integration.probes.probe(original_check_build, isa, code)

    def _probe_load(isa: VecISA, output_path: str) -> bool:
        return integration.probes.probe_load(original_probe_load, isa, output_path)

    def valid_vec_isa_list() -> list[VecISA]:
        integration.guarded(integration.probes.probe_cpu_in_rank_order)
        return original_valid_isas()

    return [
        (VecISA, "check_build", check_build),
        (VecISA, "_probe_load", _probe_load),
        (cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list),
    ]


def _autotune() -> list[Patch]:
    """Hook ``autotune``: a GPU kernel's runtime autotuning result travels through the store."""
    return [
        # a fresh node loads it instead of benchmarking every config again at its first call
        # (its FX hit ships the kernels, not their choice)
        (inductor_config, "autotune_remote_cache", True),
        (remote_cache.RemoteAutotuneCache, "backend_override_cls", AutotuneBackend),
    ]


def _compile_count(integration: Integration) -> list[Patch]:
    """Hook ``compile_count``: each inductor compile is timed and counted; a graph that missed may be deferred here."""
    original_codegen: Any = getattr(compile_fx, "fx_codegen_and_compile", None)

    def fx_codegen_and_compile(*args: Any, **kwargs: Any) -> Any:
        if integration.no_stall is not None or integration.overlap.enabled:
            deferred = integration.guarded(integration.defer, args, kwargs)
            if deferred is not None:
                raise deferred  # _compile_fx_inner returns the graph's stand-in (no-stall's, or overlap's)
        start = time.perf_counter()
        try:
            return original_codegen(*args, **kwargs)
        finally:
            integration.guarded(integration.graphs.compiled, time.perf_counter() - start)

    return [(compile_fx, "fx_codegen_and_compile", fx_codegen_and_compile)]


def _overlap(integration: Integration) -> list[Patch]:
    """Hook ``overlap``: a forward's output strides are published once lowered, a backward is compiled ahead after a
    forward left for its first call, and AOTAutograd's entries naming a waiting graph are saved once it loads."""
    original_lowered: Any = getattr(compile_fx, "_check_triton_bf16_support", None)
    original_backward_stage: Any = getattr(graph_compile, "_aot_stage2b_bw_compile", None)
    original_cache_info: Any = getattr(graph_compile, "_cache_autograd_info", None)

    def _check_triton_bf16_support(graph: Any) -> None:
        """Called by ``fx_codegen_and_compile`` right after inductor lowered the graph, before its kernels are
        built: where a forward's leader publishes its output strides (overlap: :meth:`.graphs.overlap.Overlap.lowered`)."""
        integration.guarded(integration.overlap.lowered, graph)
        original_lowered(graph)

    def _aot_stage2b_bw_compile(*args: Any, **kwargs: Any) -> Any:
        """AOTAutograd's backward stage, which leaves the backward's compile to its first call (after the forward
        ran) unless told otherwise: after a forward left for its first call (overlap, :meth:`.graphs.overlap.Overlap.backward_now`)
        the backward is compiled now, by torch's own eager path (the one it takes for backwards that save sizes);
        should that raise, the stage runs again as torch's default, the backward compiled at its first call."""
        bound = inspect.signature(original_backward_stage).bind(*args, **kwargs)
        if integration.no_stall is not None:
            integration.guarded(integration.no_stall.backward_stage, original_backward_stage, bound.arguments)
        if not integration.guarded(integration.overlap.backward_now):
            return original_backward_stage(*args, **kwargs)
        aot_config = bound.arguments["aot_config"]
        bound.arguments["aot_config"] = dataclasses.replace(aot_config, force_non_lazy_backward_lowering=True)
        try:
            return original_backward_stage(*bound.args, **bound.kwargs)
        except Exception as exc:
            log.debug("recipecache: compiling a backward ahead failed", exc_info=True)
            integration.metrics.fallback(
                Reason.HOOK_ERROR, f"compiling a backward ahead failed ({exc!r}); torch compiles it at its first call"
            )
            return original_backward_stage(*args, **kwargs)

    def _cache_autograd_info(*args: Any, **kwargs: Any) -> Any:
        """AOTAutograd's cache entry of a compile: saved now, or (the backward compiled lazily) after that compile.
        An entry naming a stand-in for a graph compiled later (:class:`.deferral.StandIn`: overlap's graph waiting
        for its first call, no-stall's running without inductor) is saved once that graph is loaded: the entry names
        the loaded graph's key and guards."""
        bound = inspect.signature(original_cache_info).bind(*args, **kwargs)
        forward = deferral.stand_in_of(bound.arguments["compiled_fw_func"])
        backward_func = bound.arguments["compiled_bw_func"]
        backward = deferral.stand_in_of(backward_func)
        if forward is None and backward is None:
            try_save, entry = original_cache_info(*args, **kwargs)
            return (None if try_save is None else _saving_when_loaded(try_save, [])), entry
        if forward is not None:
            bound.arguments["compiled_fw_func"] = forward  # its key and guards are read from what it loads
        bound.arguments["compiled_bw_func"] = None  # the stage saves nothing itself: its saving function follows
        try_save, entry = original_cache_info(*bound.args, **bound.kwargs)
        if try_save is None or backward_func is None:  # nothing to save; or the backward compiles lazily
            return (None if try_save is None else _saving_when_loaded(try_save, [forward] if forward else [])), entry
        arguments = (
            backward or backward_func,
            bound.arguments["bw_module"],
            bound.arguments["fw_metadata"],
            bound.arguments["aot_config"],
        )
        waiting = [g for g in (forward, backward) if g is not None]
        return None, deferral.save_when_loaded(functools.partial(try_save, *arguments), waiting)

    def _saving_when_loaded(try_save: Any, waiting: list[deferral.StandIn]) -> Any:
        """AOTAutograd's function saving an entry after a lazy backward compile, which may give a stand-in."""

        def save(compiled_bw_func: Any, *rest: Any) -> Any:
            backward = deferral.stand_in_of(compiled_bw_func)
            graphs = [*waiting, *([backward] if backward is not None else [])]
            return deferral.save_when_loaded(functools.partial(try_save, backward or compiled_bw_func, *rest), graphs)

        return save

    return [
        (compile_fx, "_check_triton_bf16_support", _check_triton_bf16_support),
        (graph_compile, "_aot_stage2b_bw_compile", _aot_stage2b_bw_compile),
        (graph_compile, "_cache_autograd_info", _cache_autograd_info),
    ]


def _key_records(integration: Integration) -> list[Patch]:
    """Hook ``key_records``: what each FX key is made of is recorded beside the event log."""
    original_hash: Any = getattr(codecache, "compiled_fx_graph_hash", None)

    def compiled_fx_graph_hash(*args: Any, **kwargs: Any) -> tuple[str, list[str]]:
        key, details = original_hash(*args, **kwargs)
        integration.guarded(integration.keys.describe_key, key, details, args, kwargs)
        return key, details

    return [(codecache, "compiled_fx_graph_hash", compiled_fx_graph_hash)]


def _install(integration: Integration, on: frozenset[str]) -> None:
    """Install the hooks named in ``on`` (those whose interface this torch has, :func:`.compat.states`)."""
    integration.on = on
    integration.overlap.enabled = "overlap" in on and integration.wait_for_lease
    integration.keys.binds_ranks = "rank_binding" in on
    patches = table(integration, on)  # resolves every torch attribute before anything changes
    for owner, name, value in patches:
        # a class's own attribute as stored (a classmethod stays one); an inherited one is deleted again
        original = vars(owner).get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)
        _originals.append((owner, name, original))
        setattr(owner, name, value)  # this thread's setting: it wins over one the user made here before
        entry = every_thread.entry(owner, name) if "every_thread" in on else None
        if entry is not None:
            _defaults.append((entry, every_thread.swap_default(entry, value)))
    if "autograd" in on:
        # functools.cache'd: it may hold a backend (or None) from before the override
        AOTAutogradCache.get_remote_cache.cache_clear()
    integration.metrics.follow_local_hits(describe.local_hits)
    if "cpu_probes" in on:
        integration.guarded(integration.probes.install_isa_probe)


def _uninstall(integration: Integration) -> None:
    if integration.no_stall is not None:
        integration.guarded(integration.no_stall.close)
    integration.close()
    for entry, before in reversed(_defaults):
        every_thread.swap_default(entry, before)
    _defaults.clear()
    for owner, name, value in reversed(_originals):
        if value is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    _originals.clear()
    if "autograd" in integration.on:
        AOTAutogradCache.get_remote_cache.cache_clear()


class _StoreBackend(remote_cache.RemoteCacheBackend[bytes]):
    """What torch's RemoteCache calls. torch builds these itself, so they hold no state."""

    kind = ""

    @staticmethod
    def _caches(integration: Integration) -> Any:
        """The part of ``integration`` that gets and puts this kind (``<kind>_get``, ``<kind>_put``)."""
        return integration.side_caches

    def _get(self, key: str) -> bytes | None:
        integration = _active
        if integration is None:
            return None
        return integration.guarded(getattr(self._caches(integration), f"{self.kind}_get"), key)

    def _put(self, key: str, data: bytes) -> None:
        integration = _active
        if integration is not None:
            integration.guarded(getattr(self._caches(integration), f"{self.kind}_put"), key, data)


class FxBackend(_StoreBackend):
    """Publishes graphs; lookups go through :meth:`.graphs.fx.GraphFlights.fx_candidates`, so torch's guards see every
    variant."""

    kind = "fx"

    @staticmethod
    def _caches(integration: Integration) -> Any:
        return integration.graphs

    def _get(self, key: str) -> bytes | None:
        return None


class AotBackend(_StoreBackend):
    kind = "aot"


class PgoBackend(_StoreBackend):
    kind = "pgo"


class AutotuneBackend(_StoreBackend):
    kind = "autotune"


def attach(
    store: Store,
    metrics: Metrics,
    wait_timeout: float | None,
    on: Collection[str],
    *,
    no_stall: NoStall | None = None,
    wait_for_lease: bool = True,
) -> Integration:
    """Hook torch up to the stores with the hooks ``on`` (see :mod:`.compat`); nothing changed if it raises.

    ``no_stall``: graphs that miss compile behind the steps there (no-stall ranks, which never wait for
    another process's compile); ``wait_for_lease=False``: never wait either (the no-stall worker).
    """
    global _active
    integration = Integration(store, metrics, wait_timeout, no_stall=no_stall, wait_for_lease=wait_for_lease)
    _active = integration
    try:
        _install(integration, frozenset(on))
    except BaseException:
        _active = None
        _uninstall(integration)
        raise
    return integration


def detach() -> None:
    global _active
    if _active is not None:
        integration, _active = _active, None
        _uninstall(integration)


@contextlib.contextmanager
def hooked_for_worker(store: Store, metrics: Metrics, wait_timeout: float | None) -> Iterator[Integration]:
    """torch hooked up for one compile of a no-stall worker (:mod:`.no_stall.worker`, which gets this function by
    name with each job, :data:`.no_stall.controller.HookUp`): every hook this torch fits but the precompiled tier,
    never waiting for another process's lease; unhooked at the end."""
    on = {state.hook.name for state in compat.states() if state.on} - {"precompiled"}
    integration = attach(store, metrics, wait_timeout, on, wait_for_lease=False)
    try:
        yield integration
    finally:
        detach()


def finish_no_stall() -> None:
    """At exit: let no-stall compiles in flight finish and publish, within the exit grace (:meth:`.no_stall.controller.NoStall.finish`)."""
    if _active is not None and _active.no_stall is not None:
        _active.guarded(_active.no_stall.finish, _active.no_stall.exit_grace)


def release_leases() -> None:
    """Free the leases of compiles still running at interpreter exit, so waiters need not wait for the TTL."""
    if _active is not None:
        _active.leases.release_all()
