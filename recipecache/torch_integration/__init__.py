"""recipecache for torch.compile: after :func:`enable`, every compile in the process uses the store.

* On a miss exactly one process compiles each graph (single-flight through
  :meth:`Store.begin`); it publishes torch's FX entry *with* the ``.so`` kernels the
  graph loads, so a hit elsewhere installs them and runs no compiler. Forward and
  backward graphs, AOTAutograd entries, the CPU-feature probe libraries and the
  automatic-dynamic (PGO) decisions (shared across ranks, merged on put) all travel.
* Results are those of a local compile: a hit loads the very code the producer built.
* With ``precompile=True`` (:mod:`.precompiled.tier`) a fresh process also skips dynamo: every
  ``torch.compile``'d function or module loads a precompiled artifact (bytecode, guards
  and AOTInductor libraries) that one process compiled and published.
* Nothing here raises into training. A backend that is down, a refused or malformed
  artifact, or a torch that lacks a hook point makes torch compile locally; the reason
  is warned about once and counted (:func:`metrics`).

Keys match across ranks as long as ranks agree on what torch puts in them: the rank is
not in them (PGO's is removed), the precompiled-header flag is pinned here (to torch's
default, on: fast cold compiles; a hit skips the header), the thread count is (so
launch every rank with the same ``OMP_NUM_THREADS``, as ``recipecache-run`` does), and
on GPUs so is the device ordinal (launch each rank with ``CUDA_VISIBLE_DEVICES=<local
rank>`` so every rank compiles for ``cuda:0``). Artifacts holding compiled CPU code are
also keyed by the host's CPU (:mod:`.host_cpu`), so nodes of different CPU kinds never
load each other's kernels.

This package imports torch only when :func:`enable` runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from .. import env
from ..env import process_rank
from ..reasons import Reason
from ..store import Store, open_store
from .metrics import Metrics, metrics_path

#: seconds one no-stall compile behind the steps may take (``RECIPECACHE_NO_STALL_TIMEOUT``): far above a
#: large model's graph (minutes), far below a job
DEFAULT_NO_STALL_TIMEOUT_S = 1800.0

__all__ = ["disable", "enable", "mark_step", "metrics", "write_metrics"]

log = logging.getLogger(__name__)


class _Session:
    """What enable() set up; the metrics outlive disable() so they can still be read and written at exit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store: Store | None = None
        self.metrics: Metrics | None = None
        self.hooked = False
        #: the precompiled tier, when enable(precompile=True)
        self.tier: Any = None
        self.next_step = 0
        self.exit_hook = False


_session = _Session()


def enable(
    url: str | None = None,
    *,
    namespace: str | None = None,
    secret: str | bytes | None = None,
    wait_timeout: float | None = None,
    metrics_file: str | None = None,
    precompile: bool | None = None,
    no_stall: bool | None = None,
    exit_grace: float | None = None,
) -> Store:
    """Route this process's torch.compile caches to the store ``url`` names and return that store.

    ``url``, ``namespace`` and ``secret`` default to the environment as in
    :func:`recipecache.open_store`; ``wait_timeout`` (seconds a process waits for another
    one's compile) to ``RECIPECACHE_WAIT_TIMEOUT``; ``metrics_file`` to
    ``RECIPECACHE_METRICS_FILE``; ``precompile`` (the precompiled tier) to
    ``RECIPECACHE_PRECOMPILE=1``; ``no_stall`` (a graph that missed runs without inductor while
    one process compiles it behind the steps, :mod:`.no_stall.controller`) to ``RECIPECACHE_NO_STALL=1``, and
    ``exit_grace`` (seconds the process may spend at exit finishing those compiles) to
    ``RECIPECACHE_EXIT_GRACE`` (recipecache-run sets 80% of its ``--exit-grace``), else 120 (one such compile may take ``RECIPECACHE_NO_STALL_TIMEOUT``
    seconds, else 1800, before its worker is ended). A malformed URL raises ConfigError (bad input); an
    unreachable store does not (it degrades at use). Calling it again while enabled
    returns the current store.
    """
    started = time.time()
    with _session.lock:
        if _session.hooked and _session.store is not None:
            return _session.store
        store = open_store(url, namespace=namespace, secret=secret)
        template = metrics_file or os.environ.get(env.METRICS_FILE)
        metrics = Metrics(store, metrics_path(template, process_rank()), flush=env.switch(env.METRICS_FLUSH))
        want_tier = precompile if precompile is not None else env.switch(env.PRECOMPILE)
        want_no_stall = no_stall if no_stall is not None else env.switch(env.NO_STALL)
        grace = (
            env.seconds(env.EXIT_GRACE, env.DEFAULT_EXIT_GRACE_S)
            if exit_grace is None
            else env.positive_seconds("exit_grace", exit_grace)
        )
        no_stall_timeout = env.seconds(env.NO_STALL_TIMEOUT, DEFAULT_NO_STALL_TIMEOUT_S)
        # a process alone has nobody to share its compiles with
        want_pool = env.switch(env.COMPILE_POOL, default=True) and env.process_world_size() > 1
        try:
            import torch

            from . import compat, patches

            hooks = compat.states()
            on = {state.hook.name for state in hooks if state.on}
            compiles_behind = None
            if want_no_stall and "no_stall" in on:
                from ..compile_pool import CompilePool
                from .no_stall.controller import NoStall

                compiles_behind = NoStall(
                    store,
                    metrics,
                    grace,
                    no_stall_timeout,
                    hook_up=patches.hooked_for_worker,
                    compile_pool=CompilePool(store) if want_pool else None,
                )
            integration = patches.attach(store, metrics, wait_timeout, on, no_stall=compiles_behind)
        except (ImportError, AttributeError) as exc:
            # a torch that lacks even what the hooks module imports
            metrics.fallback(Reason.TORCH_INTERNALS, f"cannot hook this torch ({exc!r}); it compiles without the cache")
        else:
            _session.hooked = True
            skip = () if want_tier else ("precompiled",)
            left_off, message = compat.warning(
                hooks, torch.__version__, skip=skip if want_no_stall else (*skip, "no_stall")
            )
            if left_off:
                metrics.fallback(Reason.TORCH_INTERNALS, message)
            elif message:
                log.warning("recipecache: %s", message)
        if _session.hooked:
            _record_settings(store, metrics, torch)
        if _session.hooked and "rank_binding" in on:
            _warn_per_rank_graphs()
        if _session.hooked and want_tier and "precompiled" in on:
            try:
                from .precompiled import tier

                _session.tier = tier.attach(
                    store, metrics, wait_timeout, integration.keys.cpu_key, integration.kernels.kernels_loaded
                )
            except (ImportError, AttributeError) as exc:  # beyond what compat checks
                metrics.fallback(Reason.TORCH_INTERNALS, f"no precompiled tier on this torch ({exc!r})")
        _session.store, _session.metrics, _session.next_step = store, metrics, 0
        metrics.enabled(started, time.time())
        if not _session.exit_hook:
            atexit.register(_at_exit)
            _session.exit_hook = True
        log.info("recipecache: torch.compile caches go to %s (namespace %s)", store.url, store.namespace)
        return store


