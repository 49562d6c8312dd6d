"""What one ``recipecache-run`` invocation means, resolved and checked before anything starts.

:class:`LaunchConfig` is built from the parsed command line and the environment and is
frozen: everything later (the torchrun command, every rank's environment, the report)
is derived from it, so a unit test can check the wiring without starting a job.

Every rank must see the *same* cache URL, namespace, thread count and precompiled-header
flag: the last two enter torch's own cache keys (see the torch notes), so a rank with a
different value would miss every artifact the others built.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from recipecache import env, quantities
from recipecache.backends import StoreURL, backend_class, open_backend
from recipecache.errors import BackendError, ConfigError, echo
from recipecache.fsutil import check_directory_to_be, check_output_file, private_directory
from recipecache.hpu.recipe_cache_config import MOST_SIZE_MB as MOST_HPU_SIZE_MB
from recipecache.node_tier import default_node_dir
from recipecache.settings import (
    MOST_PER_NODE,
    check_rank_environment,
    default_threads,
    namespace_for,
    read_secret,
    read_secret_file,
    resolve_namespace,
    resolve_url,
)

from . import hpu_metrics
from .option_env import given_as
from .torchrun_options import NPROC_PER_NODE, check_value, environment_name, pass_through

#: ``--nproc`` words torchrun resolves itself (anything else must be a positive count).
NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
#: Seconds the up-front reachability check of a Redis store may take (unless the URL sets ``timeout``).
PROBE_TIMEOUT_S = 3.0
#: ``--hpu-max-size-mb`` unless given: the node's recipe directory cap
DEFAULT_HPU_MAX_SIZE_MB = 1024
#: ``--exit-grace`` accepted, in seconds: a rank's share of it becomes timeouts in every rank, and a grace
#: over a day would hold a hung job that long
EXIT_GRACE_RANGE_S = (1.0, 86400.0)
#: the part of the exit grace a rank may spend finishing no-stall compiles still running at exit
NO_STALL_SHARE_OF_GRACE = 0.8


@dataclass(frozen=True)
class LaunchConfig:
    script: Path
    script_args: tuple[str, ...]
    nproc: str
    #: the store URL every rank gets (``--url``, ``$RECIPECACHE_URL``, else the filesystem default)
    url: str
    namespace: str
    run_dir: Path
    report_path: Path
    enable: bool = True
    threads: int | None = None
    secret_file: Path | None = None
    rank_dirs: Path | None = None
    #: the node tier's directory for every rank (``{rank}`` per rank); None: no node tier
    node_dir: str | None = None
    #: run the shapes the script declares (recipecache.declare_shapes) before training
    prewarm: bool = False
    #: the precompiled tier: ranks load whole compiled functions instead of tracing
    precompile: bool = False
    #: no-stall: a graph that missed runs without inductor while one rank compiles it behind the steps
    no_stall: bool = False
    #: Gaudi: the node-local recipe directory every rank's bridge uses, synced by an agent
    hpu_dir: Path | None = None
    hpu_max_size_mb: int = DEFAULT_HPU_MAX_SIZE_MB
    hpu_clear: bool = False
    #: no progress lines while the job runs (compile start and finish per rank)
    quiet: bool = False
    #: a rank still running this long after the script finished on every rank of the node is ended
    exit_grace_s: float = env.DEFAULT_EXIT_GRACE_S
    #: torchrun options as given, in torchrun's dash spelling: ``(("--nnodes", "2"), ("--standalone", None))``
    torchrun_options: tuple[tuple[str, str | None], ...] = ()

    # -- derived -------------------------------------------------------------------
    def torchrun_option(self, name: str) -> str | None:
        return next((value for opt, value in self.torchrun_options if opt == name), None)

    @property
    def local_world_size(self) -> int | None:
        """Ranks this node starts; None when torchrun resolves it (``auto``, ``gpu``, ...)."""
        return quantities.whole(self.nproc, 1, MOST_PER_NODE)

    @property
    def local_ranks(self) -> tuple[int, ...] | None:
        """Global ranks this node's processes get, when they are known before the job starts.

        Known on one node, and on several nodes with torchrun's static rendezvous (rank =
        node rank * nproc + local rank). Under an elastic rendezvous the ranks are handed
        out at run time, so the report can only list the ranks whose metrics it finds.
        """
        nproc = self.local_world_size
        if nproc is None:
            return None
        nnodes = self.torchrun_option("--nnodes") or "1"
        if nnodes in ("1", "1:1"):
            return tuple(range(nproc))
        if self.torchrun_option("--rdzv-backend") in (None, "static"):
            node_rank = int(self.torchrun_option("--node-rank") or 0)
            return tuple(range(node_rank * nproc, (node_rank + 1) * nproc))
        return None

    @property
    def events_dir(self) -> Path:
        return self.run_dir / env.RUN_EVENTS_NAME

    def torchrun_argv(self) -> list[str]:
        """Arguments after ``python``: torchrun running the bootstrap, which runs the script."""
        argv = ["-m", "torch.distributed.run", NPROC_PER_NODE.name, self.nproc]
        for name, value in self.torchrun_options:
            argv += [name] if value is None else [name, value]
        return [*argv, "-m", "launcher.bootstrap", str(self.script), *self.script_args]

    def rank_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The environment torchrun (and so every rank) starts with: ``base`` plus the wiring."""
        environ = dict(base)
        environ.update(
            {
                env.URL: self.url,
                env.NAMESPACE: self.namespace,
                env.METRICS_FILE: str(self.run_dir / env.RUN_METRICS_NAME),
                env.EVENT_LOG: str(self.events_dir),
                # Part of torch's key, so pinned for every rank: torch's default (on), whose
                # precompiled header makes cold kernel compiles fast; a hit does not build it.
                "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "1",
            }
        )
        if self.threads is not None:
            environ["OMP_NUM_THREADS"] = str(self.threads)
        if self.enable:
            environ[env.AUTO_ENABLE] = "1"
        else:
            environ.pop(env.AUTO_ENABLE, None)
        # recipecache-run enables its ranks itself (or, with --no-enable, leaves it to the script): an inherited
        # start-up hook switch would enable them past --no-enable
        environ.pop(env.ENABLE, None)
        if self.secret_file is not None:
            environ[env.SECRET_FILE] = str(self.secret_file)
            environ.pop(env.SECRET, None)  # the explicit option wins over the inherited secret
        if self.rank_dirs is not None:
            environ[env.RANK_DIRS] = str(self.rank_dirs)
        else:  # an inherited one (a user's export, an outer job's) is not this job's option
            environ.pop(env.RANK_DIRS, None)
        if self.node_dir is not None:
            environ[env.NODE_DIR] = self.node_dir
        else:
            environ.pop(env.NODE_DIR, None)
        # torchrun's log directory (its --log-dir, which wins): without one torchrun makes a
        # torchelastic_* directory in $TMPDIR for every job and never removes it
        environ.setdefault("PET_LOG_DIR", str(self.run_dir / "torchrun"))
        if self.prewarm:
            environ[env.PREWARM] = "1"
        if self.precompile:
            environ[env.PRECOMPILE] = "1"
        if self.no_stall:
            environ[env.NO_STALL] = "1"
        # what a rank may spend at exit finishing compiles behind the steps: within the grace after
        # which the launcher ends it, with a fifth of it left for the script's own atexit handlers
        environ[env.EXIT_GRACE] = f"{self.exit_grace_s * NO_STALL_SHARE_OF_GRACE:g}"
        if self.hpu_dir is not None:
            from recipecache.hpu import rank_environment

            # every local rank gets the same environment from torchrun, so the bridge's own
            # delete flag stays off; the node's sync agent clears the directory instead
            environ.update(
                rank_environment(0, namespace=self.namespace, directory=self.hpu_dir, max_size_mb=self.hpu_max_size_mb)
            )
            # the bridge's own compile and recipe-cache figures, one file per rank, for the report
            environ.update(hpu_metrics.rank_environment(self.run_dir, environ))
        return environ

    def hpu_metrics_file(self, base: Mapping[str, str]) -> Path | None:
        """The bridge's metrics file name the ranks get (before its ``-rank<N>``), or None without ``--hpu``."""
        if self.hpu_dir is None:
            return None
        return Path(self.rank_env(base)[hpu_metrics.METRICS_FILE])

    # -- construction --------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LaunchConfig:
        """Check and resolve the parsed command line (each option not given already filled from its
        ``RECIPECACHE_*`` variable, :mod:`launcher.option_env`); raises ConfigError with one line."""
        script = Path(args.script)
        try:
            found = script.is_file()
        except OSError as exc:  # a name longer than the system takes (ENAMETOOLONG), not just a missing file
            raise ConfigError(f"script {echo(args.script)}: {exc.strerror}") from None
        if not found:
            raise ConfigError(f"script {echo(args.script)} not found")
        nproc = (
            _nproc("--nproc", args.nproc)
            if args.nproc is not None
            else _nproc(environment_name(NPROC_PER_NODE), os.environ.get(environment_name(NPROC_PER_NODE)) or "1")
        )
        url = resolve_url(args.url)
        parsed = StoreURL.parse(url)
        if not backend_class(parsed).SHARED:
            raise ConfigError(
                f"{parsed.scheme}:// lives inside one process and cannot be shared by ranks; use file:// or redis://"
            )
        namespace = resolve_namespace(args.namespace, default=namespace_for(script))
        run_dir = Path(args.run_dir or Path("recipecache-runs") / time.strftime("%Y%m%d-%H%M%S"))
        # named by what the user gave: the run directory's option or variable, else the default's own words
        run_dir_named = given_as(args, "run_dir") if args.run_dir else "the default run directory"
        run_dir = check_directory_to_be(run_dir.absolute(), run_dir_named)
        options = tuple(
            (opt.name, check_value(opt, getattr(args, opt.dest)) if opt.takes_value else None)
            for opt in pass_through()
            if getattr(args, opt.dest) not in (None, False)
        )
        _check_torchrun_environment(args)
        config = cls(
            script=script.absolute(),
            script_args=tuple(args.script_args),
            nproc=nproc,
            url=url,
            namespace=namespace,
            run_dir=run_dir,
            report_path=check_output_file(Path(args.report).absolute(), given_as(args, "report"))
            if args.report
            else check_output_file(run_dir / "report.json", f"the report in {run_dir_named}"),
            enable=not args.no_enable,
            threads=_threads(args, nproc),
            # from $RECIPECACHE_SECRET_FILE the ranks read it themselves, after $RECIPECACHE_SECRET
            secret_file=_secret_file(args.secret_file if given_as(args, "secret_file") == "--secret-file" else None),
            exit_grace_s=(
                env.DEFAULT_EXIT_GRACE_S
                if args.exit_grace is None
                else env.positive_seconds(given_as(args, "exit_grace"), args.exit_grace, EXIT_GRACE_RANGE_S)
            ),
            rank_dirs=_rank_dirs(args),
            node_dir=_node_dir(args),
            prewarm=args.prewarm,
            precompile=args.precompile,
            no_stall=args.no_stall,
            hpu_dir=_hpu_dir(args, namespace),
            hpu_max_size_mb=(
                DEFAULT_HPU_MAX_SIZE_MB
                if args.hpu_max_size_mb is None
                else quantities.whole_number(
                    given_as(args, "hpu_max_size_mb"), args.hpu_max_size_mb, 1, MOST_HPU_SIZE_MB
                )
            ),
            hpu_clear=args.hpu_clear,
            quiet=args.quiet,
            torchrun_options=options,
        )
        # what every rank will read (wait timeout, lease TTL, node directory cap, CPU fingerprint, switches),
        # checked before any starts: else each rank's enable() would stop on it
        check_rank_environment(config.rank_env(os.environ))
        return config


