"""The worker of no-stall compiles: ``python -m recipecache.torch_integration.no_stall.worker RANK_PID``.

Started by :mod:`.controller` in a fresh interpreter (never the user's script), once per
process, and kept for all its graphs. Each frame on its stdin (:func:`.protocol.read_frame`) is
one job, pickled (the store settings, the graph's store key, torch's wire-format input of one
graph compile, the parent's global torch state (:mod:`.global_state`), ``sys.path`` and how to hook torch up,
which the rank hands by name: :data:`.controller.HookUp`, so that this module imports nothing above its
feature); nothing of it is on disk, where the store's secret would outlive a killed rank. It enables
recipecache on the same store, applies the parent's state (every config value, flag and environment variable
that torch's FX key or inductor's lowering reads: the worker compiles under exactly the rank's),
and runs torch's whole ``_compile_fx_inner`` on the graph in the context torch's own
out-of-process compile sets up (``_SerializedFxCompile._run_in_child``: inductor config, from
torch 2.15 the registered backends' codegen configs, virtualized state, tracing context, fake
mode). The FX cache lookup misses (the parent holds the key's lease, so this process does not
wait for it), inductor compiles, and torch's put publishes the entry with its kernels through
the normal path. It answers one frame on its stdout (the
compile's seconds, or the error: with ``inline`` when no worker can compile this graph under the
rank's key, a value it could not reproduce or another key; with ``stale_worker`` when what stuck
of an earlier job's state may be why), which carries nothing else: whatever the compile prints
goes to stderr, the parent's log of the worker. It exits at the end of its input.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ... import metrics_schema as schema
from ...parent_death import die_with_parent

if TYPE_CHECKING:
    from ..metrics import Metrics


@contextlib.contextmanager
def compile_context(wire: Any) -> Iterator[None]:
    """The context of the rank's compile of one graph, from torch's wire-format input ``wire``, as torch's own
    child sets it up (``_SerializedFxCompile._run_in_child``): inductor's config, from torch 2.15 the codegen
    configs of the backends registered in the rank (the FX key covers them), virtualized and lowering state,
    tracing context, fake mode."""
    import torch
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx_ext import _current_fake_mode
    from torch._inductor.debug import DebugContext

    with contextlib.ExitStack() as stack:
        stack.enter_context(wire.virtualized.patch())
        stack.enter_context(wire.lowering.patch())
        stack.enter_context(inductor_config.patch(wire.config))
        for name, values in getattr(wire, "backend_configs", {}).items():  # torch >= 2.15
            stack.enter_context(importlib.import_module(name).patch(values))
        stack.enter_context(torch._guards.tracing(wire.tracing_context))
        stack.enter_context(DebugContext())
        stack.enter_context(wire.fake_tensor_mode.patch(_current_fake_mode()))
        yield


def compile_job(job: dict[str, Any], first: bool = True) -> dict[str, Any]:
    """Compile and publish the graph of ``job`` (``first``: this process's first job); what the parent reads back."""
    from ...store import Store
    from ..metrics import Metrics

    # the graph's pickle names the modules it was traced from (a model class in the node metadata and
    # the tracing context): importable from where the rank imported them. Only what the pickle names
    # is imported; the script itself (``__main__``) never is
    sys.path[:0] = [p for p in job["sys_path"] if p and p not in sys.path]
    store = Store.open(job["settings"])
    metrics = Metrics(store, None, flush=False)
    try:
        with job["hook_up"](store, metrics, job["settings"].wait_timeout) as integration:
            return _compile_hooked(job, first, integration, metrics)
    finally:
        store.close()


def _compile_hooked(job: dict[str, Any], first: bool, integration: Any, metrics: Metrics) -> dict[str, Any]:
    """:func:`compile_job` once torch is hooked up to the store (``integration``, counting into ``metrics``)."""
    from torch._inductor import compile_fx
    from torch._inductor.compile_fx_ext import _WireProtocolPickledInput

    from . import global_state

    # after attach: the rank's state was captured with recipecache's hooks on as well
    global_state.apply(job["state"])
    unreproduced = global_state.differences(job["state"])
    if unreproduced:
        # after an earlier job, what stuck of its state may be the cause (torch's legacy and new precision
        # APIs keep a history): a fresh worker starts from torch's defaults. Fresh already: none can
        why = f"the worker cannot reproduce the rank's {', '.join(unreproduced[:3])}"
        return {"error": why, "inline": True} if first else {"error": why, "stale_worker": True}
    wire = _WireProtocolPickledInput(job["wire"]).deserialize()
    with compile_context(wire):
        start = time.perf_counter()
        compile_fx._compile_fx_inner(wire.gm, wire.example_inputs, **wire.graph_kwargs)
        seconds = time.perf_counter() - start
    published = schema.LOOKUPS.read(metrics.snapshot())["fx"]
    key = integration.graphs.last_key
    if key is None:  # torch's local cache (shared with the rank) had it: nothing to publish
        return {"compile_s": seconds}
    if key != job["key"]:
        return {
            "error": f"the worker computed key {key}, the rank {job['key']}",
            "inline": True,
            "key_mismatch": True,
        }
    if not published[schema.LOOKUP_PUT.key] and not published[schema.LOOKUP_HIT.key]:
        # the store failed (an outage, a full store): the compiled graph is in torch's local cache,
        # which the rank shares, so the rank still switches to it; the store's reasons go with it
        return {"compile_s": seconds, "unpublished": sorted(schema.FALLBACKS.read(metrics.snapshot()))}
    return {"compile_s": seconds}


#: how much the worker (and the compilers it starts) yields the CPU to the rank's own steps
NICENESS = 19


def run_job(payload: bytes, first: bool) -> bytes:
    """Compile the pickled job ``payload`` (``first``: this worker's first job); the pickled result for the parent."""
    job = pickle.loads(payload)  # noqa: S301 - the parent's own frame on our stdin pipe
    try:
        result = compile_job(job, first)
    except Exception as exc:  # noqa: BLE001 - the parent reads it and keeps the graph eager
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    return pickle.dumps(result)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # the compile is behind the steps: on a GPU node it runs on cores nothing else wants, on a
    # machine whose cores the ranks keep busy it takes what they leave (g++ inherits the niceness)
    os.nice(NICENESS)
    # end with the rank (argv[1]: its pid): a rank killed mid-job leaves no compile running on; its lease
    # then expires and another process compiles the graph (at a normal exit the rank waits for us itself)
    die_with_parent(signal.SIGKILL, int(sys.argv[1]))
    from .protocol import read_frame, write_frame

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints of the compile go to the log, never into the replies
    first = True
    while (payload := read_frame(sys.stdin.buffer)) is not None:
        write_frame(replies, run_job(payload, first))
        first = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
