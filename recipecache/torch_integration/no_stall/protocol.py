"""What travels between a rank and its no-stall worker: one graph compile in torch's wire format, and the frames
that carry each message on the worker's pipes.

Both ends import it: the rank (:mod:`.controller`, :mod:`.pool`) builds the wire input of a graph and writes the
frames of its jobs; the worker (:mod:`.worker`) reads them and answers in frames of its own. Which graphs can
travel at all is said here too (:func:`needs_process_groups`, :func:`wire_input`): what torch's wire format cannot
carry, a worker cannot compile under the rank's key.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from typing import Any

import torch
import torch._inductor.config as inductor_config

from ..rank_binding import is_mesh

log = logging.getLogger(__name__)


#: ops a worker can look up by name: torch's own (the worker runs the same torch, never the user's
#: code, so ops a user library registers are not there). torch's wire format allows ``aten`` only
#: (``GraphPickler``'s default ``ops_filter``), which turns away most training graphs (``prims.iota``
#: of an ``arange``, for one)
_WORKER_OPS = ("torch.ops.aten.", "torch.ops.prims.", "torch.ops.fbgemm.")


def _worker_op(name: str) -> bool:
    return name.startswith(_WORKER_OPS)


#: namespaces of the ops that run collectives on a process group of the process (the compile of a graph calling
#: them asks the group, by name, for its size: only a process in the group can compile it)
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})


def needs_process_groups(gm: torch.fx.GraphModule, example_inputs: Any) -> str | None:
    """Why only this process can compile ``gm``, or None: a graph that runs collectives (inductor resolves their
    process groups by name while compiling), or that takes a device mesh or another opaque object (torch's wire
    format sends a mesh as None, so the worker's FX key would not be the rank's: measured on 2.13, a key mismatch
    on every TP backward)."""
    from torch._library.fake_class_registry import FakeScriptObject

    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
            return f"the graph runs collectives ({node.target}) on this process's groups"
    if any(isinstance(x, FakeScriptObject) or is_mesh(x) for x in example_inputs):
        return "the graph takes an opaque object (a device mesh) that only this process holds"
    return None


def wire_input(
    gm: torch.fx.GraphModule, example_inputs: Any, inputs_to_check: Any, graph_kwargs: dict[str, Any]
) -> bytes | None:
    """torch's wire-format input of one graph compile (what ``_SerializedFxCompile.serialize_compile``
    builds), pickled with :data:`_WORKER_OPS` allowed; None if the graph cannot travel (torch's reasons:
    a higher-order op its cache bypasses, a Triton kernel wrapper, something unpicklable)."""
    from pickle import PicklingError

    from torch._inductor import compile_fx_ext as ext
    from torch._inductor.codecache import BypassFxGraphCache, FxGraphCache
    from torch.fx._graph_pickler import GraphPickler, Options

    try:
        FxGraphCache._check_for_hop(gm)
        if ext._graph_contains_triton_kernel_wrappers(gm):
            return None
        fields = {
            "gm": gm,
            "example_inputs": example_inputs,
            "inputs_to_check": inputs_to_check,
            "graph_kwargs": graph_kwargs,
            "tracing_context": torch._guards.TracingContext.try_get(),
            "config": inductor_config.save_config_portable(),
            "virtualized": ext._VirtualizedSerializer.serialize(),
            "deterministic_guard_for_testing": None,
            "logger_state": ext._LoggerState(),
            "lowering": ext._LoweringSerializer(),
            "fake_tensor_mode": ext._FakeTensorModeSerializer(ext._current_fake_mode()),
        }
        if "backend_configs" in {f.name for f in dataclasses.fields(ext._WireProtocolInput)}:  # torch >= 2.15
            fields["backend_configs"] = backend_configs()
        return GraphPickler.dumps(ext._WireProtocolInput(**fields), Options(ops_filter=_worker_op))
    except (AttributeError, BypassFxGraphCache, PicklingError, NotImplementedError) as exc:
        log.debug("recipecache: cannot send graph to a worker: %r", exc)
        return None


def backend_configs() -> dict[str, dict[str, Any]]:
    """The codegen configs of the out-of-tree backends registered here (``register_backend_for_device``'s
    ``device_custom_config``), by module, as torch 2.15's wire format carries them: the FX key covers them, and
    the worker compiles under them (``patch`` of each module, as torch's own child does)."""
    from torch._inductor.codegen.common import custom_backend_codegen_configs

    return {
        module.__name__: module.get_serializable_config_copy()
        for module in custom_backend_codegen_configs.values()
        if module is not None
    }


#: the frame of one message on the worker's pipes: its length, then that many bytes
_FRAME = struct.Struct("!Q")


def write_frame(stream: Any, payload: bytes) -> None:
    stream.write(_FRAME.pack(len(payload)))
    stream.write(payload)
    stream.flush()


#: The largest reply a worker sends (a small dict: seconds, an error message): a header claiming more is a
#: stream out of step, never a reason to allocate what it claims.
MAX_REPLY_BYTES = 64 * 1024 * 1024


def read_frame(stream: Any, limit: int | None = None) -> bytes | None:
    """One message from ``stream``; None at its end (or a message cut short: the writer died).

    ValueError for a message that says it is longer than ``limit`` bytes (nothing of it is read).
    """
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    size = _FRAME.unpack(head)[0]
    if limit is not None and size > limit:
        raise ValueError(f"a frame of {size} bytes (at most {limit})")
    payload = stream.read(size)
    return payload if len(payload) == size else None