def _check_torchrun_environment(args: argparse.Namespace) -> None:
    """The ``PET_*`` variables torchrun reads for its options the command line lacks, checked as those options are:
    torchrun reads them only once it runs (``PET_MAX_RESTARTS=²``: its traceback, after the job started)."""
    for opt in pass_through():
        value = os.environ.get(environment_name(opt)) if opt.takes_value and getattr(args, opt.dest) is None else None
        if value:
            check_value(opt, value, environment_name(opt))


def _nproc(name: str, text: str) -> str:
    """The process count ``text`` came by ``name`` (``--nproc`` or torchrun's variable): a count or a word torchrun
    resolves."""
    if text in NPROC_WORDS:
        return text
    count = quantities.whole(text, 1, MOST_PER_NODE)
    if count is None:
        raise ConfigError(
            f"{name} must be a number of processes from 1 to {MOST_PER_NODE} or one of "
            f"{', '.join(NPROC_WORDS)}, got {echo(text)}"
        )
    return str(count)


def _threads(args: argparse.Namespace, nproc: str) -> int | None:
    """The per-rank thread count: ``--threads``, else :func:`recipecache.settings.default_threads` (torchrun's
    choice; with one process per node torch's default, which can differ between nodes, so heterogeneous
    multi-node jobs should pass ``--threads``)."""
    if args.threads is not None:
        return quantities.whole_number(given_as(args, "threads"), args.threads, 1, MOST_PER_NODE)
    return default_threads(os.environ, several_per_node=nproc != "1")


