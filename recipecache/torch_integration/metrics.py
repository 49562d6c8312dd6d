"""Per-process metrics of the torch integration, in the format of :mod:`recipecache.metrics_schema`.

The launcher's report sums these files over ranks, so every number is about *this*
process: graphs it compiled (inductor codegen that actually ran here), seconds it
waited for another process's compile, and, for each hit, the seconds the producer spent
compiling (``saved_s``). Failures of the cache are counted by reason and warned about
once per reason: the integration never raises into training, so these counters are
how an operator learns that the cache is not helping.

The file (``RECIPECACHE_METRICS_FILE`` or ``enable(metrics_file=...)``, ``{rank}``
replaced by the rank) is written when the script's body returns (``recipecache-run``'s
bootstrap: before the ``atexit`` handlers, one of which may hang, so a rank ended for
hanging still reports), again at exit if a figure changed since, and, with
``RECIPECACHE_METRICS_FLUSH=1``, after every change, so a killed rank still leaves its
latest numbers.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import metrics_schema as schema
from ..env import process_rank, process_world_size
from ..fsutil import write_atomic
from ..reasons import REFUSED, PrecompileDetail, PrecompileShapes, Reason
from ..store import Store

log = logging.getLogger(__name__)

#: fallbacks of the precompiled tier listed with their cause per process (the counts go on past it)
MAX_FALLBACK_DETAILS = 32
#: characters kept of a fallback's message and of its exception's message
MAX_DETAIL_CHARS = 500


def fallback_record(detail: PrecompileDetail | Reason, message: str, error: BaseException | None) -> dict[str, str]:
    """One line of ``precompile_fallback_details``: the detail, the tier's message and the exception behind it."""
    cause = {schema.PRECOMPILE_FALLBACK_ERROR: _bounded(describe_error(error))} if error is not None else {}
    return schema.record(
        {schema.PRECOMPILE_FALLBACK_DETAIL: str(detail), schema.PRECOMPILE_FALLBACK_MESSAGE: _bounded(message), **cause}
    )


