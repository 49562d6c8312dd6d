"""The start-up hook: ``RECIPECACHE_ENABLE=1`` turns recipecache on in every training rank of a job, whatever
launcher started the ranks (torchrun, ``accelerate launch``, Lightning's DDP launcher, ``srun``, ``mpirun``, Ray),
with no change to the training script.

How a process gets here: the package installs ``recipecache-autoenable.pth`` into site-packages (``setup.py``
puts it at the root of the wheel, and of the editable wheel ``pip install -e`` builds). Python runs its one line
in every process at start-up; the line compares one environment variable and imports nothing unless it is set,
so a process without it pays nothing measurable (``benchmarks/startup_bench.py``). With it set, the line imports
this module once (site may process site-packages twice: CPython 3.11 in a virtual environment does) and turns an
import that fails into one warning line rather than site's traceback.

With it set, :func:`start` only gives a rank its own torch cache directories when ``RECIPECACHE_RANK_DIRS`` asks
(that must happen before torch is imported) and waits for torch: once torch is imported,
:mod:`recipecache.torch_integration.autoenable` wraps ``torch.compile`` and ``init_process_group``, and the first
of them called in a *rank* enables recipecache there, once. Which processes are ranks: the ones that join a
process group, or call ``torch.compile`` with a global rank in their environment (:data:`RANK_VARIABLES`). The
other processes of a job that inherit the variable (pip, the torchrun agent, DataLoader workers, inductor's
compile workers, recipecache's own no-stall worker, a Ray raylet) do neither, so they never open a store nor
write a rank's metrics. Waiting that long is what catches the ranks whose rank is known only late: Lightning's
first process becomes rank 0 when its launcher starts the others, a Ray worker when Ray Train sets up its group.

Each rank then writes its metrics file and event log into one run directory per job, named after the launcher's
own job identity (:func:`job_name`), so ``recipecache report RUN_DIR`` (and ``explain``, ``trace``) work on any
job, and gets the settings recipecache-run would give it (:func:`rank_environment`). Whatever goes wrong here is
one warning, never an exception: the cache must not break a process.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import re
import sys
import time
import types
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from . import env
from .errors import ConfigError

log = logging.getLogger(__name__)
# The hook's warnings reach stderr whether or not the process set up logging: the package's NullHandler would
# swallow them, and nothing else would tell a user that a job they meant to cache runs without recipecache.
_stderr = logging.StreamHandler()
_stderr.setFormatter(logging.Formatter("%(message)s"))
log.addHandler(_stderr)
log.propagate = False

#: a process's global rank, as the launchers set it: torchrun (and so accelerate launch), Slurm, Open MPI, MPICH
#: and Intel MPI, PMIx; the first set wins
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
#: the job's number of processes, likewise
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
#: how many of the job's processes run on this node, likewise (unknown: the thread count is left as it is)
LOCAL_WORLD_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
)
#: the launchers' own job identities, the first set wins: ``(variable, prefix of the run directory's name)``.
#: torchrun's run id is ``none`` unless given (``--rdzv-id``; ``--standalone`` makes one up); a Slurm job's
#: steps are apart (one allocation may run several jobs, one ``srun`` each). Ray's job id is not one: it counts
#: the jobs of one cluster, so every new local cluster's first job is ``01000000`` (:func:`fallback_job_name`)
JOB_IDENTITIES = (
    ("TORCHELASTIC_RUN_ID", "torchelastic"),
    ("SLURM_JOB_ID", "slurm"),
    ("PMIX_NAMESPACE", "mpi"),
)
#: where run directories go without ``RECIPECACHE_RUNS_DIR``, as recipecache-run's default ``--run-dir``
DEFAULT_RUNS_DIR = "recipecache-runs"
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def _first_count(environ: Mapping[str, str], names: Sequence[str], *, least: int) -> int | None:
    """The first of ``names`` set to a whole number >= ``least``; None when none is."""
    for name in names:
        text = environ.get(name, "").strip()
        if text.isdigit() and int(text) >= least:
            return int(text)
    return None


def global_rank(environ: Mapping[str, str]) -> int | None:
    """This process's global rank as its launcher set it (:data:`RANK_VARIABLES`), or None: not (yet) known to be
    a rank. ``LOCAL_RANK`` alone does not say which rank (Lightning's started ranks have only it until their
    process group is up)."""
    return _first_count(environ, RANK_VARIABLES, least=0)


def world_size(environ: Mapping[str, str]) -> int | None:
    return _first_count(environ, WORLD_SIZE_VARIABLES, least=1)


def local_world_size(environ: Mapping[str, str]) -> int | None:
    return _first_count(environ, LOCAL_WORLD_SIZE_VARIABLES, least=1)


def _clean(text: str) -> str:
    return _NOT_IN_NAME.sub("-", text).strip("-.")[:100]


def job_name(environ: Mapping[str, str]) -> str | None:
    """The run directory's name from the launcher's own job identity (:data:`JOB_IDENTITIES`), the same in every
    rank of the job; None when the environment has none (the ranks then agree on one through their process group:
    :func:`fallback_job_name`)."""
    for name, prefix in JOB_IDENTITIES:
        value = _clean(environ.get(name, ""))
        if not value or (name == "TORCHELASTIC_RUN_ID" and value == "none"):
            continue
        if name == "SLURM_JOB_ID" and environ.get("SLURM_STEP_ID", "").isdigit():
            value += f".{environ['SLURM_STEP_ID']}"
        return f"{prefix}-{value}"
    return None


def fallback_job_name(environ: Mapping[str, str], now: float | None = None) -> str:
    """``<MASTER_ADDR>-<MASTER_PORT>-<time>``, or ``ray-<job id>-<time>`` in a Ray job: rank 0's proposal when the
    launcher names no job. The address and port alone would be the next job's too (torchrun's default port is
    29500 for every job), and so would Ray's job id alone."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    ray_job = _clean(environ.get("RAY_JOB_ID", ""))
    if ray_job:
        return f"ray-{ray_job}-{stamp}"
    where = _clean(f"{environ.get('MASTER_ADDR', 'localhost')}-{environ.get('MASTER_PORT', '0')}")
    return f"{where or 'job'}-{stamp}"


