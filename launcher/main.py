"""``recipecache-run``: parse -> :class:`~launcher.launch_config.LaunchConfig` -> run torchrun -> report.

torchrun runs as a child process (``python -m torch.distributed.run``) in its own
session, so a Ctrl-C reaches it exactly once, forwarded by the launcher, and torchrun
shuts its workers down the way it always does. The exit status is the job's (128 + N
when torchrun itself died of signal N); bad input exits 2 with one line and starts
nothing.

A rank still running ``--exit-grace`` seconds after the script finished on every rank of
the node (:mod:`launcher.exit_watch`) is ended: torchrun is asked to stop (so it restarts
nothing), then the rank is killed. The exit status is then the one the scripts gave their
processes (0 when every script completed; see :func:`launcher.exit_watch.job_status`),
and the report lists the ranks that were ended. So is the status of a job whose scripts all
completed but one of whose ranks then died while its interpreter shut down (a warning says
so; :func:`launcher.exit_watch.status_after_exit`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from recipecache import env
from recipecache.backends import command_line_password_warning, redact
from recipecache.errors import ConfigError
from recipecache.parent_death import die_with_parent
from recipecache.runs.report import build_report, format_report, load_graphs, load_metrics, write_report

from . import hpu_metrics
from .exit_watch import ExitWatch, FinishedRank, job_status, running_child, status_after_exit
from .launch_config import DEFAULT_HPU_MAX_SIZE_MB, NO_STALL_SHARE_OF_GRACE, LaunchConfig, probe_store
from .option_env import FallbackParser, given_as
from .progress import Progress
from .torchrun_options import NPROC_PER_NODE, pass_through, refused

log = logging.getLogger(__name__)

PROG = "recipecache-run"
#: Slack on "metrics written since the job started", for file systems with coarse mtimes.
MTIME_SLACK_S = 2.0
#: How often the launcher looks for ranks that outlived their script.
WATCH_INTERVAL_S = 1.0
#: After asking torchrun to stop, how long it may take before hung ranks, then torchrun, are killed.
KILL_AFTER_S = 10.0
#: The signals the launcher passes on to torchrun (a closed terminal's SIGHUP included), which then stops the job.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: How long the HPU agent may take for its last publishing pass before it is killed.
AGENT_STOP_TIMEOUT_S = 60.0


class _Refuse(argparse.Action):
    """A torchrun option the launcher cannot pass on (its reason is the action's ``help``, hidden from --help)."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} is not supported: {PROG} {self.reason}")


def build_parser(environ: Mapping[str, str] | None = None) -> FallbackParser:
    """The command line; each recipecache option not given falls back to its ``RECIPECACHE_*`` variable
    (:mod:`launcher.option_env`), read from ``environ`` (default ``os.environ``) when parsing."""
    parser = FallbackParser(
        prog=PROG,
        usage=f"{PROG} [options] [torchrun options] script [script args]",
        description="Run a training script under torchrun with every rank sharing one recipecache store, "
        "then print one compile report for the whole job.",
        epilog="Each recipecache option --foo-bar not given is read from $RECIPECACHE_FOO_BAR (a switch: 1 on, "
        "0 off). The torchrun options are passed to torch.distributed.run unchanged (see torchrun --help; "
        "torchrun reads its own from $PET_*); everything after the script goes to the script.",
        allow_abbrev=False,
        environ=environ,
    )
    ours = parser.add_argument_group("recipecache options")
    ours.add_argument(
        "--nproc",
        NPROC_PER_NODE.name,
        *NPROC_PER_NODE.names[1:],
        dest="nproc",
        metavar="N",
        help="processes per node (torchrun's --nproc-per-node, $PET_NPROC_PER_NODE; also auto, cpu, "
        "gpu, xpu); default 1",
    )
    parser.add_own(
        ours,
        "--url",
        help="store URL: file:///shared/dir or redis://host:port/db (default: the filesystem store in "
        "$RECIPECACHE_DIR or ~/.cache/recipecache); a password in it is visible to every user of "
        "the machine (ps), so pass such a URL in $RECIPECACHE_URL, never here",
    )
    parser.add_old_spelling(ours, "--cache", "--url")
    parser.add_own(
        ours,
        "--namespace",
        help="namespace in the store (default: the script's file name without .py, so reruns of a script share)",
    )
    parser.add_own(
        ours,
        "--secret-file",
        help="signing key file, keyed BLAKE3 (default: the key in $RECIPECACHE_SECRET, else this file)",
    )
    parser.add_own(
        ours, "--run-dir", help="where metrics, event logs and the report go (default ./recipecache-runs/<timestamp>)"
    )
    parser.add_own(ours, "--report", help="JSON report path (default <run-dir>/report.json)")
    parser.add_own(
        ours,
        "--no-enable",
        switch=True,
        help="do not enable recipecache in each rank; the script calls recipecache.enable() itself",
    )
    parser.add_own(
        ours,
        "--threads",
        help="OMP/torch threads per rank, the same on every rank since it enters torch's cache keys "
        "(default: $OMP_NUM_THREADS, else 1 when a node runs several processes, as torchrun)",
    )
    parser.add_own(
        ours,
        "--rank-dirs",
        help="give rank N its own TORCHINDUCTOR_CACHE_DIR and TMPDIR under DIR/rankN, as if every "
        "rank ran on its own node (tests, benchmarks); use a fresh DIR for empty local caches",
    )
    parser.add_own(
        ours,
        "--node-dir",
        help="node-local directory in front of the store, shared by this node's ranks: one rank per "
        "node fetches each artifact (default $TMPDIR/recipecache-node-<uid>; with --rank-dirs, "
        "one per rank under it, as if each rank were a node)",
    )
    parser.add_own(ours, "--no-node-tier", switch=True, help="no node directory: every rank reads the store")
    parser.add_own(
        ours,
        "--quiet",
        switch=True,
        help="print no progress lines (each rank's compile start and finish) while the job runs",
    )
    parser.add_own(
        ours,
        "--exit-grace",
        help="seconds the ranks of a node may take to exit once the script finished on all of them; "
        "a rank still running then is reported and ended (atexit handlers and non-daemon "
        f"threads must finish within it; default {env.DEFAULT_EXIT_GRACE_S:g})",
    )
    parser.add_own(
        ours,
        "--prewarm",
        switch=True,
        help="compile the shapes the script declares (recipecache.declare_shapes) before training, "
        "spread over the ranks",
    )
    parser.add_own(
        ours,
        "--precompile",
        switch=True,
        help="precompiled tier: ranks load whole compiled functions (bytecode, guards, AOTInductor "
        "libraries) from the store instead of tracing; one rank precompiles each, the others load",
    )
    parser.add_own(
        ours,
        "--no-stall",
        switch=True,
        help="no rank stops for a compile: a graph that missed runs without inductor (as aot_eager) "
        "while one rank compiles it in a worker process; every rank switches to the compiled "
        "graph at its next call once it is published. Compiles still running when the script "
        f"ends are finished within {NO_STALL_SHARE_OF_GRACE * 100:.0f}%% of --exit-grace",
    )
    hpu = parser.add_argument_group("Intel Gaudi recipes")
    parser.add_own(
        hpu,
        "--hpu",
        switch=True,
        help="point every rank's PT_HPU_RECIPE_CACHE_CONFIG at a node-local directory and sync it "
        "with the store through one agent per node",
    )
    parser.add_own(hpu, "--hpu-dir", help="the node-local recipe directory (default under $TMPDIR)")
    parser.add_own(hpu, "--hpu-max-size-mb", help=f"recipe directory cap in MB (default {DEFAULT_HPU_MAX_SIZE_MB})")
    parser.add_own(hpu, "--hpu-clear", switch=True, help="empty the node's recipe directory first")
    passed = parser.add_argument_group("torchrun options (passed through; those of the installed torchrun)")
    for opt in pass_through():
        if opt.takes_value:
            passed.add_argument(*opt.names, dest=opt.dest, metavar="VALUE")
        else:
            passed.add_argument(*opt.names, dest=opt.dest, action="store_true")
    for opt, reason in refused():
        passed.add_argument(
            *opt.names, nargs="?" if opt.takes_value else 0, action=_Refuse, reason=reason, help=argparse.SUPPRESS
        )
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="script args", help="arguments of the script")
    return parser


