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
docs/torch-integration-notes.md ("The precompiled tier", "Shapes that vary").

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
ranks do not try again; too many shapes; guards that reject the inputs
(``guard_failed``); a value the trace read besides the inputs (a default, a closure cell,
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
(``torch3:cpu-<host-CPU fingerprint>:precompiled:<digest>``, :meth:`Integration.cpu_key
<..graphs.hooks.Integration.cpu_key>`; the parts of the key are :mod:`.keys`): the fingerprint (:mod:`..host_cpu`, computed once per
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
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from ...keys import make_key
from ...reasons import REFUSED, VERDICTS, PrecompileDetail, PrecompileShapes, Reason
from ...store import Flight, Store
from .. import describe, rank_binding
from ..artifact import ArtifactError, collect, install
from ..metrics import Metrics
from . import code_digest, guard_state
from .compiled_function import Precompiled, grouped_key, versioned_key
from .keys import (
    CompileSettings,
    call_key,
    devices_fingerprint,
    key_signature,
    module_state,
    signature,
    toolchain,
    traced_code,
)
from .traced_values import Recorder, Values, install_modules, modules_installed, rebind, values_of

log = logging.getLogger(__name__)

#: what follows the integration's CPU-key prefix in the tier's store keys
KEY_KIND = "precompiled:"
#: what ``recipecache ls`` calls a precompiled artifact (the ``kind`` of its envelope meta), and the kind the
#: store counts its lookups and puts under
KIND_NAME = "precompiled"


class Fallback:
    """A signature the tier does not serve: it runs on dynamo's normal path."""

    __slots__ = ("detail",)

    def __init__(self, detail: PrecompileDetail | Reason) -> None:
        self.detail = detail


@dataclass
class Variant:
    """A loaded (or just compiled) precompiled function; ``prefix`` is its bound ``self``, if any."""

    fn: Any
    prefix: tuple[Any, ...]
    #: the values its code was traced with besides the inputs, checked against this process's
    values: Values
    #: its graph takes sizes as inputs (its guards serve many sizes)
    dynamic: bool = False
    #: the artifact it was loaded from or built as (what :meth:`Tier.share` publishes again)
    artifact: Precompiled | None = None

    def refusal(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, loading: bool = False
    ) -> tuple[PrecompileDetail, str] | None:
        """Why it must not serve this call (a traced value changed, its guards reject the inputs), or None.

        ``loading``: it has not served yet, so every traced value is compared; after that, those
        torch's guards do not check (torch's guards then hold the traced values for the rest).
        """
        changed = self.values.changed(lambda: self.fn.prepare_f_locals(*self.prefix, *args, **kwargs), every=loading)
        if changed is not None:
            return PrecompileDetail.VALUE_CHANGED, changed
        if not self.fn.guard_check(*self.prefix, *args, **kwargs):
            return PrecompileDetail.GUARD_FAILED, "its guards reject these inputs"
        return None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.values.refresh(self.fn)
        return self.fn(*self.prefix, *args, **kwargs)

    @property
    def shapes(self) -> PrecompileShapes:
        return PrecompileShapes.DYNAMIC if self.dynamic else PrecompileShapes.STATIC_PER_SHAPE


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


#: signatures one compiled callable looks up in the store (train and eval are two per size). A
#: dynamic artifact answers the sizes after the first few without a lookup; a callable that meets
#: more distinct signatures anyway (say, one whose guards reject each other) runs the rest on the
#: normal path rather than asking the store on every new one
MAX_SHAPES = 16


def no_kernels() -> AbstractContextManager[set[str]]:
    """What :attr:`Tier.kernels_loaded` is without the graph hooks' kernel log: nothing collected."""
    return nullcontext(set())


#: device types the tier precompiles for: on CUDA (H200, torch 2.11) a cold ``aot_compile``
#: died of a segmentation fault, which no fallback can catch (docs/torch-integration-notes.md)
CHECKED_DEVICES = frozenset({"cpu"})


def unchecked_devices(target: Target, sig: tuple[Any, ...]) -> set[str]:
    """Device types of the inputs, parameters and buffers of a call that the tier was not checked on."""
    devices = {leaf[3].split(":")[0] for leaf in sig[1] if leaf[0] == "tensor"}
    owner = target.prefix[0] if target.prefix else None
    if isinstance(owner, torch.nn.Module):
        devices |= {t.device.type for t in itertools.chain(owner.parameters(), owner.buffers())}
    return devices - CHECKED_DEVICES


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
    #: graph hooks' :meth:`~..graphs.hooks.Integration.cpu_key`: one prefix and CPU fingerprint for all)
    cpu_key: Callable[[str], str]
    #: collects the kernel libraries this thread loads in a block (the graph hooks'
    #: :meth:`~..graphs.hooks.Integration.kernels_loaded`): what an artifact carries beside torch's graphs
    kernels_loaded: Callable[[], AbstractContextManager[set[str]]] = no_kernels
    active: bool = True
    _original_compile: Any = None

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
            return self._lead(target, key, flight, args, kwargs)
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
        if refused is not None:
            return self._unused(key, refused[0], f"{target.name}'s precompiled artifact: {refused[1]}")
        self.metrics.saved(stored.compile_s)
        return variant

    def _deserialize(self, stored: Precompiled, target: Target) -> Any:
        """torch's AOTCompiledFunction from a verified artifact, its kernels installed first (so loading builds none)."""
        from torch._dynamo.aot_compile import AOTCompiledFunction
        from torch._inductor.runtime.runtime_utils import cache_dir

        self.metrics.kernels(installed=install(stored.files, Path(cache_dir())))
        install_modules(stored.modules, target.globals)
        with _producers_meshes_quiet():
            fn = AOTCompiledFunction.deserialize(bytes(stored.entry), target.globals)
        fn.disable_guard_check()  # the dispatcher checks them once per call
        rebind(fn, target.function)
        return fn

    def _lead(
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


@dataclass
class Target:
    """What one precompiled function stands in for: the callable dynamo traces and how to call it."""

    #: what ``aot_compile_fullgraph`` traces: a module (its forward, or __call__ with hooks), a function, a method
    traced: Any
    settings: CompileSettings
    #: the traced function (whose defaults and closure cells a loaded artifact takes), its code (its identity
    #: in the key) and globals (where its bytecode runs)
    function: Any = None
    code: Any = None
    globals: dict[str, Any] = field(default_factory=dict)
    #: the bound ``self`` the precompiled function takes first, if any
    prefix: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        from torch._dynamo.convert_frame import get_traced_fn

        fn, bound = get_traced_fn(self.traced)
        self.function, self.code, self.globals = fn, fn.__code__, fn.__globals__
        self.prefix = () if bound is None else (bound,)

    @property
    def name(self) -> str:
        return getattr(self.code, "co_qualname", self.code.co_name)


class Dispatcher:
    """Stands in for one ``torch.compile``'d callable: precompiled variants first, dynamo otherwise.

    ``normal`` is what torch.compile returned (the dynamo path). Per call it reads the
    guard inputs it can read cheaply (:func:`call_key`, whose :func:`signature` it reads once
    per distinct key: the store key's form, several times slower); a signature seen before goes
    straight to its variant (whose guards are still checked) or to the normal path. A
    new one is resolved once, under a lock: a loaded variant whose guards accept it (a
    dynamic compile serves many sizes), else the store.
    """

    def __init__(
        self, tier: Tier, normal: Callable[..., Any], subject: Any, settings: CompileSettings, dynamo_ctx: Any
    ) -> None:
        self.tier = tier
        self.normal = normal
        self.subject = subject
        self.settings = settings
        self.dynamo_ctx = dynamo_ctx
        self._lock = threading.RLock()
        self._decided: dict[tuple[Any, ...], Variant | Fallback] = {}
        #: each call key's signature (:func:`call_key`: the signature is read once per call key, not per call)
        self._signatures: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        #: signatures read for calls (one per distinct call key)
        self.signatures_read = 0
        self._variants: list[Variant] = []
        #: the variants by store key
        self._loaded: dict[str, Variant] = {}
        #: store keys looked up (each a precompile on a cold store), at most MAX_SHAPES
        self._looked_up: set[str] = set()
        self._targets: dict[int, Target] = {}
        #: DDP's inner module and the forward routed through the tier that DDP calls
        self._inner_forward: tuple[Any, Callable[..., Any]] | None = None
        self._ddp = isinstance(subject, DistributedDataParallel)
        self.__wrapped__ = normal

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.tier.active or torch.compiler.is_compiling():
            return self.normal(*args, **kwargs)
        if self._ddp:
            return self._call_ddp(self.subject, args, kwargs)
        return self.run(self.subject, args, kwargs, self.normal)

    def run(self, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any], normal: Callable[..., Any]) -> Any:
        try:
            call = call_key(subject, args, kwargs)
            sig = self._signatures.get(call)
            if sig is None:
                sig = self._signatures[call] = signature(subject, args, kwargs)
                self.signatures_read += 1
            decided = self._decided.get(sig)
            if decided is None:
                decided = self._resolve(subject, sig, args, kwargs)
            elif isinstance(decided, Variant):
                refused = decided.refusal(args, kwargs)
                if refused is not None:
                    decided = self._reject(sig, *refused)
        except Exception as exc:  # a bug of ours must not stop training
            log.debug("recipecache: precompiled dispatch failed", exc_info=True)
            self.tier.metrics.fallback(Reason.HOOK_ERROR, f"precompiled dispatch: {exc!r}; torch goes on without it")
            decided = Fallback(Reason.HOOK_ERROR)
        if isinstance(decided, Variant):
            return decided(args, kwargs)
        return normal(*args, **kwargs)

    def _reject(self, sig: tuple[Any, ...], detail: PrecompileDetail, why: str) -> Fallback:
        """A variant refused a signature it had served (an input the key does not cover, or a traced value, changed)."""
        with self._lock:
            decided = self._decided[sig] = self.tier.fallback(
                detail, f"a precompiled function no longer serves a call it served before: {why}"
            )
        return decided

    def _resolve(
        self, subject: Any, sig: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Variant | Fallback:
        with self._lock:
            decided = self._decided.get(sig)
            if decided is None:
                decided = next((v for v in self._variants if v.refusal(args, kwargs) is None), None)
                if decided is not None:
                    self._share(subject, sig, decided, args, kwargs)
            if decided is None:
                target = self.target(subject)
                key = self.key(target, sig)
                unchecked = unchecked_devices(target, sig)
                if unchecked:
                    decided = self.tier.fallback(
                        PrecompileDetail.DEVICE_UNCHECKED,
                        f"{target.name} runs on {', '.join(sorted(unchecked))}, where the "
                        "precompiled tier is not checked (a cold precompile on CUDA crashed its process)",
                    )
                elif key in self._loaded:  # that very artifact is here, and it just said no
                    detail, why = self._loaded[key].refusal(args, kwargs) or (PrecompileDetail.GUARD_FAILED, "")
                    decided = self.tier.fallback(
                        detail,
                        f"{target.name}'s precompiled artifact does not serve "
                        f"these inputs: {why or 'its guards reject them'}",
                    )
                elif key not in self._looked_up and len(self._looked_up) >= MAX_SHAPES:
                    decided = self.tier.fallback(
                        PrecompileDetail.TOO_MANY_SHAPES,
                        f"{target.name} met more than {MAX_SHAPES} input signatures "
                        "(bucket its inputs' lengths to precompile them all)",
                    )
                else:
                    self._looked_up.add(key)
                    decided = self.tier.resolve(target, key, args, kwargs)
                    if isinstance(decided, Variant):
                        self._variants.append(decided)
                        self._loaded[key] = decided
                        self.tier.metrics.precompile_shapes(decided.shapes)
            self._decided[sig] = decided
            return decided

    def _share(
        self, subject: Any, sig: tuple[Any, ...], variant: Variant, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A loaded variant serves the new signature ``sig``: make its key find that variant too (:meth:`Tier.share`)."""
        target = self.target(subject)
        key = self.key(target, sig)
        if key not in self._loaded:
            self.tier.share(target, key, variant, args, kwargs)

    def target(self, subject: Any) -> Target:
        target = self._targets.get(id(subject))
        if target is None:
            if subject is not self.subject and isinstance(subject, torch.nn.Module):
                traced = type(subject).forward.__get__(subject)  # DDP's inner module: its own forward, not ours
            elif getattr(subject, "__func__", None) is torch.nn.Module._call_impl:
                traced = subject.__self__  # Module.compile(): the module itself
            else:
                traced = subject
            target = self._targets[id(subject)] = Target(traced, self.settings)
        return target

    def key(self, target: Target, sig: tuple[Any, ...]) -> str:
        """The store key of ``target`` called with signature ``sig`` (see the module docstring)."""
        code = target.code
        owner = target.prefix[0] if target.prefix else None
        identity = [
            getattr(target.traced, "__module__", None),
            code.co_filename,
            target.name,
            code.co_firstlineno,
            type(owner).__module__ + "." + type(owner).__qualname__ if owner is not None else None,
        ]
        state = module_state(owner) if isinstance(owner, torch.nn.Module) else []
        devices = {leaf[3] for leaf in sig[1] if leaf[0] == "tensor"}
        fingerprint = {**toolchain(), **self.settings.fingerprint(), "devices": devices_fingerprint(devices)}
        shapes = [repr(key_signature(sig, self.settings.dynamic is True)), repr(state)]
        return self.tier.cpu_key(KEY_KIND + make_key(repr(identity), shapes, fingerprint=fingerprint))

    def _call_ddp(self, ddp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """DDP's forward eagerly, its inner module's forward through the tier (dynamo also compiles only that)."""
        inner = ddp.module
        if self._inner_forward is None or self._inner_forward[0] is not inner:
            self._inner_forward = (inner, self._routed_forward(inner))
        forward = self._inner_forward[1]
        inner.forward = forward
        try:
            return ddp(*args, **kwargs)
        finally:
            del inner.forward

    def _routed_forward(self, inner: Any) -> Callable[..., Any]:
        """What DDP calls as ``inner``'s forward: the tier (made once per inner module, not per call)."""
        inner_normal = self.dynamo_ctx(type(inner).forward.__get__(inner))

        def forward(*a: Any, **k: Any) -> Any:
            del inner.forward  # tracing, guards and the artifact must see the module as the user built it
            try:
                return self.run(inner, a, k, inner_normal)
            finally:
                inner.forward = forward

        return forward


def attach(
    store: Store,
    metrics: Metrics,
    wait_timeout: float | None,
    cpu_key: Callable[[str], str],
    kernels_loaded: Callable[[], AbstractContextManager[set[str]]] = no_kernels,
) -> Tier:
    """Wrap ``torch.compile`` (until :meth:`Tier.uninstall`); the graph hooks must be attached already.

    ``cpu_key`` is theirs (:meth:`~..graphs.hooks.Integration.cpu_key`), so precompiled functions
    are keyed by the same prefix and host-CPU fingerprint as the graphs; so is
    ``kernels_loaded`` (:meth:`~..graphs.hooks.Integration.kernels_loaded`), which tells a build
    which kernel libraries its artifact must carry.
    """
    tier = Tier(store, metrics, wait_timeout, cpu_key, kernels_loaded)
    tier.install()
    log.info("recipecache: precompiled tier on (torch.compile'd functions load from %s)", store.url)
    return tier