def describe_error(error: BaseException) -> str:
    """``module.Type: message`` (builtins without their module)."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}: {error}"


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


def _rounded(figure: float) -> float:
    """A no-stall figure as the file gives it: seconds to the microsecond, counts as they are."""
    return round(figure, 6) if isinstance(figure, float) else figure


def metrics_path(template: str | None, rank: int) -> Path | None:
    """The metrics file for ``rank``: ``template`` with ``{rank}`` replaced, or None for no file."""
    return Path(template.replace("{rank}", str(rank))) if template else None


class Metrics:
    """What only the integration knows, plus a view of the store's own counters.

    Compiles, waits, refusals, single-flight fallbacks and every lookup and put by artifact
    kind (``cache``, ``lookups``: the integration passes ``kind=`` to the store, and a hit
    it cannot use is :meth:`Store.record_unused_hit`) are counted once, by the store
    (:meth:`Store.stats`); this class adds the torch side: the seconds hits saved, kernels
    shipped and installed, the precompiled tier's details, and the integration's own
    fallbacks (a hook that failed, a malformed artifact, a failed non-graph lookup).
    """

    def __init__(self, store: Store, path: Path | None, *, flush: bool) -> None:
        self.store = store
        self.path = path
        self._flush = flush and path is not None
        self._lock = threading.Lock()
        self._started = time.monotonic()
        #: when enable() began and ended (Unix seconds; :meth:`enabled`), so a job's timeline shows what enabling cost
        self._enable_span: tuple[float, float] | None = None
        self._saved_s = 0.0
        self._fallbacks: Counter[str] = Counter()
        #: fallback reasons warned about (once each), counted here or by the store
        self._warned: set[str] = set()
        #: reason -> what its first fallback here said (the warning's text): the report says why, not only how often
        self._fallback_details: dict[str, str] = {}
        self._kernels = dict.fromkeys((schema.KERNELS_INSTALLED, schema.KERNELS_SHIPPED), 0)
        #: the job's ranks when enable() ran: a framework may drop its variables before the last write at exit
        #: (Lightning's teardown deletes ``WORLD_SIZE``)
        self._world_size = process_world_size()
        #: what this rank's keys depend on that its launcher chose (:meth:`settings`)
        self._settings: dict[str, str | int | bool | None] = {}
        self._precompile_fallbacks: Counter[str] = Counter()
        #: why each of the tier's first fallbacks happened (:meth:`precompile_fallback`), bounded
        self._precompile_fallback_details: list[dict[str, str]] = []
        self._precompile_shapes: Counter[str] = Counter()
        self._stale_sources = 0
        #: no-stall's counters (:mod:`.no_stall.controller`; :data:`~recipecache.metrics_schema.NO_STALL_COUNTS`)
        self._no_stall: dict[str, float] = dict.fromkeys((field.key for field in schema.NO_STALL_COUNTS), 0)
        #: per graph key, what no-stall did with it here (:meth:`follow_no_stall`; the report's rows)
        self._no_stall_graphs: Callable[[], dict[str, Any]] | None = None
        self._write_failed = False
        #: the figures last written (all but ``wall_s``), to skip a rewrite that would change nothing
        self._written: dict[str, Any] | None = None
        #: torch's own local-cache hits (``{"fx": n, "aot": m}``; :meth:`follow_local_hits`): a graph
        #: torch found in its local cache never reaches the store, so the store's counters
        #: alone would make a warm rerun look as if the cache did nothing
        self._local_hits: Callable[[], dict[str, int]] | None = None

    # -- updates (each one flushes when asked to) -----------------------------------
    def changed(self) -> None:
        """Something this file reports changed (here or in the store): rewrite it when flushing."""
        if self._flush:
            self.write()

    def saved(self, seconds: float) -> None:
        """A hit was used (the store counted it): the producer's ``seconds`` of compile were saved.

        Negative ``seconds`` take back what a hit added when torch did not use it after all
        (the store counts that miss: :meth:`Store.record_unused_hit`).
        """
        with self._lock:
            self._saved_s += seconds
        self.changed()

    def fallback(self, reason: Reason, detail: str, *, counted_by_store: bool = False) -> None:
        """The cache could not help with one lookup or publish; warned once per reason.

        ``counted_by_store``: the store counted it already (the reason of a fallback
        :class:`~recipecache.store.Flight`), so it is only warned about here.
        """
        with self._lock:
            first = reason not in self._warned
            self._warned.add(reason)
            if first:
                self._fallback_details[str(reason)] = _bounded(detail)
            if not counted_by_store:
                self._fallbacks[reason] += 1
        if first:
            log.warning("recipecache: %s: %s (counted as fallback %r; not warned again)", reason, detail, str(reason))
        self.changed()

    def precompile_fallback(
        self,
        detail: PrecompileDetail | Reason,
        message: str,
        *,
        counted_by_store: bool = False,
        error: BaseException | None = None,
    ) -> None:
        """The precompiled tier sent one call signature to the normal path; warned once per ``detail``.

        Counted in ``precompile_fallbacks`` by detail and as fallback ``precompile_fallback``,
        unless ``counted_by_store``: a store that could not coordinate (the reason of a
        fallback :class:`~recipecache.store.Flight`, e.g. ``backend_down``) is the store's
        fallback, counted once, by the store; only its detail is counted here. Each one is
        also listed in ``precompile_fallback_details`` with ``message`` and, where an exception
        caused it (a load that failed), its type and message (:func:`fallback_record`): the
        warning says only the first of each detail, and a count says nothing about the cause.
        """
        with self._lock:
            first = detail not in self._precompile_fallbacks
            self._precompile_fallbacks[detail] += 1
            if len(self._precompile_fallback_details) < MAX_FALLBACK_DETAILS:
                self._precompile_fallback_details.append(fallback_record(detail, message, error))
            if not counted_by_store:
                self._fallbacks[Reason.PRECOMPILE_FALLBACK] += 1
        if first:
            cause = f" ({describe_error(error)})" if error is not None else ""
            log.warning(
                "recipecache: %s%s (counted as fallback %r, detail %r; not warned again)",
                message,
                cause,
                str(Reason.PRECOMPILE_FALLBACK),
                str(detail),
            )
        self.changed()

    def precompile_shapes(self, how: PrecompileShapes) -> None:
        """The precompiled tier serves one call signature with an artifact built ``how`` (the counterpart of
        :meth:`precompile_fallback`: together they say, per signature, what the tier decided and why)."""
        with self._lock:
            self._precompile_shapes[how] += 1
        self.changed()

    def stale_sources(self) -> None:
        """A precompiled artifact was found for other code than this process runs (so not loaded)."""
        with self._lock:
            self._stale_sources += 1
        self.changed()

    def no_stall(self, **counts: float) -> None:
        """No-stall figures to add, by their names in the file (:data:`~recipecache.metrics_schema.NO_STALL_COUNTS`:
        ``eager_calls``, ``switches``, ``compiles``, ``failed``, ...).

        An eager call changes only counters the report sums at the end, so it rewrites no file.
        """
        with self._lock:
            for name, n in counts.items():
                self._no_stall[name] += n
        if set(counts) - {schema.NO_STALL_EAGER_CALLS.key, schema.NO_STALL_EAGER_S.key}:
            self.changed()

    def kernels(self, *, installed: int = 0, shipped: int = 0) -> None:
        with self._lock:
            self._kernels[schema.KERNELS_INSTALLED] += installed
            self._kernels[schema.KERNELS_SHIPPED] += shipped
        self.changed()

    # -- output ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """This process's figures, as its metrics file gives them (:func:`~recipecache.metrics_schema.document`)."""
        store = self.store.stats()
        compiles, compile_s, wait_s = store["compiles"], store["compile_s"], store["wait_s"]
        misses_by_reason = store["misses_by_reason"]
        # the store's fallbacks (it could not coordinate) and the integration's own: each event is in one of them
        fallbacks = Counter({str(k): v for k, v in store["fallback_by_reason"].items()})
        lookups = {kind: store["by_kind"].get(kind, dict.fromkeys(schema.OUTCOMES, 0)) for kind in schema.LOOKUP_KINDS}
        # graph lookups, and whole functions the precompiled tier looked up
        hits, misses = (
            sum(lookups[kind][field.key] for kind in schema.GRAPH_KINDS)
            for field in (schema.LOOKUP_HIT, schema.LOOKUP_MISS)
        )
        local = self._local_hits() if self._local_hits is not None else {}
        no_stall_graphs = self._no_stall_graphs() if self._no_stall_graphs is not None else {}
        with self._lock:
            fallbacks.update({str(k): v for k, v in self._fallbacks.items()})
            return schema.document(
                {
                    schema.RANK: process_rank(),
                    schema.HOST: socket.gethostname(),
                    schema.PID: os.getpid(),
                    schema.WORLD_SIZE: self._world_size,
                    schema.SETTINGS: dict(self._settings),
                    schema.WALL_S: round(time.monotonic() - self._started, 6),
                    schema.ENABLE: self._enable_record(),
                    schema.COMPILES: compiles,
                    schema.COMPILE_S: round(compile_s, 6),
                    schema.AVERAGE_COMPILE_S: round(compile_s / compiles, 6) if compiles else 0.0,
                    schema.HITS: hits,
                    schema.MISSES: misses,
                    schema.LOCAL_HITS: local,
                    schema.WAITS: store["waits"],
                    schema.WAIT_S: round(wait_s, 6),
                    schema.STALL_S: round(compile_s + wait_s, 6),
                    schema.SAVED_S: round(self._saved_s, 6),
                    schema.REFUSED: sum(n for reason, n in misses_by_reason.items() if reason in REFUSED),
                    schema.FALLBACKS: dict(fallbacks),
                    schema.FALLBACK_DETAILS: dict(self._fallback_details),
                    schema.LOOKUPS: lookups,
                    **self._kernels,
                    schema.PRECOMPILE_FALLBACKS: {str(k): v for k, v in self._precompile_fallbacks.items()},
                    schema.PRECOMPILE_FALLBACK_DETAILS: [dict(d) for d in self._precompile_fallback_details],
                    schema.PRECOMPILE_SHAPES: {str(k): v for k, v in self._precompile_shapes.items()},
                    schema.STALE_SOURCES: self._stale_sources,
                    **{field: _rounded(self._no_stall[field.key]) for field in schema.NO_STALL_COUNTS},
                    schema.NO_STALL_GRAPHS: no_stall_graphs,
                    schema.STORE: store,
                }
            )

    def settings(self, **chosen: str | int | bool | None) -> None:
        """What this rank runs with that the ranks of a job must agree on (thread count, namespace, ...), whichever
        launcher chose it: the report compares the ranks' and says what differs."""
        with self._lock:
            self._settings.update(chosen)
        self.changed()

    def enabled(self, start: float, end: float) -> None:
        """enable() ran from ``start`` to ``end`` (Unix seconds): the job's report shows what it cost."""
        self._enable_span = (start, end)

    def follow_local_hits(self, hits: Callable[[], dict[str, int]]) -> None:
        """Report torch's own local-cache hits, as ``hits()`` counts them at each snapshot (the hooks hand in
        :func:`.describe.local_hits` once torch is hooked: this module imports no torch)."""
        self._local_hits = hits

    def follow_no_stall(self, graphs: Callable[[], dict[str, Any]]) -> None:
        """Report no-stall's graphs, as ``graphs()`` gives them at each snapshot (:class:`.no_stall.controller.NoStall`)."""
        self._no_stall_graphs = graphs

    def _enable_record(self) -> dict[str, float] | None:
        """``{"start": Unix time, "s": seconds}`` of enable(), or None before it ended."""
        if self._enable_span is None:
            return None
        start, end = self._enable_span
        return schema.record({schema.ENABLE_START: round(start, 6), schema.ENABLE_S: round(end - start, 6)})

    def write(self, *, if_changed: bool = False) -> None:
        """Write the snapshot atomically to :attr:`path`; a failure is logged once and never raised.

        ``if_changed``: only if a figure (other than ``wall_s``) changed since the last write.

        Never raised, whatever fails: ``recipecache-run``'s bootstrap writes the file as the script returns, where an
        exception would turn a rank that trained to its end into a failed one (status 1).
        """
        if self.path is None:
            return
        try:
            snapshot = self.snapshot()
            figures = {name: value for name, value in snapshot.items() if name != schema.WALL_S.key}
            if if_changed and figures == self._written:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(snapshot, indent=1).encode())
            self._written = figures
        except OSError as exc:
            self._write_failure(f"{exc}")
        except Exception as exc:  # noqa: BLE001 - a figure that would not serialize: a defect, shown with its stack
            self._write_failure(f"{type(exc).__name__}: {exc}", stack=True)

    def _write_failure(self, why: str, *, stack: bool = False) -> None:
        if not self._write_failed:
            self._write_failed = True
            log.warning("recipecache: cannot write metrics to %s: %s", self.path, why, exc_info=stack)
