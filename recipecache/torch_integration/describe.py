"""Names for what torch compiles, and torch's own cache counters: what an operator reads in reports.

Everything here reads torch internals that may change between releases, so every
function is total: a missing attribute gives a vaguer answer (``graph``, ``{}``), never an
exception into a compile (callers still run these under the graph store's ``Guard``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import torch

from .. import metrics_schema as schema
from ..keylog import cpu_summary

#: label parts are cut to this many characters (they travel in envelope headers and event logs)
MAX_LABEL_CHARS = 200

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
    torch.uint8: "u8",
    torch.int8: "i8",
}

_names_lock = threading.Lock()
#: dynamo compile id -> the forward's name, so a lazily compiled backward can be named after it
_forward_names: dict[str, str] = {}


def _cut(text: str) -> str:
    return text if len(text) <= MAX_LABEL_CHARS else text[: MAX_LABEL_CHARS - 3] + "..."


def _traced_function() -> str | None:
    """``Class.method`` (or the function name) dynamo is tracing right now, if it is tracing."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code = tx.f_code
        owner = tx.f_locals.get("self")
    except Exception:  # noqa: BLE001 - not tracing (a lazy backward), or another torch
        return None
    return f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext

        return str(CompileContext.current_compile_id())
    except Exception:  # noqa: BLE001 - outside a compile, or another torch: the name goes without its id
        return ""


def function_name(fx_kwargs: Mapping[str, Any]) -> str:
    """What the graph was compiled from: ``TinyLM.forward``, ``TinyLM.forward backward``, or ``graph``."""
    compile_id = _compile_id()
    if fx_kwargs.get("is_backward"):
        with _names_lock:
            forward = _forward_names.get(compile_id)
        return f"{forward or 'graph'} backward"
    traced = _traced_function()
    with _names_lock:
        if traced is None:  # not tracing: a forward loaded again later (a stand-in's load), named as when traced
            return _forward_names.get(compile_id, "graph") if compile_id else "graph"
        if compile_id:
            _forward_names[compile_id] = traced
    return traced


def input_shapes(example_inputs: Sequence[Any]) -> str:
    """The graph's distinct input shapes in order, ``f32[64,32] i64[4,16] ...`` (symbolic sizes as torch prints them).

    Parameters come among the inputs; repeats are dropped so the line stays readable.
    """
    parts: dict[str, None] = {}
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            dims = ",".join(str(d) for d in value.shape)
            parts[f"{_DTYPES.get(value.dtype, str(value.dtype).removeprefix('torch.'))}[{dims}]"] = None
        elif isinstance(value, (int, float, torch.SymInt)):
            parts[str(value)] = None
    return _cut(" ".join(parts))


def graph_meta(name: str, shapes: str, compile_s: float) -> dict[str, Any]:
    """The envelope ``meta`` of a graph artifact (``recipecache ls``)."""
    return {"kind": "graph", "name": _cut(name), "shapes": shapes, "compile_s": round(compile_s, 3)}


@cache
def process_context() -> dict[str, Any]:
    """Facts about this process that decide whether kernels fit, but are not in torch's FX key."""
    return {
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **cpu_summary(),
    }


#: torch's local caches by the metrics field that counts their hits
_LOCAL_CACHES = {schema.LOCAL_FX_HITS: "LocalFxGraphCache", schema.LOCAL_AOT_HITS: "LocalAOTAutogradCache"}


def local_hits() -> dict[str, int]:
    """Graphs (FX) and AOTAutograd entries torch served from its own local cache in this process.

    torch counts them per cache in ``torch._inductor.remote_cache.cache_stats`` (names
    ``LocalFxGraphCache`` and ``LocalAOTAutogradCache``, recorded by
    ``GuardedCache.find_guarded_entry`` and ``AOTAutogradCache._record_result``); a hit
    there means the store was never asked.
    """
    try:
        from torch._inductor.remote_cache import cache_stats

        stats = cache_stats._stats
        return schema.record(
            {field: int(stats[name].hit) if name in stats else 0 for field, name in _LOCAL_CACHES.items()}
        )
    except Exception:  # noqa: BLE001 - another torch: the report shows no local hits rather than failing
        return {}