def run_torchrun(
    config: LaunchConfig, watch: ExitWatch, *, started: Callable[[], None] = lambda: None
) -> tuple[int, list[FinishedRank]]:
    """Run the job; forward SIGINT/SIGTERM/SIGHUP to torchrun; end ranks that outlive their script.

    Returns the job's exit status and the ranks the launcher had to end (see the module docstring).
    ``started`` runs once torchrun is started (threads may start then, not before).
    """
    cmd = [sys.executable, *config.torchrun_argv()]
    log.info("starting %s", " ".join(cmd))
    job_env = {
        **config.rank_env(os.environ),
        env.FINISHED_DIR: str(watch.directory),
        env.LAUNCHER_PID: str(os.getpid()),
    }
    # torchrun runs in its own session, so nothing else would stop it when the launcher is killed
    # outright (a scheduler, a test's timeout): SIGTERM then, which torchrun handles by stopping its
    # ranks, who also die with it (launcher.bootstrap.end_with_agent). The launcher runs no threads
    # yet, so a preexec_fn is safe here.
    dies_with_launcher = functools.partial(die_with_parent, signal.SIGTERM, os.getpid())
    proc = subprocess.Popen(cmd, env=job_env, start_new_session=True, preexec_fn=dies_with_launcher)  # noqa: PLW1509 - no threads yet
    started()

    def forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        while True:
            try:
                code = proc.wait(timeout=WATCH_INTERVAL_S)
            except subprocess.TimeoutExpired:
                hung = watch.overdue(proc.pid)
                if hung:
                    end_hung_ranks(proc, hung, watch.grace_s)
                    return job_status(watch.finished()), hung
            else:
                code = code if code >= 0 else 128 - code
                status = status_after_exit(code, watch.every_rank_finished())
                if status != code:
                    log.warning(
                        "every rank's script completed, but a rank then died while its process shut down "
                        "(torchrun exited %d); the job's status is the scripts': %d",
                        code,
                        status,
                    )
                return status, []
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def end_hung_ranks(proc: subprocess.Popen[bytes], hung: list[FinishedRank], grace_s: float) -> None:
    """Stop torchrun, whose ranks ``hung`` outlived their script; kill what does not stop.

    torchrun is asked first (SIGTERM, as on Ctrl-C): it stops its workers and, unlike
    after a worker that died, restarts none. A rank stuck in a destructor with the GIL
    held cannot run a Python signal handler, so it is killed if it is still there
    ``KILL_AFTER_S`` later, and so is torchrun after as long again.
    """
    ranks = ", ".join(str(rank.rank) for rank in hung)
    log.warning(
        "rank(s) %s still running %g s after the script finished on every rank of this node; ending them",
        ranks,
        grace_s,
    )
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_AFTER_S)
        return
    except subprocess.TimeoutExpired:
        pass
    for rank in hung:
        if running_child(rank.pid, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_hpu_agent(config: LaunchConfig) -> subprocess.Popen[bytes] | None:
    """The node's recipe sync agent, when ``--hpu`` is on; it logs its events apart from the ranks' trace."""
    if config.hpu_dir is None:
        return None
    from recipecache.hpu import start_agent

    environ = {**config.rank_env(os.environ), env.EVENT_LOG: str(config.run_dir / "hpu-events")}
    return start_agent(
        directory=config.hpu_dir,
        url=config.url,
        namespace=config.namespace,
        max_size_mb=config.hpu_max_size_mb,
        clear=config.hpu_clear,
        env=environ,
    )


def stop_hpu_agent(agent: subprocess.Popen[bytes]) -> None:
    """Stop the node's agent: it makes a last publishing pass, but never holds up the job's status and report."""
    agent.terminate()
    try:
        agent.wait(timeout=AGENT_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the HPU sync agent did not finish its last pass within %g s; killing it", AGENT_STOP_TIMEOUT_S)
        agent.kill()
        agent.wait()


#: torch's compile-on-one-rank switches (2.14 on: the first, read as torch reads a flag; 2.13: the second, any value)
COMPILE_ON_ONE_RANK_VARIABLES = ("TORCH_COMPILE_ON_ONE_RANK", "TORCH_DISTRIBUTED_COMPILE_ON_ONE_RANK")


def per_rank_graphs_note(environ: Mapping[str, str]) -> str | None:
    """What the launcher can tell before the job starts about graphs that will be compiled per rank, or None.

    torch's compile-on-one-rank makes a DTensor graph read its process groups from a device mesh
    it holds as a constant, which a graph loaded from any cache lacks: recipecache keys such graphs
    per rank (fallback ``rank_bound``). Set in code rather than in the environment, only the ranks
    know: each warns at enable() and at its first such graph, and the report sums them up.
    """
    on = [
        name
        for name in COMPILE_ON_ONE_RANK_VARIABLES
        if environ.get(name, "") == "1" or (name.startswith("TORCH_DISTRIBUTED_") and environ.get(name))
    ]
    if not on:
        return None
    return (
        f"{on[0]}={environ[on[0]]}: torch's compile_on_one_rank is on, so graphs that hold a device mesh "
        "(DTensor tensor/sequence parallel) are compiled by every rank, not once per job; unset it to share them"
    )


def launch(config: LaunchConfig) -> int:
    """Run the job and report on it; returns the job's exit status."""
    note = per_rank_graphs_note(os.environ)
    if note:
        print(f"{PROG}: warning: {note}", file=sys.stderr)
    config.run_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    since = start - MTIME_SLACK_S  # files older than this job are another run's
    watch = ExitWatch(Path(tempfile.mkdtemp(prefix=".finished-", dir=config.run_dir)), config.exit_grace_s)
    agent = start_hpu_agent(config)
    progress = Progress(config.events_dir, since=since, quiet=config.quiet)
    try:
        code, hung = run_torchrun(config, watch, started=progress.start)
    finally:
        progress.stop()
        if agent is not None:
            stop_hpu_agent(agent)
        shutil.rmtree(watch.directory, ignore_errors=True)
    wall = time.time() - start
    hpu_file = config.hpu_metrics_file(os.environ)
    report = build_report(
        load_metrics(config.run_dir, since=since),
        config.local_ranks,
        hpu=hpu_metrics.load(hpu_file, since=since) if hpu_file else None,
        graphs=load_graphs(config.events_dir, since=since),
        exit_code=code,
        wall_s=round(wall, 3),
        started=round(start, 3),
        script=str(config.script),
        cache=redact(config.url),
        namespace=config.namespace,
        enabled=config.enable,
        run_dir=str(config.run_dir),
        events=str(config.events_dir),
        exit_grace_s=config.exit_grace_s,
        hung_ranks=[rank.to_json() for rank in hung],
    )
    # the job's status stands when its report cannot be written (a full disk, a path swapped since the check);
    # the report is printed all the same
    try:
        write_report(report, config.report_path)
        written = str(config.report_path)
    except OSError as exc:
        written = f"not written: {config.report_path}: {exc.strerror}"
    except ConfigError as exc:
        written = f"not written: {exc}"
    print(
        f"{PROG}: job exited {code} after {wall:.1f} s; cache {report['cache']}, namespace {config.namespace}\n"
        f"{format_report(report)}\nreport: {written}",
        file=sys.stderr,
    )
    return code


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2); argparse has printed it
        return int(exc.code or 0)
    for line in getattr(args, "deprecations", []):
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    url_given_as = given_as(args, "url")
    warning = command_line_password_warning(args.url, url_given_as) if url_given_as.startswith("-") else None
    if warning:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    try:
        config = LaunchConfig.from_args(args)
        probe_store(config.url)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
