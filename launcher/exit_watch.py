"""Ranks that outlive their script: the bootstrap marks each finished script, the launcher ends laggards.

A rank whose script has returned can still hang while its interpreter shuts down: an
``atexit`` handler that never returns, a non-daemon thread, a C++ destructor that joins a
thread waiting for the GIL. torchrun would wait for such a rank forever, and so would
the job. So the bootstrap writes a small marker when the script's code has finished,
holding the status the process is about to exit with, and the launcher, once every
local rank of the current torchrun round has a marker, gives the processes
``grace_s`` seconds to exit and then ends the ones still running.

Markers are JSON files ``round<R>-local<L>.json`` in a directory the launcher makes for
one job (``RECIPECACHE_FINISHED_DIR``); R is torchrun's restart count, so a restarted
worker group is judged on its own markers only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from recipecache import env
from recipecache.fsutil import write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedRank:
    """One rank whose script finished: who it is, which process, and how the script ended."""

    rank: int
    local_rank: int
    local_world_size: int
    #: torchrun's restart count when the rank ran (``TORCHELASTIC_RESTART_COUNT``)
    restart: int
    pid: int
    #: the exit status the script gave the process: 0 when it completed
    status: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)


_FIELDS = tuple(f.name for f in fields(FinishedRank))


def exit_status(exc: SystemExit) -> int:
    """The status Python exits with for an uncaught ``exc``: 0 for None, the number (mod 256), else 1."""
    if exc.code is None:
        return 0
    return exc.code & 0xFF if isinstance(exc.code, int) else 1


def mark_finished(status: int, environ: Mapping[str, str] | None = None) -> None:
    """Bootstrap side: record that this rank's script finished with ``status``.

    A no-op outside ``recipecache-run`` (no ``RECIPECACHE_FINISHED_DIR``). A marker that
    cannot be written costs only the hang detection, never the rank.
    """
    environ = os.environ if environ is None else environ
    directory = environ.get(env.FINISHED_DIR)
    if not directory:
        return
    try:
        finished = FinishedRank(
            rank=int(environ.get("RANK", "0")),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1")),
            restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            pid=os.getpid(),
            status=status,
        )
        path = Path(directory) / f"round{finished.restart}-local{finished.local_rank}.json"
        write_atomic(path, json.dumps(finished.to_json()).encode())
    except (OSError, ValueError) as exc:
        log.warning("recipecache: could not mark this rank's script finished in %s: %s", directory, exc)


def read_finished(directory: Path) -> list[FinishedRank]:
    """The markers of the latest torchrun round in ``directory``, by local rank; unreadable ones are skipped."""
    rounds: dict[int, dict[int, FinishedRank]] = {}
    for path in directory.glob("round*-local*.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            finished = FinishedRank(**{name: int(data[name]) for name in _FIELDS})
        except (OSError, ValueError, KeyError, TypeError):
            continue
        rounds.setdefault(finished.restart, {})[finished.local_rank] = finished
    if not rounds:
        return []
    latest = rounds[max(rounds)]
    return [latest[local] for local in sorted(latest)]


def running_child(pid: int, parent: int) -> bool:
    """Whether ``pid`` is a live (not zombie) child of ``parent``.

    Checking the parent keeps a recycled pid from being taken for a rank. Reads
    ``/proc``: where there is none (not Linux), nothing is ever found running, so hung
    ranks are not detected there.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    state, ppid = stat.rpartition(")")[2].split()[:2]
    return state != "Z" and int(ppid) == parent


def job_status(finished: Sequence[FinishedRank]) -> int:
    """The job's status when the launcher had to end ranks that outlived their script.

    What torchrun would have returned had every rank exited with its script's status: 0
    when every script completed, 1 (torchrun's status for a failed worker) otherwise.
    The signal that ended a hung rank is the launcher's doing, not the job's result; the
    report lists the ranks it ended.
    """
    return 0 if all(rank.status == 0 for rank in finished) else 1


def status_after_exit(code: int, finished: Sequence[FinishedRank]) -> int:
    """The job's status when torchrun ended with ``code``, given the markers of every local rank (or []).

    A rank can die after its script completed, while its interpreter shuts down: torch
    2.14.1 with gloo sometimes aborts there (a gloo thread destroying a finished allreduce
    whose thread-local state holds a Python object, during ``Py_FinalizeEx``;
    docs/torch-integration-notes.md). torchrun then reports the job failed although every
    script did its work. As for a rank the launcher ended for hanging at exit
    (:func:`job_status`), the status is the scripts' when every local rank's script
    finished; otherwise torchrun's.
    """
    if code == 0 or not finished:
        return code
    return job_status(finished)


class ExitWatch:
    """Launcher side: notices ranks still running ``grace_s`` after every local rank's script finished."""

    def __init__(self, directory: Path, grace_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.grace_s = grace_s
        self._clock = clock
        #: (round, when this watch first saw every local rank of that round finished)
        self._all_finished: tuple[int, float] | None = None

    def finished(self) -> list[FinishedRank]:
        return read_finished(self.directory)

    def every_rank_finished(self) -> list[FinishedRank]:
        """The markers of the latest round if every local rank of it has one, else []."""
        finished = self.finished()
        return finished if finished and len(finished) >= finished[0].local_world_size else []

    def overdue(self, torchrun_pid: int) -> list[FinishedRank]:
        """The ranks to end now: [] until every local rank finished and ``grace_s`` has passed since."""
        finished = self.every_rank_finished()
        if not finished:
            self._all_finished = None
            return []
        round_ = finished[0].restart
        if self._all_finished is None or self._all_finished[0] != round_:
            self._all_finished = (round_, self._clock())
        if self._clock() - self._all_finished[1] < self.grace_s:
            return []
        return [rank for rank in finished if running_child(rank.pid, torchrun_pid)]
