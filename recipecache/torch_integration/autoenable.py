"""The start-up hook's torch side (:mod:`recipecache.autoenable`): enable recipecache in a rank, once, at the first
point where the process is known to be a rank and the job's run directory can be named.

Once torch is imported, :func:`install` wraps ``torch.compile`` and ``init_process_group`` (the names
``torch.distributed`` and ``distributed_c10d`` give, the ones launchers and scripts call):

* ``torch.compile`` called in a process whose launcher set a global rank (``RANK``, ``SLURM_PROCID``, ...) whose
  job has an identity of its own (torchrun's run id, Slurm's job, ...) enables before anything is compiled;
* a process group that comes up makes its process a rank (Lightning's first process, a Ray worker, a script that
  passes its rank by hand): it enables right after ``init_process_group`` returns. When the launcher names no job
  (plain torchrun without ``--rdzv-id``, ``srun python`` outside a batch job, ranks started by hand), rank 0
  proposes a name and every rank reads it through the group's store (:func:`agreed_job_name`), so all ranks write
  into one run directory.

Then the wrappers are taken out again: enabled or failed, a rank decides once. A failure is one warning and the
rank trains without the cache.
"""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from .. import autoenable as hook
from .. import env

log = logging.getLogger(__name__)

#: how long a rank waits for rank 0's run directory name in the group's store: rank 0 writes it as soon as its
#: ``init_process_group`` returns, which is when everyone's does; longer means rank 0 runs without the hook
AGREE_TIMEOUT_S = 30.0
#: the store key of rank 0's name (per torchelastic restart: a restarted job is a new run)
_NAME_KEY = "recipecache/run-name/{restart}"


class _Hook:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.decided = False
        #: (module, attribute name, the original, our wrapper)
        self.patched: list[tuple[types.ModuleType, str, Any, Any]] = []


_hook = _Hook()


def install(torch: types.ModuleType) -> None:
    """Wrap ``torch.compile`` and ``init_process_group`` so the first call in a rank enables recipecache."""
    import torch.distributed as dist

    with _hook.lock:
        if _hook.patched or _hook.decided:
            return
        compile_fn = torch.compile

        @functools.wraps(compile_fn)
        def compile(*args: Any, **kwargs: Any) -> Any:
            consider()
            return compile_fn(*args, **kwargs)

        _patch(torch, "compile", compile)
        if dist.is_available():
            from torch.distributed import distributed_c10d

            init = distributed_c10d.init_process_group

            @functools.wraps(init)
            def init_process_group(*args: Any, **kwargs: Any) -> Any:
                result = init(*args, **kwargs)
                consider()
                return result

            for module in (dist, distributed_c10d):
                _patch(module, "init_process_group", init_process_group)


def _patch(module: types.ModuleType, name: str, wrapper: Callable[..., Any]) -> None:
    _hook.patched.append((module, name, getattr(module, name), wrapper))
    setattr(module, name, wrapper)


def _uninstall() -> None:
    """Give torch its functions back (where nobody replaced our wrapper since)."""
    for module, name, original, wrapper in _hook.patched:
        if getattr(module, name, None) is wrapper:
            setattr(module, name, original)
    _hook.patched.clear()


def consider() -> None:
    """Enable recipecache here if this process is a rank and its run directory can be named; else wait for the
    next call. Never raises."""
    with _hook.lock:
        if _hook.decided:
            return
        try:
            if not _enable_if_rank():
                return
        except Exception as exc:  # noqa: BLE001 - the hook never breaks a rank: one warning, and no cache
            hook.warn(f"{env.ENABLE}=1, but recipecache cannot be enabled: {exc}")
        _hook.decided = True
        _uninstall()


def _enable_if_rank() -> bool:
    """True once decided (enabled); False: not (yet) a rank, or the ranks cannot agree on a name yet."""
    import torch
    import torch.distributed as dist

    environ = os.environ
    grouped = dist.is_available() and dist.is_initialized()
    if not grouped and multiprocessing.parent_process() is not None:
        return False  # a rank's worker (a DataLoader's, an evaluation's) inherits its rank; it is one if it joins
    rank = dist.get_rank() if grouped else hook.global_rank(environ)
    if rank is None:
        return False
    name = hook.job_name(environ)
    if name is None and not environ.get(env.RUN_DIR):  # a run directory given by name needs no agreement
        if not grouped:
            return False
        name = agreed_job_name(dist, hook.fallback_job_name(environ))
    world = dist.get_world_size() if grouped else (hook.world_size(environ) or 1)
    settings = hook.rank_environment(
        environ, rank=rank, world=world, job=name or "", script=sys.argv[0] if sys.argv else None
    )
    environ.update(settings)
    if "OMP_NUM_THREADS" in settings:  # torch read it at import; the count enters its cache keys
        torch.set_num_threads(int(settings["OMP_NUM_THREADS"]))
    from . import enable

    enable()
    if dist.is_available():
        _write_metrics_on_leaving_group(dist)
    log.info("recipecache: enabled by %s=1 (run directory %s)", env.ENABLE, environ[env.RUN_DIR])
    return True


def _write_metrics_on_leaving_group(dist: Any) -> None:
    """Write the rank's metrics file when it destroys its process group, as well as at exit.

    recipecache-run's bootstrap writes it when the script returns; a rank the hook enabled has no such point, and
    Ray ends its workers without running their exit handlers (Ray Train destroys each worker's group first)."""
    from torch.distributed import distributed_c10d

    from . import write_metrics

    destroy = distributed_c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        if (args[0] if args else kwargs.get("group")) is None:  # the default group: the rank leaves the job
            write_metrics()
        return destroy(*args, **kwargs)

    for module in (dist, distributed_c10d):
        module.destroy_process_group = destroy_process_group


def agreed_job_name(dist: Any, proposal: str) -> str:
    """Rank 0's ``proposal``, read by every rank through the process group's store; a rank whose rank 0 never
    writes it (rank 0 without the hook) keeps its own after :data:`AGREE_TIMEOUT_S`, with a warning."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    key = _NAME_KEY.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if dist.get_rank() == 0:
        store.set(key, proposal)
        return proposal
    try:
        store.wait([key], datetime.timedelta(seconds=AGREE_TIMEOUT_S))
        return bytes(store.get(key)).decode()
    except Exception as exc:  # noqa: BLE001 - a name of its own is still a run directory
        hook.log.warning(
            "recipecache: warning: rank %d: rank 0 named no run directory within %g s (%s); writing into %s",
            dist.get_rank(),
            AGREE_TIMEOUT_S,
            exc,
            proposal,
        )
        return proposal
