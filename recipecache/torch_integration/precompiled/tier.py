"""The precompiled tier: fresh processes load whole compiled functions from the store instead of tracing.

With ``enable(precompile=True)``, every ``torch.compile``'d function or module answers its
calls through a :class:`Dispatcher`. For each new input signature it looks up a
precompiled artifact (:mod:`.compiled_function`): torch's ``aot_compile`` of the function with
torch's default inductor backend, i.e. dynamo's bytecode and guards plus inductor's bundled
forward and backward graphs, and the kernel libraries those load. A hit installs the
kernels and loads it (no dynamo trace, no AOTAutograd, no compiler) and runs it; a miss is
single-flighted like every artifact (:meth:`Store.begin`): one process traces and compiles
it with ``aot_compile_fullgraph`` and publishes it, the others wait and load it.

That compile is the normal path's compile, not a second one: the same backend, the same
``dynamic`` and torch's own automatic-dynamic decisions, through the store's hooks (its
AOTAutograd entry, bundled with inductor's graphs, is shared: a rank whose build meets a
graph another rank's build compiled loads it). So a cold job with the tier compiles what one
without it compiles, and the artifact runs the kernels torch would run (bitwise).
AOTInductor, the first mechanism, compiled every signature a second time on the critical
path (its own static graphs, none shared with the normal path); the measurements are in
docs/history/torch-integration-notes-to-issue-44.md ("The precompiled tier", "Shapes that vary").

Shapes that vary: sizes are in the key unless the user asked for ``dynamic=True`` (or marked
dimensions dynamic). The first size a process meets is a static graph, as in torch; once a
dimension changed, torch's automatic dynamic makes the next one a dynamic graph, whose
guards then accept every later size: the dispatcher tries the loaded variants' guards
before the store, so bucketed lengths cost a static artifact or two and one dynamic one.
At most :data:`MAX_SHAPES` lookups per compiled callable; past that a new signature runs
on the normal path (``too_many_shapes``). The metrics count how each served signature is
built (``precompile_shapes``: ``static_per_shape`` or ``dynamic``).

Never wrong, never stuck: whatever the tier cannot serve runs on the normal path
(dynamo, with the FX/AOT/PGO store hooks), counted as ``precompile_fallback`` with a
detail: code dynamo cannot trace whole (``graph_break``), published as a verdict so other
ranks do not try again; too many shapes or guard variants (guards check inputs the key does
not hold, such as a growing KV cache inside an object: where every artifact under a key rejects
a call, its next guard variant is looked up, :meth:`.dispatcher.Dispatcher._look_up`); a value
the trace read besides the inputs (a default, a closure cell,
a global, another module's or a class's attribute) that differs here, at load or since
(``value_changed``, :mod:`.traced_values`: torch's loaded guards no longer check those);
an artifact that does not load here (``load_failed``,
``incompatible``); a refused or malformed artifact; a backend other than inductor. Each
signature's decision is remembered, so a fallback is counted once, not per step.

Keys (:meth:`Dispatcher.key`): the traced function (file, qualified name, line), the
guards' inputs (every argument's dtype, device, sizes and strides, ``requires_grad``;
sizes omitted where the compile is dynamic; scalars by value; the module's parameters,
buffers and training flags; grad/inference/autocast modes), the compile settings
(backend, mode, options, dynamic; dynamo, inductor and functorch config without their
cache plumbing) and the toolchain (Python, torch build, libc, GPU name when inputs live
there). Keys are CPU keys like every artifact holding compiled CPU code
(``torch3:cpu-<host-CPU fingerprint>:precompiled:<digest>``, :meth:`GraphKeys.cpu_key
<..graphs.keys.GraphKeys.cpu_key>`; the parts of the key are :mod:`.keys`): the fingerprint (:mod:`..host_cpu`, computed once per
process) covers the compiler's view of ``-march=native`` with its version, the CPU
features torch reads and the machine. The code dynamo traced is known only
after tracing, so, as vLLM does, the artifact lists its files with digests, and a
loader checks them before torch unpickles anything. The digests are of the code the
process runs (:mod:`.code_digest`: its code objects and the globals the traced code reads), never
of the files on disk, which a shared checkout may have changed since the process
imported them: other code never loads; the lookup moves on to the key that names the
code this process runs (published next to the latest one), and a miss there is
precompiled afresh.

``torch.compile`` is wrapped only while enabled, so compile after ``enable()``. A
``DistributedDataParallel`` model runs DDP's forward eagerly around a precompiled inner
module, as dynamo itself does (it skips DDP's frames and compiles the inner forward).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...reasons import VERDICTS, PrecompileDetail, Reason
from ...store import Store
from .. import rank_binding
from ..artifact import ArtifactError, install
from ..metrics import Metrics
from . import code_digest
from .build import Builder, no_kernels
from .compiled_function import KIND_NAME, Precompiled, grouped_key, versioned_key
from .dispatcher import Dispatcher, Target
from .keys import CompileSettings
from .traced_values import install_modules, install_scopes, rebind, values_of
from .variant import Fallback, Variant

log = logging.getLogger(__name__)


class _ProducersMeshes(logging.Filter):
    """Drops, in one thread, torch's warning that an unpickled ``DeviceMesh`` names groups this process lacks."""

    MESSAGE = "It seems like pickling/unpickling of the DeviceMesh occurred before the PGs were created"

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.thread == self.thread and record.getMessage().startswith(self.MESSAGE))