def run_dir(environ: Mapping[str, str], name: str) -> Path:
    """The job's run directory: ``RECIPECACHE_RUN_DIR``, else ``name`` under ``RECIPECACHE_RUNS_DIR`` (default
    ``./recipecache-runs``, as recipecache-run's)."""
    given = environ.get(env.RUN_DIR)
    if given:
        return Path(given).absolute()
    return (Path(environ.get(env.RUNS_DIR) or DEFAULT_RUNS_DIR) / name).absolute()


def rank_environment(
    environ: Mapping[str, str], *, rank: int, world: int, job: str, script: str | None
) -> dict[str, str]:
    """The variables to set in a rank the start-up hook enables, before ``enable()`` reads them: what
    recipecache-run gives its ranks, each chosen by the code recipecache-run chooses it with, and only where the
    environment does not say already.

    ``RANK``/``WORLD_SIZE`` (a rank whose launcher set only ``SLURM_PROCID``, or none before its process group:
    its metrics file and event log are named by ``RANK``), the run directory's metrics file and event log, the
    namespace (the script's name), the thread count (torchrun's choice, which enters torch's keys) and the node
    directory (recipecache-run's default; an empty ``RECIPECACHE_NODE_DIR`` keeps the node tier off).
    """
    from .node_tier import default_node_dir  # the store's modules: only in a rank that enables
    from .settings import default_threads, namespace_for

    directory = run_dir(environ, job)
    wanted = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        env.RUN_DIR: str(directory),
        env.METRICS_FILE: str(directory / env.RUN_METRICS_NAME),
        env.EVENT_LOG: str(directory / env.RUN_EVENTS_NAME),
        env.NODE_DIR: str(default_node_dir()),
    }
    if script and script not in ("-c", "-m", "-") and not _installed(Path(script)):
        wanted[env.NAMESPACE] = namespace_for(Path(script))
    threads = default_threads(environ, several_per_node=(local_world_size(environ) or 1) > 1)
    if threads is not None:
        wanted["OMP_NUM_THREADS"] = str(threads)
    return {name: value for name, value in wanted.items() if name not in environ}


