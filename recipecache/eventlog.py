"""Per-process event log (the writer): one JSON object per line, the trace format of the simulator.

Enabled by ``RECIPECACHE_EVENT_LOG=<directory>``; each process appends to
``<directory>/events-rank<RANK>-<pid>.jsonl``. Every record has at least::

    {"time": <unix seconds, float>, "rank": <int>, "key": <str>, "event": <str>, "duration": <seconds, float>}

``event`` is one of :data:`EVENT_KINDS`. ``time`` is when the event *ended*, so an
event covers ``[time - duration, time]``. Extra fields (``reason``, ``bytes``,
``step``, ``shape``, ``behind``) may appear; readers must ignore fields they do not know.

Lines are written with one ``write`` call on a file opened in append mode, so lines of
different threads never interleave, and flushed at once so a killed process loses at
most the line it was writing. :mod:`recipecache.runs.events` reads the logs back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from . import env
from .env import process_rank

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
