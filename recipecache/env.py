"""The one home of recipecache's environment: every ``RECIPECACHE_*`` name, the rank, the version.

Processes of one job are wired together through environment variables (the launcher sets
them, every rank reads them), so their names are an interface: they live here, and the
store, the integrations and the launcher all take them from here. This module imports
nothing from the rest of the package, so any layer may use it.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping

from .errors import ConfigError, echo
from .quantities import decimal

logger = logging.getLogger(__name__)

__version__ = "0.2.0"

PREFIX = "RECIPECACHE_"
#: the store URL of a process
URL = "RECIPECACHE_URL"
#: directory of the default filesystem store (when no URL is given)
DIR = "RECIPECACHE_DIR"
#: keeps jobs and projects apart in one store
NAMESPACE = "RECIPECACHE_NAMESPACE"
#: the signing key itself, or a file holding it
SECRET = "RECIPECACHE_SECRET"
SECRET_FILE = "RECIPECACHE_SECRET_FILE"
#: seconds a process waits for another's compile before compiling itself
WAIT_TIMEOUT = "RECIPECACHE_WAIT_TIMEOUT"
#: lifetime of a compile lease in seconds (renewed every third of it)
LEASE_TTL = "RECIPECACHE_LEASE_TTL"
#: node-local directory in front of the remote store; processes with the same one are one node
#: (``{rank}`` is replaced by the process's rank, so a launcher can give each rank its own)
NODE_DIR = "RECIPECACHE_NODE_DIR"
#: size cap of the node directory (``20GiB``); least recently used entries go first
NODE_MAX_SIZE = "RECIPECACHE_NODE_MAX_SIZE"
#: directory of the per-process JSON-lines event logs
EVENT_LOG = "RECIPECACHE_EVENT_LOG"
#: per-process metrics file (``{rank}`` is replaced), and whether to rewrite it on every change
METRICS_FILE = "RECIPECACHE_METRICS_FILE"
METRICS_FLUSH = "RECIPECACHE_METRICS_FLUSH"
#: set by recipecache-run: the bootstrap calls ``recipecache.enable()`` in each rank
AUTO_ENABLE = "RECIPECACHE_AUTO_ENABLE"
#: ``1``: recipecache's start-up hook (the ``recipecache-autoenable.pth`` line the package installs) enables the cache
#: in every process of a job that is a training rank, whatever launcher started it (:mod:`recipecache.autoenable`)
ENABLE = "RECIPECACHE_ENABLE"
#: the run directory: where each rank writes its metrics file and event log (recipecache-run's ``--run-dir``; a
#: rank the start-up hook enabled makes one per job under ``RECIPECACHE_RUNS_DIR``, named after the job)
RUN_DIR = "RECIPECACHE_RUN_DIR"
#: where the start-up hook makes each job's run directory when ``RECIPECACHE_RUN_DIR`` is not set
RUNS_DIR = "RECIPECACHE_RUNS_DIR"
#: what a run directory holds, the same whoever wrote it: each rank's metrics file (``{rank}`` replaced) and the
#: directory of the event logs; ``recipecache report`` and recipecache-run's report read them
RUN_METRICS_NAME = "metrics-rank{rank}.json"
RUN_EVENTS_NAME = "events"
#: set by recipecache-run --rank-dirs: each rank gets private torch cache and temp dirs under it
RANK_DIRS = "RECIPECACHE_RANK_DIRS"
#: set by recipecache-run --prewarm: compile the declared shapes before training
PREWARM = "RECIPECACHE_PREWARM"
#: set by recipecache-run: the directory where each rank's bootstrap marks that its script finished
FINISHED_DIR = "RECIPECACHE_FINISHED_DIR"
#: set by recipecache-run: its pid, so that a rank can tell that its torchrun agent is the launcher's child
LAUNCHER_PID = "RECIPECACHE_LAUNCHER_PID"
#: replaces the host-CPU fingerprint in torch artifact keys: the operator's statement that the
#: nodes setting it to one value run each other's compiled kernels safely (and the tests' hook)
CPU_FINGERPRINT = "RECIPECACHE_CPU_FINGERPRINT"
#: set by recipecache-run --precompile (or by hand): enable() also turns on the precompiled tier
PRECOMPILE = "RECIPECACHE_PRECOMPILE"
#: set by recipecache-run --no-stall (or by hand): a graph that missed runs without inductor while
#: one process compiles it behind the steps (``1`` on, ``0`` or unset off)
NO_STALL = "RECIPECACHE_NO_STALL"
#: with no-stall in a job of several processes: a process whose worker is busy offers the compiles queued behind it
#: through the store, and one whose worker is idle takes them (:mod:`recipecache.compile_pool`; ``0`` off, default on)
COMPILE_POOL = "RECIPECACHE_COMPILE_POOL"
#: seconds a process may take to exit once its work is done. recipecache-run's own (its --exit-grace):
#: how long a node's ranks may take to exit once the script finished on all of them; it gives each
#: rank a share of it, which the rank spends at most finishing the compiles it runs behind the steps
EXIT_GRACE = "RECIPECACHE_EXIT_GRACE"
#: the exit grace of a process not told otherwise: enough for atexit handlers that flush or upload,
#: far less than a hang that would hold the job
DEFAULT_EXIT_GRACE_S = 120.0
#: seconds one compile behind the steps may take before its worker is ended and its lease
#: released (a stuck worker would otherwise keep every rank running the graph without inductor)
NO_STALL_TIMEOUT = "RECIPECACHE_NO_STALL_TIMEOUT"
#: variables renamed after the feature they set, by their new names: the old name is still read when the
#: new one is not set, with a deprecation line (a job script written for an older release keeps working)
RENAMED = {NO_STALL_TIMEOUT: "RECIPECACHE_BEHIND_TIMEOUT"}


def process_rank(environ: Mapping[str, str] | None = None) -> int:
    """The global rank of this process as torchrun sets it (``RANK``), else 0."""
    text = (os.environ if environ is None else environ).get("RANK", "0")
    try:
        return int(text)
    except ValueError:
        return 0


def process_world_size(environ: Mapping[str, str] | None = None) -> int:
    """How many processes the job has as torchrun sets it (``WORLD_SIZE``), else 1."""
    text = (os.environ if environ is None else environ).get("WORLD_SIZE", "1")
    try:
        return max(1, int(text))
    except ValueError:
        return 1


def switch(name: str, environ: Mapping[str, str] | None = None, *, default: bool = False) -> bool:
    """The on/off variable ``name``: ``1`` on, ``0`` off, unset (or empty) ``default``; ConfigError for anything else.

    The one rule for every switch, whether the launcher sets it or a user does by hand: a
    ``yes`` or ``true`` silently read as off would hide the mistake (a job without the tier it
    asked for), so it is an error, the same line for each.
    """
    text = (os.environ if environ is None else environ).get(name, "")
    if text not in ("", "0", "1"):
        raise ConfigError(f"{name}={echo(text)}: use 1 (on) or 0 (off)")
    return default if text == "" else text == "1"


#: what an operator's CPU fingerprint may be: it becomes part of store keys
_CPU_FINGERPRINT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def cpu_fingerprint_override(environ: Mapping[str, str] | None = None) -> str | None:
    """``RECIPECACHE_CPU_FINGERPRINT`` when set (ConfigError unless 1-64 of ``A-Z a-z 0-9 . _ -``), else None."""
    text = (os.environ if environ is None else environ).get(CPU_FINGERPRINT)
    if text and not _CPU_FINGERPRINT_PATTERN.match(text):
        raise ConfigError(f"{CPU_FINGERPRINT}={echo(text)}: use 1-64 characters from A-Z a-z 0-9 . _ -")
    return text or None


def positive_seconds(what: str, text: str | float, bounds: tuple[float, float] | None = None) -> float:
    """``text`` as a finite number of seconds > 0, and within ``bounds`` (both included) if given;
    ConfigError naming ``what``, the value and the range otherwise.

    Text (what a person typed) is read by the rule of :mod:`recipecache.quantities`; a number
    (a program's argument) is taken as it is. Either way nan and inf are refused: a nan
    timeout never expires a comparison, so a waiter would poll forever, and an infinite lease
    would never be taken over from a dead holder.
    ``bounds`` are for values a service takes in its own units (Redis: whole milliseconds,
    at least 1 and below 2**63), which a float the parser accepts can fall outside.
    """
    low, high = bounds or (0.0, math.inf)
    if isinstance(text, str):
        value = decimal(text, low, high)
    else:
        value = float(text) if math.isfinite(text) and low <= text <= high else None
    if value is None or value <= 0:
        allowed = f" from {bounds[0]:.15g} to {bounds[1]:.15g}" if bounds else ""
        raise ConfigError(f"{what}={echo(str(text))} must be a positive, finite number of seconds{allowed}")
    return value


def seconds(
    name: str, default: float, environ: Mapping[str, str] | None = None, *, bounds: tuple[float, float] | None = None
) -> float:
    """The environment variable ``name`` as positive, finite seconds (within ``bounds``), or ``default`` when unset or empty."""
    environ = os.environ if environ is None else environ
    text = environ.get(name)
    old = RENAMED.get(name)
    if not text and old is not None and environ.get(old):
        logger.warning("recipecache: %s is deprecated; use %s", old, name)
        name, text = old, environ[old]
    return positive_seconds(name, text, bounds) if text else default