def _installed(script: Path) -> bool:
    """Whether ``script`` is an installed package's, not the user's: a rank Ray starts runs Ray's
    ``default_worker.py``, whose name would be every Ray job's namespace."""
    return any(part in ("site-packages", "dist-packages") for part in script.parts)


def use_rank_dirs(environ: MutableMapping[str, str]) -> None:
    """Point this rank's torch caches and temp files at ``$RECIPECACHE_RANK_DIRS/rank<RANK>``.

    Ranks on one machine then cannot share through torch's local caches, as if each ran on its own node (tests,
    benchmarks). It must happen before torch is imported: inductor and ``tempfile`` read these variables once.
    A directory that cannot be made is a ConfigError (recipecache-run's bootstrap stops the rank with it, the
    start-up hook warns).
    """
    base = environ.get(env.RANK_DIRS)
    if not base:
        return
    rank_dir = Path(base) / f"rank{environ.get('RANK', '0')}"
    for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TMPDIR", "tmp")):
        path = rank_dir / sub
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{env.RANK_DIRS}={base!r}: cannot create {path}: {exc.strerror or exc}") from None
        environ[name] = str(path)


def warn(problem: object) -> None:
    """The start-up hook's one line about a failure: the process goes on without recipecache."""
    rank = global_rank(os.environ)
    where = f"rank {rank}: " if rank is not None else ""
    log.warning("recipecache: warning: %s%s; this process runs without recipecache", where, problem)


class _TorchWatch:
    """Waits for ``import torch``, then has :mod:`recipecache.torch_integration.autoenable` wrap torch's entry
    points once torch's own import has finished. It finds nothing itself: it asks the finders after it for torch's
    spec and only hooks the end of that loader's ``exec_module``, so torch is imported exactly as without it.
    (A meta path finder is any object with ``find_spec``: ``importlib.abc`` would cost every process the hook
    runs in an import of ``importlib.resources``.)"""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        try:
            spec = next(
                filter(None, (f.find_spec(fullname, path, target) for f in sys.meta_path if hasattr(f, "find_spec"))),
                None,
            )
            loader = spec.loader if spec is not None else None
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            original = loader.exec_module

            def exec_module(module: types.ModuleType) -> None:
                original(module)
                torch_imported(module)

            loader.exec_module = exec_module  # type: ignore[method-assign]  # this one loader, of torch's spec only
        except Exception as exc:  # noqa: BLE001 - the hook never breaks a process: torch is found as without it
            warn(f"{env.ENABLE}=1, but the import of torch cannot be followed ({exc!r})")
            return None
        return spec


def torch_imported(torch: types.ModuleType) -> None:
    try:
        from .torch_integration import autoenable

        autoenable.install(torch)
    except Exception as exc:  # noqa: BLE001 - the hook never breaks a process: one warning, and no cache
        warn(f"{env.ENABLE}=1, but torch cannot be hooked ({exc!r})")


_started = False


def start(environ: MutableMapping[str, str] | None = None) -> None:
    """What the ``.pth`` line runs when ``RECIPECACHE_ENABLE`` is set: per-rank directories, then wait for torch."""
    global _started
    environ = os.environ if environ is None else environ
    if _started:  # site may process site-packages twice (CPython 3.11 in a virtual environment does)
        return
    _started = True
    try:
        if not env.switch(env.ENABLE, environ):
            return
        if global_rank(environ) is not None:
            use_rank_dirs(environ)
        if "torch" in sys.modules:
            torch_imported(sys.modules["torch"])
        else:
            sys.meta_path.insert(0, _TorchWatch())
    except ConfigError as exc:
        warn(exc)
    except Exception as exc:  # noqa: BLE001 - the hook never breaks a process: one warning, and no cache
        warn(repr(exc))
