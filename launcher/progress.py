"""Progress while the job runs: one line per compile start and finish, per rank, as they happen.

The ranks already write every cache event to their event logs (``<run dir>/events``,
:mod:`recipecache.runs.events`), flushed line by line; :class:`Progress` follows those files
from a thread of the launcher, the way ``tail -f`` would, and prints

* ``compile_start`` (the rank took the lease and compiles) and ``compile`` (it finished,
  with its seconds), named by graph (function and input shapes, from the key records);
* ``fallback``: a rank compiles without the store, and why.

Lines are printed to stderr, beside torchrun's output; ``recipecache-run --quiet`` turns
them off. Records older than the job (a reused run directory) are skipped.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from recipecache.runs.events import open_regular, parse_record
from recipecache.runs.keyinfo import KEYS_DIR, short_key

PREFIX = "recipecache-run"
#: seconds between two looks at the event logs
POLL_S = 0.5
#: a graph's label is cut to this many characters in a progress line
LABEL_CHARS = 72


class _Tail:
    """The complete lines appended to one file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def lines(self) -> list[bytes]:
        try:
            f = open_regular(self.path)  # a FIFO would block this thread, and the launcher joining it
            if f is None:
                return []
            with f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        return data[:end].splitlines()


class Progress:
    """Follows a job's event logs and prints each rank's compiles as they start and finish."""

    def __init__(
        self, events_dir: Path, *, since: float, quiet: bool = False, out: TextIO | None = None, poll_s: float = POLL_S
    ) -> None:
        self.events_dir = events_dir
        self.quiet = quiet
        self.since = since
        self.out = out if out is not None else sys.stderr
        self.poll_s = poll_s
        self._tails: dict[Path, _Tail] = {}
        self._labels: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recipecache-progress", daemon=True)

    def start(self) -> None:
        """Start following (a thread), unless quiet. Call it after starting torchrun: forking with
        threads running is unsafe when the child runs Python before exec (the launcher's preexec_fn)."""
        if not self.quiet:
            self._thread.start()

    def stop(self) -> None:
        """Print what is left and stop following."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()
        self.poll()

    def _records(self, directory: Path, pattern: str) -> list[dict[str, Any]]:
        out = []
        for path in sorted(directory.glob(pattern)):
            tail = self._tails.setdefault(path, _Tail(path))
            for line in tail.lines():
                rec = parse_record(line)  # damaged lines are skipped here; the report counts them
                if rec is not None and rec["time"] >= self.since:
                    out.append(rec)
        return out

    def poll(self) -> None:
        """Read what the ranks appended since the last poll and print the lines it makes."""
        for rec in self._records(self.events_dir / KEYS_DIR, "keys-rank*.jsonl"):
            if rec["event"] == "key" and isinstance(rec.get("key"), str) and isinstance(rec.get("label"), str):
                self._labels[rec["key"]] = rec["label"]
        for rec in sorted(self._records(self.events_dir, "events-rank*.jsonl"), key=lambda r: r["time"]):
            line = self.describe(rec)
            if line is not None:
                print(f"{PREFIX}: {line}", file=self.out, flush=True)

    def describe(self, rec: dict[str, Any]) -> str | None:
        """The progress line of one event record, or None for events that make none."""
        key = rec.get("key") or ""
        label = self._labels.get(key) or "graph"
        graph = (label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 3] + "...") + (
            f" ({short_key(key)})" if key else ""
        )
        rank = rec.get("rank", "?")
        if rec.get("event") == "compile_start":
            return f"rank {rank} compiling {graph}"
        if rec.get("event") == "compile":
            return f"rank {rank} compiled {graph} in {float(rec.get('duration') or 0.0):.1f} s"
        if rec.get("event") == "fallback":
            return f"rank {rank} compiling {graph} without the store ({rec.get('reason', 'unknown')})"
        return None