def _record_settings(store: Store, metrics: Metrics, torch: Any) -> None:
    """The settings the ranks of a job must agree on to share artifacts, in the metrics (the report compares them):
    the thread count enters torch's keys, the store and namespace say where artifacts go, and the node tier whether
    one rank per node fetches each (recipecache-run gives every rank the same; another launcher may not)."""
    from ..backends import redact
    from ..settings import node_dir

    metrics.settings(
        threads=int(torch.get_num_threads()),
        cache=redact(store.url),
        namespace=store.namespace,
        node_tier=node_dir() is not None,
    )


def _warn_per_rank_graphs() -> None:
    """Say at startup when this rank's graphs with collectives will be compiled per rank, and why (issue 27).

    torch's compile_on_one_rank makes a DTensor graph read its process groups from a device mesh
    it holds as a constant, which a graph loaded from a cache lacks: such graphs stay keyed per
    rank (:mod:`.rank_binding`). A flag turned on later in the script is seen at the first such
    graph (fallback ``rank_bound``, warned once, in the report).
    """
    from .precompiled.keys import compile_on_one_rank

    if compile_on_one_rank():
        log.warning(
            "recipecache: torch's compile_on_one_rank is on: graphs that hold a device mesh (DTensor tensor "
            "or sequence parallel) will be compiled by every rank, not once per job (they read their process "
            "groups from the mesh they hold, which a graph loaded from a cache lacks); turn it off to share them"
        )


def disable() -> None:
    """Give torch back every setting and function enable() changed; the metrics stay readable."""
    with _session.lock:
        if _session.tier is not None:
            _session.tier.uninstall()
            _session.tier = None
        if _session.hooked:
            from . import patches

            patches.detach()
            _session.hooked = False
        if _session.metrics is not None:
            _session.metrics.write()


def metrics() -> dict[str, Any]:
    """This process's counters in the metrics-file format ({} before the first enable())."""
    current = _session.metrics
    return {} if current is None else current.snapshot()


def write_metrics() -> None:
    """Write this process's metrics file now (a no-op before enable() or without a metrics file).

    ``recipecache-run``'s bootstrap calls it as soon as the script's body returns: the
    ``atexit`` handler that writes the file otherwise runs after the script's own handlers
    (they run last registered first), and a rank that hangs in one of those is ended by the
    launcher before its figures are written.
    """
    if _session.metrics is not None:
        _session.metrics.write()


def mark_step(step: int | None = None) -> None:
    """Record that training step ``step`` (default: the next index) ended, for the simulator's trace.

    A no-op until enable() ran, so training scripts may call it unconditionally.
    """
    with _session.lock:
        store = _session.store
        if store is None:
            return
        index = _session.next_step if step is None else step
        _session.next_step = index + 1
    store.events.record("step", "", 0.0, step=index)


def _at_exit() -> None:
    if _session.hooked:
        from . import patches

        patches.finish_no_stall()
        patches.release_leases()
    if _session.metrics is not None:
        _session.metrics.write(if_changed=True)  # unchanged since the script returned: the file is right
