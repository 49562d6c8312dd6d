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
every one loaded (:func:`..torch_settings.config_modules`, found rather than listed: a hand
list left out ``torch.fx.experimental._config``, whose ``backed_size_oblivious`` inductor's
``sizevars`` reads, issue 44), so a config or config module torch adds is carried without a
change here. What cannot travel raises
:class:`Uncarried`: a config that ``save_config`` leaves out (a custom pass, a callable) set
to something else than its default, or a value that does not pickle; the rank then
compiles that graph itself.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from ... import env
from ..torch_settings import SETTINGS, config_module, config_modules, readable, settings

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


def _left_out(module: Any) -> list[str]:
    """The configs of ``module`` that torch's serializable copy leaves out (custom passes, callables) and that
    hold something else than their default here."""
    entries = module._config
    return [
        key
        for key in getattr(module, "_save_config_ignore", ())
        if key in entries and getattr(module, key) != entries[key].default
    ]


def _snapshot(names: tuple[str, ...]) -> dict[str, Any]:
    return {
        "configs": {name: config_module(name).get_serializable_config_copy() for name in names},
        "settings": settings(),
        "environ": _environ(),
    }


def capture() -> dict[str, Any]:
    """This process's compile-relevant global state, as plain picklable values; raise :class:`Uncarried` if
    some of it cannot travel."""
    names = config_modules()
    for name in names:
        left_out = _left_out(config_module(name))
        if left_out:
            raise Uncarried(f"{name}.{left_out[0]} is set, and torch's config copy leaves it out")
    state = _snapshot(names)
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
        module = config_module(name)
        current = module.get_serializable_config_copy()
        # only what differs: a value written is a user override, and writing a deprecated one warns
        module.load_config({key: value for key, value in values.items() if key not in current or current[key] != value})
    for name, read, write in SETTINGS:
        wanted = state["settings"].get(name)
        if wanted is not None and readable(read) != wanted:
            write(wanted)


def differences(state: dict[str, Any]) -> list[str]:
    """The names of what reads differently here than in ``state``: empty once :func:`apply` reproduced it."""
    here = _snapshot(tuple(state["configs"]))
    names = [
        f"{module}.{key}"
        for module, values in state["configs"].items()
        for key, value in values.items()
        if here["configs"].get(module, {}).get(key) != value
    ]
    names += [name for name, value in state["settings"].items() if here["settings"].get(name) != value]
    environ, wanted = here["environ"], state["environ"]
    return names + [f"${name}" for name in sorted(set(environ) | set(wanted)) if environ.get(name) != wanted.get(name)]