def _rank_dirs(args: argparse.Namespace) -> Path | None:
    """``--rank-dirs``, created here: one every rank cannot create its directory under is bad input, said once,
    not a failed rank each (issue 28: /dev/null failed every rank, under torchrun's traceback)."""
    if not args.rank_dirs:
        return None
    path = Path(args.rank_dirs).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{given_as(args, 'rank_dirs')} {str(path)[:200]}: {exc.strerror or exc}") from None
    return path


def _hpu_dir(args: argparse.Namespace, namespace: str) -> Path | None:
    """The node's recipe directory when ``--hpu`` is on, created and checked to be private."""
    if not args.hpu:
        if args.hpu_dir or args.hpu_clear:
            raise ConfigError(
                f"{given_as(args, 'hpu_dir') if args.hpu_dir else given_as(args, 'hpu_clear')} needs --hpu"
            )
        return None
    from recipecache.hpu import node_directory, prepare_node_directory

    return prepare_node_directory(node_directory(namespace, args.hpu_dir))


def _node_dir(args: argparse.Namespace) -> str | None:
    """The node tier's directory: ``--node-dir``, else one per rank under ``--rank-dirs`` (each rank
    a simulated node), else the node's default; None with ``--no-node-tier``. Checked here (private,
    usable) so a bad one fails before any rank starts."""
    if args.no_node_tier:
        if args.node_dir:
            raise ConfigError(
                f"{given_as(args, 'node_dir')} and {given_as(args, 'no_node_tier')} contradict each other"
            )
        return None
    if args.rank_dirs and not args.node_dir:
        return str(Path(args.rank_dirs).absolute() / "rank{rank}" / "node")
    if args.node_dir and "{rank}" in args.node_dir:
        return str(Path(args.node_dir).absolute())  # one per rank: each rank makes and checks its own
    return str(
        private_directory(Path(args.node_dir).absolute() if args.node_dir else default_node_dir(), "node directory")
    )


def _secret_file(path: str | None) -> Path | None:
    """The signing key file, checked here so a typo fails before any rank starts.

    Without ``--secret-file`` the ranks take the key from the environment; it is read
    here the same way (``RECIPECACHE_SECRET``, else the file ``RECIPECACHE_SECRET_FILE``),
    so a missing or empty file is one line now instead of a traceback in every rank.
    """
    if path is None:
        read_secret()
        return None
    read_secret_file(path, "--secret-file")
    return Path(path).absolute()


def probe_store(url: str) -> None:
    """Fail fast on a store no rank could use: malformed (ConfigError) or unreachable.

    A Redis that is down at launch would otherwise cost every rank a timeout and a
    job-long fallback to local compiles; one short ping here turns it into an error.
    """
    backend = open_backend(url, timeout=PROBE_TIMEOUT_S)  # malformed -> ConfigError naming the URL
    try:
        backend.ping()
    except BackendError as exc:
        raise ConfigError(f"cache {echo(backend.url, quote=False)} is unreachable ({exc.reason}: {exc})") from None
    finally:
        backend.close()
