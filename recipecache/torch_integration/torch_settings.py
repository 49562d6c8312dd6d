"""The process-wide torch settings a compile reads: every config module torch (or anyone) installed, and the global flags.

A compile's result depends on more than its graph: torch's config modules (inductor's,
dynamo's, functorch's, ``torch.fx.experimental._config`` whose ``backed_size_oblivious``
inductor's ``sizevars`` reads, ...) and flags outside them (matmul precisions, deterministic
algorithms, the default dtype, ...). torch's own FX and AOTAutograd keys cover only part of
them (``docs/torch-integration-notes.md``, "Settings a compile reads"). Two features need the
whole list: no-stall's worker must reproduce it (:mod:`.no_stall.global_state`) and the
precompiled tier's key must hold it (:mod:`.precompiled.keys`); the graph store adds what
torch's keys leave out to its own (:func:`outside_torch_keys`). One list here, so that none
of them drifts from the others.

Config modules are found, not named: every ``torch.utils._config_module.ConfigModule`` in
``sys.modules`` once what a compile imports is imported, so a config module a new torch adds
(or a third-party backend installs) is carried and keyed without a change here. A hand list
missed ``torch.fx.experimental._config`` (issue 44 item 4).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

#: config modules torch ships only for its own tests (``torch.testing._internal.fake_config_module``)
_TEST_PREFIX = "torch.testing."

#: config modules whose values torch's FX graph key hashes whole (``FxGraphHashDetails``: inductor's
#: ``save_config_portable(ignore_private_configs=False)``, and config_comms's); functorch's is hashed whole
#: by AOTAutograd's key, which also hashes the FX details. Everything else a compile reads is outside
#: torch's keys (see :func:`outside_torch_keys`).
IN_TORCH_KEYS = frozenset({"torch._inductor.config", "torch._inductor.config_comms", "torch._functorch.config"})

#: config modules torch's keys cover through the graph they hash. Dynamo's shapes what dynamo traces, and of its
#: entries inductor and AOTAutograd read only debug, error-handling and caching ones, none of which changes code;
#: it must also stay out of a key a graph's lookup and its later uses share: torch patches it around a frame's
#: compile (``torch.compile(dynamic=...)``, ``recompile_limit=``), so a forward looked up inside the frame would
#: read other values than its backward's compile and its AOTAutograd entry's save, both at the backward, and that
#: entry would be stored under a key no lookup asks for. ``torch.distributed``'s (2.13's ``compile_on_one_rank``,
#: ``use_torchcomms``) is read by the collectives being traced, never by inductor or AOTAutograd: a graph without
#: collectives is the same graph under either value, and keeps its key.
HASHED_THROUGH_THE_GRAPH = frozenset({"torch._dynamo.config", "torch.distributed.config"})


def config_modules() -> tuple[str, ...]:
    """The names of every config module loaded once torch's compile machinery is, sorted.

    torch's own are imported by ``torch._dynamo`` and inductor's ``compile_fx`` (on 2.13-2.15:
    ``torch._dynamo.config``, ``_inductor.config``, ``_inductor.config_comms``, ``_functorch.config``,
    ``compiler.config``, ``fx.experimental._config``, ``_export.config``, ``distributed.config``),
    which are imported first, so the list does not depend on what the process happened to import.
    """
    import torch._dynamo  # what every compile imports, with the config modules it reads
    import torch._inductor.compile_fx  # noqa: F401
    from torch.utils._config_module import ConfigModule

    return tuple(
        sorted(
            name
            for name, module in list(sys.modules.items())
            if isinstance(module, ConfigModule) and not name.startswith(_TEST_PREFIX)
        )
    )


def config_module(name: str) -> Any:
    """The config module ``name`` (imported if need be: a worker may not have loaded a third party's yet)."""
    import importlib

    return importlib.import_module(name)


def overrides(name: str) -> dict[str, Any]:
    """The values of config module ``name`` that differ from the defaults in its source (set by the program or
    by an environment variable), private ones included: what keys hold, so that a default leaves them as
    they were."""
    module = config_module(name)
    entries = module._config
    return {
        key: value
        for key, value in module.save_config_portable(ignore_private_configs=False).items()
        if key in entries and value != entries[key].default
    }


#: config names that only steer caching (recipecache sets some of them: the remote-cache switches, PGO and
#: ``torch.compiler.config.job_id``, which names a job's PGO state) or where debug output goes (dynamo's
#: ``debug_dir_root``, whose default is the process's working directory: a no-stall worker, which starts
#: elsewhere and takes the rank's value, read it as an override the rank did not have), never the generated code
PLUMBING = ("cache", "pgo", "job_id", "debug_dir")
#: config torch itself changes while compiling: AOTInductor fills its metadata into the global dict in place
MUTATED_BY_TORCH = frozenset({"aot_inductor.metadata"})


def keyed(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a config module's) less what a key must not hold: :data:`PLUMBING` (set by ``enable()``
    or per job, which would keep equal compiles apart) and :data:`MUTATED_BY_TORCH` (which made the second
    key of a process differ from its first)."""
    return {k: v for k, v in values.items() if k not in MUTATED_BY_TORCH and not any(p in k for p in PLUMBING)}


def keyed_overrides(names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The :func:`overrides` of each config module of ``names`` that a key holds (:func:`keyed`), for the
    modules where any is left."""
    found = {name: keyed(overrides(name)) for name in names}
    return {name: values for name, values in found.items() if values}


# -- flags outside the config modules --------------------------------------------------------------

#: ``torch.backends`` (and ``torch.utils``) attributes, in the order they are set. The per-op fp32
#: precisions (the new API) come before the legacy ``allow_tf32`` switches that read and write the same
#: settings, so the legacy one is written only where the new one did not already give its value
#: (writing both puts torch in a "mixed API" state in which ``get_float32_matmul_precision`` raises)
BACKEND_ATTRIBUTES = (
    "backends.fp32_precision",
    "backends.cuda.matmul.fp32_precision",
    "backends.cudnn.fp32_precision",
    "backends.cudnn.conv.fp32_precision",
    "backends.cudnn.rnn.fp32_precision",
    "backends.mkldnn.fp32_precision",
    "backends.mkldnn.matmul.fp32_precision",
    "backends.mkldnn.conv.fp32_precision",
    "backends.mkldnn.rnn.fp32_precision",
    "backends.cuda.matmul.allow_tf32",
    "backends.cudnn.allow_tf32",
    "backends.cuda.matmul.allow_fp16_accumulation",
    "backends.cudnn.enabled",
    "backends.cudnn.deterministic",
    "backends.cudnn.benchmark",
    "backends.mkldnn.enabled",
    "utils.deterministic.fill_uninitialized_memory",
)


def _read_deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _write_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _reduction(dtype: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Read and write cuBLAS's reduced-precision reduction setting of ``dtype`` (``fp16``, ``bf16``), split-K part included."""
    getter = getattr(torch._C, f"_get_cublas_allow_{dtype}_reduced_precision_reduction")
    setter = getattr(torch._C, f"_set_cublas_allow_{dtype}_reduced_precision_reduction")
    return (lambda: tuple(getter())), (lambda value: setter(*value))


def _attribute(path: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    owner_path, _, name = path.rpartition(".")

    def owner() -> Any:
        target: Any = torch
        for part in owner_path.split("."):
            target = getattr(target, part)
        return target

    return (lambda: getattr(owner(), name)), (lambda value: setattr(owner(), name, value))


def _default_device() -> str:
    return str(torch.get_default_device())


def _set_default_device(value: str) -> None:
    torch.set_default_device(None if value == "cpu" else value)


#: every non-config setting a compile reads: name, how to read it, how to write it (written in this order)
SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    *((path, *_attribute(path)) for path in BACKEND_ATTRIBUTES),
    ("cublas_fp16_reduced_precision_reduction", *_reduction("fp16")),
    ("cublas_bf16_reduced_precision_reduction", *_reduction("bf16")),
    ("deterministic_algorithms", _read_deterministic, _write_deterministic),
    ("default_dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("default_device", _default_device, _set_default_device),
    ("num_threads", torch.get_num_threads, torch.set_num_threads),
)

#: the :data:`SETTINGS` torch's FX key hashes itself (``FxGraphHashDetails``: the deterministic-algorithms
#: settings, the default dtype, cuBLAS's matmul precision and reduced-precision reductions, the thread count
#: of CPU code; ``get_float32_matmul_precision`` reads the cuBLAS precision). The others (cuDNN's and
#: oneDNN's precisions and switches, the default device) inductor's lowering reads outside it.
SETTINGS_IN_TORCH_KEYS = frozenset(
    {
        "float32_matmul_precision",
        "backends.cuda.matmul.fp32_precision",
        "backends.cuda.matmul.allow_tf32",
        "cublas_fp16_reduced_precision_reduction",
        "cublas_bf16_reduced_precision_reduction",
        "deterministic_algorithms",
        "utils.deterministic.fill_uninitialized_memory",
        "default_dtype",
        "num_threads",
    }
)


def readable(read: Callable[[], Any]) -> Any:
    """A setting's value, or None (never written): an attribute this torch lacks, or a question torch refuses
    to answer (a precision read after the legacy and new precision APIs were mixed), a state the worker must
    then reach as well."""
    try:
        return read()
    except (AttributeError, RuntimeError):
        return None


def settings() -> dict[str, Any]:
    """The value of each of :data:`SETTINGS` here (None where this torch has no such setting)."""
    return {name: readable(read) for name, read, _write in SETTINGS}


def outside_torch_keys() -> str:
    """A digest of what a compile reads that torch's FX and AOTAutograd keys do not hash: the overrides of every
    config module but those they hash whole or through the graph (:data:`HASHED_THROUGH_THE_GRAPH`;
    ``torch.fx.experimental._config``'s ``backed_size_oblivious``, which inductor's ``sizevars`` reads, is among
    those it holds), and the flags inductor's lowering reads outside them
    (cuDNN's and oneDNN's precisions and switches, the default device). The graph store adds it to its keys of
    torch's graphs: without it, a process that set one of them was served a graph compiled under another value."""
    import hashlib

    covered = IN_TORCH_KEYS | HASHED_THROUGH_THE_GRAPH
    configs = keyed_overrides(name for name in config_modules() if name not in covered)
    flags = {name: value for name, value in settings().items() if name not in SETTINGS_IN_TORCH_KEYS}
    digest = hashlib.blake2b(stable_repr({"configs": configs, "flags": flags}).encode(), digest_size=8)
    return digest.hexdigest()


def stable_repr(value: Any) -> str:
    """``repr`` with sets and dicts in sorted order, so equal settings read the same in every process."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(stable_repr(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{stable_repr(k)}: {stable_repr(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(stable_repr(v) for v in value) + "]"
    return repr(value)
