"""Reading the per-process event logs that :class:`recipecache.eventlog.EventLog` writes (the format is there).

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..fsutil import NotRegularFileError, open_regular_file

log = logging.getLogger(__name__)

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