@contextlib.contextmanager
def _producers_meshes_quiet() -> Iterator[None]:
    """While this thread loads an artifact: torch's guards of a DTensor module hold copies of the producer's device
    meshes (the values their expected ones are read from, pickled with the artifact), which name the producer's
    groups; unpickling one warns, five times a module, that a group is missing here. Those copies are never run
    (the code runs on the module's own meshes; the groups its code names are checked apart), so the warning says
    nothing about this process."""
    logger = logging.getLogger("torch.distributed.device_mesh")
    quiet = _ProducersMeshes()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _groups_elsewhere(found: Precompiled) -> dict[str, str] | str | None:
    """None where the code of ``found`` runs collectives on this rank's own groups only (or on none); else, for each
    role its code names, this rank's group of that role (:func:`..rank_binding.local_groups`), or why this rank
    has none."""
    if not found.groups:
        return None
    try:
        return rank_binding.local_groups(dict(found.groups), rank_binding.process_groups())
    except rank_binding.RankBound as exc:
        return str(exc)


# -- the tier ------------------------------------------------------------------------------
@dataclass
class Tier:
    """One enabled precompiled tier: the store, the counters, and what it changed in torch."""

    store: Store
    metrics: Metrics
    wait_timeout: float | None
    #: the store key of an artifact holding compiled CPU code, from the rest of its key (the
    #: graph hooks' :meth:`~..graphs.keys.GraphKeys.cpu_key`: one prefix and CPU fingerprint for all)
    cpu_key: Callable[[str], str]
    #: collects the kernel libraries this thread loads in a block (the graph hooks'
    #: :meth:`~..graphs.kernels.Kernels.kernels_loaded`): what an artifact carries beside torch's graphs
    kernels_loaded: Callable[[], AbstractContextManager[set[str]]] = no_kernels
    active: bool = True
    _original_compile: Any = None
    #: precompiles what this process leads, publishes and shares it
    builder: Builder = field(init=False)

    def __post_init__(self) -> None:
        self.builder = Builder(self.store, self.metrics, self.kernels_loaded, self.fallback)

    # -- torch.compile -------------------------------------------------------------------
    def install(self) -> None:
        original_compile = self._original_compile = torch.compile
        tier = self

        @functools.wraps(original_compile)
        def compile(model: Any = None, **kwargs: Any) -> Any:
            if isinstance(kwargs.get("options"), dict):
                kwargs["options"] = dict(kwargs["options"])  # torch pops keys off the caller's dict
            settings = CompileSettings.from_call(kwargs)
            result = original_compile(model, **kwargs)
            return result if model is None or not tier.active else tier.wrap(result, model, settings, kwargs)

        torch.compile = compile

    def uninstall(self) -> None:
        """Give torch its ``torch.compile`` back; dispatchers already handed out go to the normal path."""
        self.active = False
        if self._original_compile is not None:
            torch.compile, self._original_compile = self._original_compile, None

    def wrap(self, compiled: Any, model: Any, settings: CompileSettings, compile_kwargs: dict[str, Any]) -> Any:
        """Route ``compiled``'s calls through a Dispatcher (modules: its ``forward``; functions: a wrapper)."""
        from torch._dynamo.eval_frame import OptimizedModule

        if compile_kwargs.get("disable"):
            return compiled
        reason = settings.unsupported()
        if reason is not None:
            self.metrics.precompile_fallback(
                reason, f"torch.compile({reason} settings) cannot be precompiled; it runs on the normal path"
            )
            return compiled
        if isinstance(compiled, OptimizedModule):
            if hasattr(compiled._orig_mod, "_initialize_hook"):  # lazy modules swap their forward themselves
                self.metrics.precompile_fallback(PrecompileDetail.LAZY_MODULE, "lazy modules are not precompiled")
                return compiled
            compiled.forward = Dispatcher(self, compiled.forward, compiled._orig_mod, settings, compiled.dynamo_ctx)
            return compiled
        if not callable(compiled):
            return compiled
        if not (inspect.isfunction(model) or inspect.ismethod(model)):
            # torch's aot_compile traces functions, methods and modules only; a partial's bound arguments reach
            # the trace as constants no key or guard of the tier covers, so it is not served, counted once
            self.metrics.precompile_fallback(
                PrecompileDetail.CALLABLE,
                f"torch.compile of a {type(model).__name__} cannot be precompiled; it runs on the normal path",
            )
            return compiled
        dispatcher = Dispatcher(self, compiled, model, settings, None)

        @functools.wraps(compiled)
        def precompiled(*args: Any, **kwargs: Any) -> Any:
            return dispatcher(*args, **kwargs)

        # dynamo's innermost_fn follows this chain back to the user's function
        precompiled._torchdynamo_orig_callable = compiled  # type: ignore[attr-defined]  # dynamo's marks on a function
        precompiled._torchdynamo_wrapper_id = id(precompiled)  # type: ignore[attr-defined]  # (the same)
        return precompiled

    # -- store round trips ------------------------------------------------------------------
    def resolve(self, target: Target, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Variant | Fallback:
        """The precompiled function for ``key`` (loaded, or compiled here as the leader), or why not."""
        found = self._fetch(target, key, key, args, kwargs)
        if not isinstance(found, Precompiled):
            return found
        changed = code_digest.stale(found.sources)
        if not changed:
            return self._load_for_groups(target, key, key, found, args, kwargs)
        # another version of the code: look under the key naming this process's sources (that lookup counts)
        self.metrics.stale_sources()
        self.store.record_redirected_hit(kind=KIND_NAME)
        log.info(
            "recipecache: %s was precompiled from other code (%s); looking for the code this process runs",
            key,
            ", ".join(changed),
        )
        versioned = versioned_key(key, code_digest.current(found.sources))
        found = self._fetch_current(target, key, versioned, args, kwargs)
        if not isinstance(found, Precompiled):
            return found
        return self._load_for_groups(target, key, versioned, found, args, kwargs)

    def _load_for_groups(
        self, target: Target, key: str, lookup: str, found: Precompiled, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Variant | Fallback:
        """Load ``found`` (the artifact under ``lookup``) if the process groups its code runs collectives on are
        this rank's; else the one under the key naming this rank's groups of the same roles (a miss there: this
        rank precompiles it). torch bakes group names into the code: another group's code runs its collectives."""
        elsewhere = _groups_elsewhere(found)
        if elsewhere is None:
            return self._load(target, lookup, found, args, kwargs)
        if isinstance(elsewhere, str):
            return self._unused(lookup, Reason.RANK_BOUND, f"{target.name}'s precompiled code: {elsewhere}")
        grouped = grouped_key(key, elsewhere)
        self.store.record_redirected_hit(kind=KIND_NAME)
        log.info(
            "recipecache: %s was precompiled for other process groups; looking for this rank's (%s)",
            lookup,
            ", ".join(f"{name} {role}" for role, name in sorted(elsewhere.items())),
        )
        for_groups = self._fetch_current(target, key, grouped, args, kwargs)
        if not isinstance(for_groups, Precompiled):
            return for_groups
        elsewhere = _groups_elsewhere(for_groups)
        if elsewhere is not None:
            return self._unused(grouped, Reason.RANK_BOUND, f"{grouped} names other process groups ({elsewhere})")
        return self._load(target, grouped, for_groups, args, kwargs)

    def _fetch_current(
        self, target: Target, key: str, lookup: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Precompiled | Variant | Fallback:
        """:meth:`_fetch` of a key that names the code this process runs (its versioned or per-group key): an
        artifact there built from other code is not used (``source_changed``), never looked past."""
        found = self._fetch(target, key, lookup, args, kwargs)
        if isinstance(found, Precompiled) and code_digest.stale(found.sources):
            return self._unused(
                lookup, PrecompileDetail.SOURCE_CHANGED, f"{lookup} does not match the code this process runs"
            )
        return found

    def _fetch(
        self, target: Target, key: str, lookup: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Precompiled | Variant | Fallback:
        """The artifact under ``lookup``, or (a miss: this process leads) the result of compiling it."""
        flight = self.store.begin(lookup, wait_timeout=self.wait_timeout, kind=KIND_NAME)
        if flight.waited_s:
            self.metrics.changed()
        if flight.data is None:
            return self.builder.lead(target, key, flight, args, kwargs)
        try:
            return Precompiled.unpack(flight.data)
        except ArtifactError as exc:
            return self._unused(lookup, Reason.BAD_ARTIFACT, f"{lookup}: {exc}")

    def _load(
        self, target: Target, key: str, stored: Precompiled, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Variant | Fallback:
        if stored.unsupported is not None:
            if stored.unsupported not in VERDICTS:  # a verdict no version of the tier publishes
                return self._unused(key, Reason.BAD_ARTIFACT, f"{key}: unknown verdict {stored.unsupported!r}")
            return self._unused(
                key,
                PrecompileDetail(stored.unsupported),
                f"{target.name} cannot be precompiled ({stored.unsupported}, found by the process that tried)",
            )
        start = time.perf_counter()
        try:
            fn = self._deserialize(stored, target)
        except Exception as exc:  # noqa: BLE001 - whatever torch raises while loading, training goes on
            detail = (
                PrecompileDetail.INCOMPATIBLE
                if "was created with a different" in str(exc)
                else PrecompileDetail.LOAD_FAILED
            )
            return self._unused(key, detail, f"{target.name}: {key} does not load here", error=exc)
        log.info("recipecache: loaded precompiled %s in %.3f s", target.name, time.perf_counter() - start)
        variant = Variant(fn, target.prefix, values_of(fn, stored.pins, target.globals), stored.dynamic, stored)
        refused = variant.refusal(args, kwargs, loading=True)
        if refused is not None and refused[0] is not PrecompileDetail.GUARD_FAILED:
            return self._unused(key, refused[0], f"{target.name}'s precompiled artifact: {refused[1]}")
        # guards that reject this call leave it loaded: it serves the calls it was built for, and the
        # dispatcher looks for this call's guard variant
        self.metrics.saved(stored.compile_s)
        return variant

    def _deserialize(self, stored: Precompiled, target: Target) -> Any:
        """torch's AOTCompiledFunction from a verified artifact, its kernels installed first (so loading builds none)."""
        from torch._dynamo.aot_compile import AOTCompiledFunction
        from torch._inductor.runtime.runtime_utils import cache_dir

        self.metrics.kernels(installed=install(stored.files, Path(cache_dir())))
        install_modules(stored.modules, target.globals)
        install_scopes(stored.scopes, target.globals)
        with _producers_meshes_quiet():
            fn = AOTCompiledFunction.deserialize(bytes(stored.entry), target.globals)
        fn.disable_guard_check()  # the dispatcher checks them once per call
        rebind(fn, target.function)
        return fn

    def _unused(
        self, key: str, detail: PrecompileDetail | Reason, message: str, *, error: BaseException | None = None
    ) -> Fallback:
        """The artifact (or verdict) served under ``key`` cannot serve this call: the store's hit becomes a miss
        (``bad_artifact``, else ``precompile_fallback``: the detail is counted here), and the call a fallback."""
        reason = Reason.BAD_ARTIFACT if detail is Reason.BAD_ARTIFACT else Reason.PRECOMPILE_FALLBACK
        self.store.record_unused_hit(key, reason, kind=KIND_NAME)
        return self.fallback(detail, message, error=error)

    def fallback(
        self,
        detail: PrecompileDetail | Reason,
        message: str,
        *,
        counted_by_store: bool = False,
        error: BaseException | None = None,
    ) -> Fallback:
        """Count a call signature the tier sends to the normal path (warned once per ``detail``).

        ``counted_by_store``: ``detail`` is the reason of a fallback flight, which the store
        counted as its fallback (:meth:`Metrics.precompile_fallback`). ``error``: the exception
        behind it, whose type and message the metrics keep beside the detail.
        """
        if error is not None:
            log.debug("recipecache: %s", message, exc_info=error)
        self.metrics.precompile_fallback(
            detail, f"{message}; it runs on the normal path", counted_by_store=counted_by_store, error=error
        )
        return Fallback(detail)


def attach(
    store: Store,
    metrics: Metrics,
    wait_timeout: float | None,
    cpu_key: Callable[[str], str],
    kernels_loaded: Callable[[], AbstractContextManager[set[str]]] = no_kernels,
) -> Tier:
    """Wrap ``torch.compile`` (until :meth:`Tier.uninstall`); the graph hooks must be attached already.

    ``cpu_key`` is theirs (:meth:`~..graphs.keys.GraphKeys.cpu_key`), so precompiled functions
    are keyed by the same prefix and host-CPU fingerprint as the graphs; so is
    ``kernels_loaded`` (:meth:`~..graphs.kernels.Kernels.kernels_loaded`), which tells a build
    which kernel libraries its artifact must carry.
    """
    tier = Tier(store, metrics, wait_timeout, cpu_key, kernels_loaded)
    tier.install()
    log.info("recipecache: precompiled tier on (torch.compile'd functions load from %s)", store.url)
    return tier
