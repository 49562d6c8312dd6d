"""The process-global torch state a graph's compile (and its FX cache key) depends on, carried to a no-stall worker.

torch's FX graph key (``FxGraphHashDetails`` in ``torch/_inductor/codecache.py``) hashes,
besides the graph and its inputs, settings of the process that compiles it: the inductor
(and comms) config, ``torch.compiler.config.cache_key_tag``, functorch's
``bundled_autograd_cache``, the deterministic-algorithms settings, the default dtype, the
cuBLAS matmul precision settings and the CPU thread count; and inductor's lowering reads
more of them while it compiles (cuDNN's and oneDNN's fp32 precisions, the float32 matmul
precision, the default device, and what compilers read from the environment). A training script sets
them before it compiles
(``torch.backends.cuda.matmul.allow_tf32 = True``); a no-stall worker, a fresh interpreter
that never runs the script, has torch's defaults. So the rank captures the whole state
(:func:`capture`) with each graph it sends, and the worker applies it (:func:`apply`)
before compiling, then checks that every captured value reads back the same
(:func:`differences`): the worker compiles under exactly the rank's state, or says which
value it could not reproduce.

Config modules travel whole (torch's own ``get_serializable_config_copy``/``load_config``),
so a config torch adds is carried without a change here. What cannot travel raises
:class:`Uncarried`: a config that ``save_config`` leaves out (a custom pass, a callable) set
to something else than its default, or a value that does not pickle; the rank then
compiles that graph itself.
"""

from __future__ import annotations

import importlib
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch

from ... import env

#: torch's config modules whose values a compile reads: each travels whole
CONFIG_MODULES = (
    "torch._inductor.config",
    "torch._inductor.config_comms",
    "torch._functorch.config",
    "torch._dynamo.config",
    "torch.compiler.config",
)

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


#: environment variables that are not the rank's to give: the worker's own (where it writes, where it imports
#: from) and torch's per-process ones (``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``: an address in the process)
WORKER_ENV = frozenset({"PYTHONPATH", env.EVENT_LOG, env.METRICS_FILE, env.METRICS_FLUSH})
PROCESS_ENV_PREFIX = "_TORCHINDUCTOR_"


def _environ() -> dict[str, str]:
    """The environment a compile here may read, less what is the process's own."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in WORKER_ENV and not name.startswith(PROCESS_ENV_PREFIX)
    }


def _apply_environ(wanted: dict[str, str]) -> None:
    for name in set(_environ()) - set(wanted):
        del os.environ[name]
    os.environ.update(wanted)


class Uncarried(Exception):
    """Part of the rank's state cannot be sent to a worker (the message says which)."""


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


#: every non-config setting carried: name, how to read it, how to write it (written in this order)
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


def _readable(read: Callable[[], Any]) -> Any:
    """A setting's value, or None (never written): an attribute this torch lacks, or a question torch refuses
    to answer (a precision read after the legacy and new precision APIs were mixed), a state the worker must
    then reach as well."""
    try:
        return read()
    except (AttributeError, RuntimeError):
        return None


def _left_out(module: Any) -> list[str]:
    """The configs of ``module`` that torch's serializable copy leaves out (custom passes, callables) and that
    hold something else than their default here."""
    entries = module._config
    return [
        key
        for key in getattr(module, "_save_config_ignore", ())
        if key in entries and getattr(module, key) != entries[key].default
    ]


def _snapshot() -> dict[str, Any]:
    configs = {name: importlib.import_module(name).get_serializable_config_copy() for name in CONFIG_MODULES}
    return {
        "configs": configs,
        "settings": {name: _readable(read) for name, read, _write in SETTINGS},
        "environ": _environ(),
    }


def capture() -> dict[str, Any]:
    """This process's compile-relevant global state, as plain picklable values; raise :class:`Uncarried` if
    some of it cannot travel."""
    for name in CONFIG_MODULES:
        left_out = _left_out(importlib.import_module(name))
        if left_out:
            raise Uncarried(f"{name}.{left_out[0]} is set, and torch's config copy leaves it out")
    state = _snapshot()
    try:
        pickle.dumps(state)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise Uncarried(f"a setting does not pickle ({exc})") from exc
    return state


def apply(state: dict[str, Any]) -> None:
    """Make this process's state ``state`` (a :func:`capture` of another process): its environment, and each
    config value and other setting that reads differently here."""
    _apply_environ(state["environ"])
    for name, values in state["configs"].items():
        module = importlib.import_module(name)
        current = module.get_serializable_config_copy()
        # only what differs: a value written is a user override, and writing a deprecated one warns
        module.load_config({key: value for key, value in values.items() if key not in current or current[key] != value})
    for name, read, write in SETTINGS:
        wanted = state["settings"].get(name)
        if wanted is not None and _readable(read) != wanted:
            write(wanted)


def differences(state: dict[str, Any]) -> list[str]:
    """The names of what reads differently here than in ``state``: empty once :func:`apply` reproduced it."""
    here = _snapshot()
    names = [
        f"{module}.{key}"
        for module, values in state["configs"].items()
        for key, value in values.items()
        if here["configs"].get(module, {}).get(key) != value
    ]
    names += [name for name, value in state["settings"].items() if here["settings"].get(name) != value]
    environ, wanted = here["environ"], state["environ"]
    return names + [f"${name}" for name in sorted(set(environ) | set(wanted)) if environ.get(name) != wanted.get(name)]
