"""Per-process event log: one JSON object per line, the trace format of the simulator.

Enabled by ``RECIPECACHE_EVENT_LOG=<directory>``; each process appends to
``<directory>/events-rank<RANK>-<pid>.jsonl``. Every record has at least::

    {"time": <unix seconds, float>, "rank": <int>, "key": <str>, "event": <str>, "duration": <seconds, float>}

``event`` is one of :data:`EVENT_KINDS`. ``time`` is when the event *ended*, so an
event covers ``[time - duration, time]``. Extra fields (``reason``, ``bytes``,
``step``, ``shape``, ``behind``) may appear; readers must ignore fields they do not know.

Lines are written with one ``write`` call on a file opened in append mode, so lines of
different threads never interleave, and flushed at once so a killed process loses at
most the line it was writing.

Readers meet run directories that were copied, cut, edited or planted: :func:`read_events`
yields only well-formed records (every field it knows of its type and range) and counts
what it left out in a :class:`Skipped`, so explain, trace and the launcher's report say
how much they ignored instead of raising on it; and it opens regular files only, since a
FIFO named ``*.jsonl`` would block a reader forever.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .. import env
from ..env import process_rank
from ..fsutil import NotRegularFileError, open_regular_file

log = logging.getLogger(__name__)

#: hit: served from the store; miss: not in the store (``reason`` says why);
#: compile: the caller's compile ran here (``duration`` = compile seconds);
#: wait: waited for another process's compile (``duration`` = seconds waited);
#: put: published an artifact; fallback: compiled locally because the store could not
#: help (``reason``); takeover: took a lease whose holder had died;
#: compile_start: this process became the leader of ``key`` and compiles it now (the
#: ``compile`` that follows ends it; ``recipecache-run`` prints both as progress);
#: step: a training step ended (written by integrations; ``step`` = index);
#: eager (``--no-stall``): one call of graph ``key`` ran without inductor while its compile
#: runs behind the steps (``duration`` = the call); switch: this process switched ``key`` to
#: the compiled artifact (``duration`` = the load). That background compile's
#: ``compile_start`` and ``compile`` carry ``"behind": true``: no time of the rank's steps.
EVENT_KINDS = (
    "hit",
    "miss",
    "compile",
    "wait",
    "put",
    "fallback",
    "takeover",
    "compile_start",
    "step",
    "eager",
    "switch",
)


class EventLog:
    """Append-only JSON-lines writer; cheap no-op when ``path`` is None."""

    def __init__(self, path: str | os.PathLike[str] | None, *, rank: int | None = None) -> None:
        self.rank = process_rank() if rank is None else rank
        self._lock = threading.Lock()
        self._file = None
        self.path: Path | None = None
        if path is not None:
            self.path = Path(path)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - long-lived
            except OSError as exc:
                log.warning("recipecache: event log %s not writable (%s); events are not recorded", path, exc)
                self._file = None

    @classmethod
    def from_env(cls) -> EventLog:
        """The log named by ``RECIPECACHE_EVENT_LOG`` (a directory), or a disabled log."""
        directory = os.environ.get(env.EVENT_LOG)
        if not directory:
            return cls(None)
        rank = process_rank()
        return cls(Path(directory) / f"events-rank{rank}-{os.getpid()}.jsonl", rank=rank)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, event: str, key: str, duration: float = 0.0, **extra: Any) -> None:
        if self._file is None:
            return
        rec = {"time": time.time(), "rank": self.rank, "key": key, "event": event, "duration": round(duration, 6)}
        rec.update(extra)
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                self._file.write(line)
                self._file.flush()
            except (OSError, ValueError):  # disk full, or closed at interpreter exit
                pass

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


#: no time or duration in a log reaches this (Unix seconds in the year 33658): a larger one is damage
MAX_SECONDS = 1e12
#: ranks are below this (torchrun's are 32-bit); ``-1`` stands for a process without one
_RANK_RANGE = range(-1, 2**31)


@dataclass
class Skipped:
    """What readers of a run's logs left out: damaged records, and files they would not or could not read."""

    #: lines that are no record of the format: not UTF-8, not JSON (a torn last line), a field
    #: of the wrong type or out of range
    records: int = 0
    #: ``*.jsonl`` paths that are not regular files (a FIFO, a device, a directory) or could not be read
    files: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.records or self.files)

    def describe(self) -> str:
        """One line for people: how much was skipped (``""`` when nothing was)."""
        parts = []
        if self.records:
            parts.append(
                f"{self.records} damaged record(s) (not UTF-8, not JSON, or fields of the wrong type or range)"
            )
        if self.files:
            shown = ", ".join(self.files[:3]) + (f" and {len(self.files) - 3} more" if len(self.files) > 3 else "")
            parts.append(f"{len(self.files)} file(s) that are not regular files or not readable ({shown})")
        return f"skipped {' and '.join(parts)}" if parts else ""


def is_seconds(value: Any, low: float = 0.0) -> bool:
    """Whether ``value`` is a JSON number (not a bool) in ``[low, MAX_SECONDS)``; NaN and infinities are not."""
    return type(value) in (int, float) and low <= value < MAX_SECONDS


def _optional(rec: dict[str, Any], name: str, kind: type) -> bool:
    value = rec.get(name)
    return value is None or type(value) is kind


def well_formed(rec: Any) -> bool:
    """Whether ``rec`` is a record of this format: every field readers use of its type and in range.

    Extra fields are not checked (readers ignore what they do not know).
    """
    return (
        isinstance(rec, dict)
        and type(rec.get("event")) is str
        and is_seconds(rec.get("time"))
        and type(rec.get("rank")) is int
        and rec["rank"] in _RANK_RANGE
        and ("duration" not in rec or is_seconds(rec["duration"]))
        and _optional(rec, "key", str)
        and _optional(rec, "reason", str)
        and _optional(rec, "bytes", int)
        and _optional(rec, "step", int)
        and _optional(rec, "behind", bool)
    )


def parse_record(line: bytes) -> dict[str, Any] | None:
    """The well-formed record on one log line, or None (not UTF-8, not JSON, too deep, :func:`well_formed` not)."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return rec if well_formed(rec) else None


def open_regular(path: Path) -> BinaryIO | None:
    """``path`` opened for reading if it is a regular file (links followed), else None; never blocks.

    A FIFO or device is never read (:func:`~recipecache.fsutil.open_regular_file`). Raises
    OSError when a regular file cannot be opened, FileNotFoundError when there is none.
    """
    try:
        fd = open_regular_file(path, follow_links=True)
    except NotRegularFileError:
        return None
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
    return os.fdopen(fd, "rb")


def read_events(path: str | os.PathLike[str], *, skipped: Skipped | None = None) -> Iterator[dict[str, Any]]:
    """Yield the well-formed records of one event-log file or of every ``*.jsonl`` in a directory.

    Records come file by file in file order. Lines that are not well-formed records (a
    torn last line, damage) and files that are not regular files are skipped, and counted
    in ``skipped`` when given.
    """
    skipped = Skipped() if skipped is None else skipped
    p = Path(path)
    for f in sorted(p.glob("*.jsonl")) if p.is_dir() else [p]:
        try:
            fh = open_regular(f)
        except OSError:
            fh = None
        if fh is None:
            skipped.files.append(str(f))
            continue
        with fh:
            for line in fh:
                rec = parse_record(line)
                if rec is not None:
                    yield rec
                else:
                    skipped.records += 1
