"""Which of the integration's hooks fit the installed torch, and why.

The hooks (:mod:`.patches` and :mod:`.graphs.integration`, :mod:`.precompiled.tier`) patch and call torch's private internals,
which change between releases without notice. Each hook names the releases it was
checked on (read against their sources and run by the test suite) and the interface it
relies on: the attributes it patches or calls, and the leading parameters of the
functions it wraps (its wrapper passes them on and reads some). On any release whose
interface still matches, the hook is installed; one whose interface is missing or
changed is left off, so an older or newer torch gets what fits instead of an error or a
stream of ``hook_error`` fallbacks. ``enable()`` says in one warning which hooks it left
off (:func:`warning`); ``recipecache doctor`` lists every hook (:func:`states`).

An interface check cannot see a changed behaviour behind an unchanged signature (torch
2.14 began skipping its CPU probe for a library beside a ``.load_ok`` marker, which the
probe artifact then had to carry): a release not in :data:`CHECKED_RELEASES` runs with the
hooks that fit, and is named as unchecked in the warning.

This module imports torch only in :func:`states`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: torch releases (major.minor) every hook below was checked on
CHECKED_RELEASES = ("2.13", "2.14", "2.15")
#: stands for "accepts any keyword arguments" among an interface's parameters
KEYWORDS = "**"


@dataclass(frozen=True)
class Interface:
    """One torch attribute a hook relies on, and the leading parameters its code passes or reads."""

    module: str
    #: dotted path under ``module``
    attribute: str
    #: leading parameter names (``self``/``cls`` left out), :data:`KEYWORDS` for ``**kwargs``; None: any
    parameters: tuple[str, ...] | None = None
    #: for a call the hook makes by name, filling every parameter (torch's wire-format dataclass): the
    #: parameters it fills where a release has them (torch 2.15 added ``backend_configs``). Set (even
    #: empty), ``parameters`` and these must name all the parameters, in any order: one the hook does not
    #: know, or a required one gone, leaves the hook off
    optional: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"

    def problem(self) -> str | None:
        """Why this torch does not offer the interface, or None if it does."""
        try:
            found: Any = importlib.import_module(self.module)
        except ImportError:
            return f"{self.module} does not exist"
        for part in self.attribute.split("."):
            if not hasattr(found, part):
                return f"{self} does not exist"
            found = getattr(found, part)
        if self.parameters is None:
            return None
        try:
            signature = inspect.signature(found)
        except (TypeError, ValueError):
            return f"{self} has no readable signature"
        params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
        names = [KEYWORDS if p.kind is p.VAR_KEYWORD else p.name for p in params]
        if self.optional is not None:
            if set(self.parameters) <= set(names) <= {*self.parameters, *self.optional}:
                return None
            filled = ", ".join(self.parameters) + "".join(f", [{n}]" for n in self.optional)
            return f"{self} takes ({', '.join(names)}), the hook fills ({filled})"
        wanted = [n for n in self.parameters if n != KEYWORDS]
        if names[: len(wanted)] != wanted or (KEYWORDS in self.parameters and KEYWORDS not in names):
            return f"{self} takes ({', '.join(names)}), the hook needs ({', '.join(self.parameters)})"
        return None


def _i(module: str, attribute: str, *parameters: str) -> Interface:
    return Interface(f"torch.{module}", attribute, parameters or None)


@dataclass(frozen=True)
class Hook:
    name: str
    #: what the user loses without it
    purpose: str
    interface: tuple[Interface, ...]
    #: hooks this one needs to be of any use (or to be safe)
    requires: tuple[str, ...] = ()
    checked_on: tuple[str, ...] = CHECKED_RELEASES


#: every hook, in the order they are installed and listed
HOOKS: tuple[Hook, ...] = (
    Hook(
        "compile_scope",
        "a lease whose compile raised is freed when that compile ends, not at its TTL",
        (_i("_inductor.compile_fx", "_compile_fx_inner", "gm", "example_inputs"),),
    ),
    Hook(
        "graphs",
        "compiled graphs (FX entries with their kernels) from and to the store, one compile per graph",
        (
            _i("_inductor.config", "fx_graph_remote_cache"),
            _i("_inductor.remote_cache", "RemoteFxGraphCache.backend_override_cls"),
            _i("_inductor.remote_cache", "RemoteFxGraphCache._get_key", "key"),
            _i("_inductor.remote_cache", "RemoteCacheBackend._get", "key"),
            _i("_inductor.remote_cache", "RemoteCacheBackend._put", "key", "data"),
            _i("_inductor.codecache", "FxGraphCache.iterate_over_candidates", "local", "remote_cache", "key"),
        ),
        requires=("compile_scope",),
    ),
    Hook(
        "autograd",
        "AOTAutograd entries from and to the store",
        (
            _i("_functorch.config", "enable_remote_autograd_cache"),
            _i("_inductor.remote_cache", "RemoteAOTAutogradCache.backend_override_cls"),
            _i("_functorch._aot_autograd.autograd_cache", "AOTAutogradCache.get_remote_cache.cache_clear"),
            _i("_inductor.codecache", "FxGraphCachePickler._reduce_fake_script_object", "t"),
        ),
    ),
    Hook(
        "pgo",
        "automatic-dynamic decisions (PGO) shared by every rank",
        (
            _i("_dynamo.config", "automatic_dynamic_remote_pgo"),
            _i("_inductor.remote_cache", "RemoteDynamoPGOCache.backend_override_cls"),
            _i("compiler.config", "job_id"),
            _i("_dynamo.pgo", "update_automatic_dynamic", "tx", "name", "entry"),
            _i("_dynamo.pgo", "CodeId.make", "code", "closure"),
        ),
    ),
    Hook(
        "kernels",
        "a graph's compiled kernels travel with it (without: a hit runs the compiler)",
        (
            _i("_inductor.codecache", "write", "content", "extension"),
            _i("_inductor.runtime.runtime_utils", "cache_dir"),
        ),
    ),
    Hook(
        "precompiled_header",
        "torch's precompiled header stays on (it is in the key) and a hit skips building it",
        (
            _i("_inductor.config", "cpp_cache_precompile_headers"),
            _i("_inductor.codecache", "_precompile_header", "header", "hashable_cmd_line", KEYWORDS),
        ),
        requires=("kernels",),
    ),
    Hook(
        "cpu_probes",
        "torch's CPU-feature probe libraries come from the store, and ranks share the probing",
        (
            _i("_inductor.cpu_vec_isa", "VecISA.check_build", "code"),
            _i("_inductor.cpu_vec_isa", "VecISA._probe_load", "output_path"),
            _i("_inductor.cpu_vec_isa", "VecISA.build_arch_flags"),
            _i("_inductor.cpu_vec_isa", "valid_vec_isa_list"),
            _i("_inductor.cpu_vec_isa", "x86_isa_checker"),
            _i("_inductor.cpu_vec_isa", "supported_vec_isa_list"),
            _i("_inductor.cpp_builder", "get_compiler_version_info"),
            _i("_inductor.cpp_builder", "get_cpp_compiler"),
        ),
        requires=("kernels",),
    ),
    Hook(
        "autotune",
        "GPU kernels' runtime autotuning results (launch configs, JSON) from and to the store",
        (
            _i("_inductor.config", "autotune_remote_cache"),
            _i("_inductor.remote_cache", "RemoteAutotuneCache.backend_override_cls"),
        ),
    ),
    Hook(
        "compile_count",
        "graphs compiled here are counted and timed (metrics, the report's compile seconds)",
        (_i("_inductor.compile_fx", "fx_codegen_and_compile", "gm", "example_inputs"),),
    ),
    Hook(
        "overlap",
        "a rank whose graph another rank compiles goes on to compile the next graph (a forward's backward) and "
        "waits for it at its first call (without: it waits in the compile, a CPU core idle)",
        (
            _i("_inductor.compile_fx", "_check_triton_bf16_support", "graph"),
            _i(
                "_functorch._aot_autograd.graph_compile",
                "_aot_stage2b_bw_compile",
                "bw_module",
                "maybe_subclass_meta",
                "fw_metadata",
                "fwd_output_strides",
                "num_symints_saved_for_bw",
                "aot_config",
                "bw_compiler",
            ),
            _i("_functorch._aot_autograd.schemas", "AOTConfig.force_non_lazy_backward_lowering"),
            _i(
                "_functorch._aot_autograd.graph_compile",
                "_cache_autograd_info",
                "aot_config",
                "flat_args",
                "compiled_fw_func",
                "compiled_bw_func",
            ),
            _i("_inductor.utils", "set_tracing_context_output_strides", "example_inputs", "compiled_graph"),
            _i("fx.experimental.symbolic_shapes", "SymExprPrinter"),
            _i("_guards", "TracingContext.report_output_strides"),
            _i("_guards", "tracing"),
            _i("_inductor.config", "save_config_portable"),
        ),
        requires=("graphs", "compile_scope", "compile_count"),
    ),
    Hook(
        "key_records",
        "what each graph key is made of, for recipecache explain, and graph names in the report",
        (_i("_inductor.codecache", "compiled_fx_graph_hash", "gm", "example_inputs", "fx_kwargs"),),
    ),
    Hook(
        "rank_binding",
        "graphs that carry collectives (tensor, sequence, expert parallel) are compiled once per job "
        "and bound to each rank's own process groups (without: compiled by every rank)",
        (
            _i("distributed.distributed_c10d", "_World.pg_names"),
            _i("distributed.distributed_c10d", "_World.pg_group_ranks"),
            _i("distributed.distributed_c10d", "_world"),
            _i("_inductor.codecache", "FxGraphHashDetails", "gm", "example_inputs", "fx_kwargs", "inputs_to_check"),
            _i("_inductor.codecache", "FxGraphCachePickler", "gm", "has_user_defined_triton_kernels"),
            _i("_inductor.codecache", "FxGraphCachePickler.get_key", "obj"),
            _i("_inductor.codecache", "_ident"),
            _i("_inductor.codecache", "get_hash"),
            _i("_library.fake_class_registry", "FakeScriptObject"),
        ),
        requires=("graphs", "key_records"),
    ),
    Hook(
        "precompiled",
        "the precompiled tier (enable(precompile=True)): fresh ranks load whole compiled functions",
        (
            _i("_dynamo.aot_compile", "aot_compile_fullgraph"),
            _i("_dynamo.aot_compile", "AOTCompiledFunction.serialize"),
            _i("_dynamo.aot_compile", "AOTCompiledFunction.deserialize"),
            _i("_dynamo.guards", "GuardsStatePickler.reducer_override", "obj"),
            _i(
                "_dynamo.guards",
                "GuardsStatePickler._unpickle_tensor",
                "meta_tensor",
                "device",
                "pytype",
                "dispatch_keys_raw",
                "grad",
            ),
            _i("_dynamo.convert_frame", "get_traced_fn"),
            _i(
                "_dynamo.convert_frame",
                "GraphRuntimeEnv",
                *("bytecode", "pycode", "import_sources", "used_globals", "closure", "argdefs", "kwdefaults"),
                "external_refs",
            ),
            _i("_dynamo.hooks", "Hooks"),
            _i("_dynamo.eval_frame", "OptimizedModule"),
            _i("_dynamo.symbolic_convert", "InliningInstructionTranslator.inline_call_"),
            Interface("torch", "_TorchCompileInductorWrapper"),
        ),
        requires=("graphs",),
    ),
    Hook(
        "no_stall",
        "no-stall (enable(no_stall=True)): a graph that missed runs without inductor while one process "
        "compiles it in a worker",
        (
            Interface(
                "torch._inductor.compile_fx_ext",
                "_WireProtocolInput",
                (
                    "gm",
                    "example_inputs",
                    "inputs_to_check",
                    "graph_kwargs",
                    "tracing_context",
                    "config",
                    "virtualized",
                    "deterministic_guard_for_testing",
                    "logger_state",
                    "lowering",
                    "fake_tensor_mode",
                ),
                optional=("backend_configs",),
            ),
            _i("_inductor.codegen.common", "custom_backend_codegen_configs"),
            _i("_inductor.compile_fx_ext", "_graph_contains_triton_kernel_wrappers"),
            _i("_inductor.compile_fx_ext", "_VirtualizedSerializer.serialize"),
            _i("_inductor.compile_fx_ext", "_LoweringSerializer"),
            _i("_inductor.compile_fx_ext", "_LoggerState"),
            _i("_inductor.compile_fx_ext", "_FakeTensorModeSerializer"),
            _i("_inductor.codecache", "FxGraphCache._check_for_hop"),
            _i("fx._graph_pickler", "GraphPickler.dumps", "obj", "options"),
            _i("fx._graph_pickler", "Options"),
            _i("_inductor.compile_fx_ext", "_WireProtocolPickledInput.deserialize"),
            _i("_inductor.compile_fx_ext", "_current_fake_mode"),
            _i("_inductor.config", "save_config_portable"),
            _i("_guards", "tracing"),
            _i("fx._lazy_graph_module", "_LazyGraphModule.force_recompile"),
        ),
        requires=("graphs", "compile_count"),
    ),
    Hook(
        "every_thread",
        "the settings enable() makes in torch's config reach every thread, not only the one enable() ran in "
        "(Ray Train compiles in a thread of its own)",
        (
            _i("utils._config_module", "ConfigModule"),
            _i("utils._config_module", "_ConfigEntry.env_value_default"),
            _i("_inductor.config", "_config"),
        ),
    ),
)


@dataclass(frozen=True)
class HookState:
    hook: Hook
    on: bool
    #: why it is on or off, one phrase
    why: str


def release(version: str) -> str:
    """``2.14`` for ``2.14.1+cu130``: the part of a version whose internals a hook was checked against."""
    return ".".join(version.split("+")[0].split(".")[:2])


def states(version: str | None = None) -> list[HookState]:
    """Every hook, on or off on the installed torch (``version``: torch's, unless a test says otherwise)."""
    if version is None:
        import torch

        version = torch.__version__
    ours = release(version)
    result: dict[str, HookState] = {}
    for hook in HOOKS:
        problem = next((p for p in (i.problem() for i in hook.interface) if p is not None), None)
        off = [name for name in hook.requires if not result[name].on]
        if problem is not None:
            result[hook.name] = HookState(hook, False, problem)
        elif off:
            result[hook.name] = HookState(hook, False, f"needs {', '.join(off)}, which is off")
        elif ours in hook.checked_on:
            result[hook.name] = HookState(hook, True, f"checked on torch {ours}")
        else:
            result[hook.name] = HookState(
                hook, True, f"interface matches; not checked on torch {ours} (checked: {', '.join(hook.checked_on)})"
            )
    return list(result.values())


def warning(found: Iterable[HookState], version: str, *, skip: Iterable[str] = ()) -> tuple[bool, str]:
    """The one warning ``enable()`` gives about this torch: (some hook was left off, message; "" for none).

    ``skip``: hooks not asked for (the precompiled tier without ``precompile=True``).
    """
    found = [s for s in found if s.hook.name not in set(skip)]
    off = [s for s in found if not s.on]
    unchecked = any(release(version) not in s.hook.checked_on for s in found)
    if not off and not unchecked:
        return False, ""
    head = (
        f"torch {version} is not a release these hooks were checked on ({', '.join(CHECKED_RELEASES)})"
        if unchecked
        else f"torch {version}"
    )
    if not off:
        return False, f"{head}; every hook's interface matches, all are on"
    left = "; ".join(f"{s.hook.name} ({s.why})" for s in off)
    return True, f"{head}; hooks left off: {left}; the rest are on"
