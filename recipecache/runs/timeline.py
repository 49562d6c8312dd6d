"""A job's timeline, one track per rank: as a Chrome/Perfetto trace, or as a picture.

The trace is the JSON "Trace Event Format" that torch's profiler exports
(``torch.profiler`` ``export_chrome_trace``) and that ui.perfetto.dev and
chrome://tracing open: ``{"traceEvents": [...]}`` with complete events (``"ph": "X"``,
``ts``/``dur`` in microseconds) and instants (``"ph": "i"``). Each rank is a process
(``pid`` = rank) named ``rank N (host)``; its compiles, waits, fetches and publishes are
duration events, its hits, misses, fallbacks and steps instants, each named by the graph
(function and input shapes, from the key records) rather than by a hash. No-stall adds two
threads to a rank: its compiles behind the steps (``"behind": true``: a worker process, not the
rank's own time) and, per graph, the span in which the rank ran it without inductor (from its
first eager call to its last, with the number of calls); the switch to the compiled graph is a
span of the rank itself.

:func:`draw` renders the same timeline with matplotlib (the optional ``plot`` extra) for
a README or a ticket; no-stall's two threads are thin lanes under and over the rank's row.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..fsutil import write_output_file
from .events import Skipped
from .explain import load_events, with_follower_hits
from .keyinfo import KeyInfo, graph_label, load_keys

#: event kind -> the verb of its duration event (hits are fetches: the store read and verify)
SPANS = {"compile": "compile", "wait": "wait for", "hit": "fetch", "put": "publish", "switch": "switch to compiled"}
#: no-stall's threads of a rank besides its own (tid 0): compiles in a worker, graphs run without inductor
BEHIND_TID, EAGER_TID = 1, 2
#: event kinds drawn as instants
INSTANTS = ("hit", "miss", "fallback", "takeover", "step")
#: colours of the picture, one per span kind of the rank itself, and of no-stall's lanes
COLOURS = {"compile": "#d62728", "wait": "#ff7f0e", "hit": "#1f77b4", "put": "#2ca02c"}
BEHIND_COLOUR, EAGER_COLOUR = "#9467bd", "#7f7f7f"


@dataclass(frozen=True)
class EagerSpan:
    """No-stall: the calls of one graph a rank ran without inductor, from the first call's start to the last's end."""

    rank: int
    key: str
    start: float
    end: float
    calls: int
    seconds: float


def eager_spans(records: Sequence[Mapping[str, Any]]) -> list[EagerSpan]:
    """The ``eager`` records as one span per rank and graph, in rank and key order."""
    calls: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for rec in records:
        if rec["event"] == "eager":
            calls.setdefault((rec["rank"], rec.get("key") or ""), []).append(rec)
    return [
        EagerSpan(
            rank,
            key,
            min(_start(r) for r in rs),
            max(float(r["time"]) for r in rs),
            len(rs),
            sum(float(r.get("duration") or 0.0) for r in rs),
        )
        for (rank, key), rs in sorted(calls.items())
    ]


def _is_behind(rec: Mapping[str, Any]) -> bool:
    """A compile in a no-stall worker: none of the rank's own time."""
    return rec["event"] == "compile" and rec.get("behind") is True


def _label(key: str, keys: Mapping[str, Sequence[KeyInfo]]) -> str:
    return graph_label(key, keys) if key else ""


def _bar_text(rec: Mapping[str, Any], keys: Mapping[str, Sequence[KeyInfo]], fits: int) -> str:
    """A bar's text: the function (after "waiting for" on a wait), then its input shapes, cut to ``fits`` characters."""
    infos = keys.get(rec.get("key") or "")
    lines = [infos[0].name, infos[0].shapes] if infos else [_label(rec.get("key") or "", keys)]
    if rec["event"] == "wait":
        lines[0] = f"waiting for {lines[0]}"
    return "\n".join(line if len(line) <= fits else line[: fits - 1] + "…" for line in lines if line)


def _start(rec: Mapping[str, Any]) -> float:
    return float(rec["time"]) - float(rec.get("duration") or 0.0)


def build_trace(records: Sequence[dict[str, Any]], keys: Mapping[str, Sequence[KeyInfo]]) -> dict[str, Any]:
    """The Chrome trace of a run's event records (time-ordered or not)."""
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(_start(r) for r in records)
    hosts = {info.rank: info.context.get("host") for infos in keys.values() for info in infos}
    events: list[dict[str, Any]] = []
    for rank in sorted({r["rank"] for r in records}):
        host = hosts.get(rank)
        events += [
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}" + (f" ({host})" if host else "")},
            },
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "recipecache"}},
        ]
    for rec in records:
        kind, key = rec["event"], rec.get("key") or ""
        if kind == "eager":
            continue
        label = _label(key, keys)
        args = {k: rec[k] for k in ("key", "reason", "bytes", "step") if rec.get(k) not in (None, "")}
        behind = _is_behind(rec)
        base = {"pid": rec["rank"], "tid": BEHIND_TID if behind else 0, "cat": kind, "args": args}
        duration = float(rec.get("duration") or 0.0)
        if kind in SPANS and duration > 0:
            events.append(
                {
                    **base,
                    "ph": "X",
                    "name": f"{'compile behind' if behind else SPANS[kind]} {label}",
                    "ts": round((_start(rec) - origin) * 1e6, 3),
                    "dur": round(duration * 1e6, 3),
                }
            )
        if kind in INSTANTS:
            name = f"step {rec.get('step', '')}" if kind == "step" else f"{kind} {label}"
            if rec.get("reason"):
                name += f" ({rec['reason']})"
            events.append(
                {**base, "ph": "i", "s": "t", "name": name, "ts": round((float(rec["time"]) - origin) * 1e6, 3)}
            )
    for span in eager_spans(records):
        events.append(
            {
                "pid": span.rank,
                "tid": EAGER_TID,
                "cat": "eager",
                "ph": "X",
                "name": f"without inductor {_label(span.key, keys)} ({span.calls} calls)",
                "ts": round((span.start - origin) * 1e6, 3),
                "dur": round((span.end - span.start) * 1e6, 3),
                "args": {"key": span.key, "calls": span.calls, "seconds": round(span.seconds, 6)},
            }
        )
    threads = {(e["pid"], e["tid"]) for e in events if e.get("tid")}
    names = {BEHIND_TID: "compiles behind the steps (worker)", EAGER_TID: "graphs run without inductor"}
    events += [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": names[tid]}}
        for pid, tid in sorted(threads)
    ]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}


def load_run(
    run_dir: str | os.PathLike[str], *, skipped: Skipped | None = None
) -> tuple[list[dict[str, Any]], dict[str, list[KeyInfo]]]:
    """A run directory's events (with followers' loads as hits) and key records; ConfigError if it holds no events.

    Damaged records and files that are not regular files are left out, counted in ``skipped``.
    """
    skipped = Skipped() if skipped is None else skipped
    records = load_events(run_dir, skipped=skipped)
    if not records:
        raise ConfigError(f"{run_dir} holds no events to draw" + (f" ({skipped.describe()})" if skipped else ""))
    return with_follower_hits(records), load_keys(run_dir, skipped=skipped)


def write_trace(
    run_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, skipped: Skipped | None = None
) -> dict[str, Any]:
    """Write the trace of ``run_dir`` to ``out`` (atomically); returns it. ``skipped`` as in :func:`load_run`."""
    trace = build_trace(*load_run(run_dir, skipped=skipped))
    write_output_file(Path(out), "trace file", json.dumps(trace).encode())
    return trace


def draw(run_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Draw the timeline of ``run_dir`` as a PNG: a row per rank, bars for compiles, waits, publishes.

    With no-stall, a lane under each rank's row holds the compiles of its worker and a lane
    over it the spans in which it ran graphs without inductor.

    ConfigError when matplotlib is missing (``pip install 'recipecache[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install 'recipecache[plot]'") from None
    records, keys = load_run(run_dir)
    origin = min(_start(r) for r in records)
    end = max(float(r["time"]) for r in records) - origin
    ranks = sorted({r["rank"] for r in records})
    row = {rank: len(ranks) - 1 - i for i, rank in enumerate(ranks)}  # rank 0 on top
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.9 * len(ranks)))
    behind = [r for r in records if _is_behind(r) and float(r.get("duration") or 0.0) > 0]
    eager = eager_spans(records)
    for rank in ranks:
        lanes = [
            (
                COLOURS[kind],
                (row[rank] - 0.3, 0.6),
                [r for r in records if r["rank"] == rank and r["event"] == kind and not _is_behind(r)],
            )
            for kind in COLOURS
        ]
        lanes.append((BEHIND_COLOUR, (row[rank] - 0.45, 0.12), [r for r in behind if r["rank"] == rank]))
        for colour, lane, recs in lanes:
            spans = [
                (_start(r) - origin, float(r.get("duration") or 0.0))
                for r in recs
                if float(r.get("duration") or 0.0) > 0
            ]
            if spans:
                ax.broken_barh(spans, lane, facecolors=colour, edgecolor="white", linewidth=0.5)
        spans = [(e.start - origin, max(e.end - e.start, 1e-3)) for e in eager if e.rank == rank]
        if spans:
            ax.broken_barh(spans, (row[rank] + 0.33, 0.12), facecolors=EAGER_COLOUR, edgecolor="white", linewidth=0.5)
    axes_chars = 13 * 0.8 * 72 / (0.6 * 7)  # characters of 7 pt text across the axes
    for rec in records:
        fits = int(float(rec.get("duration") or 0.0) / max(end, 1e-9) * axes_chars) - 2
        if rec["event"] in ("compile", "wait") and not _is_behind(rec) and fits >= 8:
            ax.text(
                _start(rec) - origin + float(rec["duration"]) / 2,
                row[rec["rank"]],
                _bar_text(rec, keys, fits),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
    hits = [(float(r["time"]) - origin, row[r["rank"]] + 0.38) for r in records if r["event"] == "hit"]
    if hits:
        ax.scatter([x for x, _ in hits], [y for _, y in hits], marker="v", s=28, color=COLOURS["hit"], zorder=3)
    steps = [(float(r["time"]) - origin, row[r["rank"]]) for r in records if r["event"] == "step"]
    if steps:
        ax.scatter(
            [x for x, _ in steps], [y for _, y in steps], marker="|", s=260, color="black", linewidths=1.2, zorder=3
        )
    ax.set_yticks([row[r] for r in ranks], [f"rank {r}" for r in ranks])
    ax.set_ylim(-0.7, len(ranks) - 0.3)
    ax.set_xlim(0, end * 1.02 if end > 0 else 1)
    ax.set_xlabel("seconds since the job's first cache event")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"recipecache timeline: {Path(run_dir).name}", fontsize=11)
    legend = [
        Patch(color=COLOURS["compile"], label="compile"),
        Patch(color=COLOURS["wait"], label="wait for another rank"),
        Patch(color=COLOURS["put"], label="publish"),
        plt.Line2D([], [], marker="v", color=COLOURS["hit"], linestyle="", label="hit (loaded from the store)"),
        plt.Line2D([], [], marker="|", color="black", linestyle="", markersize=12, label="training step ends"),
    ]
    if behind or eager:
        legend += [
            Patch(color=BEHIND_COLOUR, label="compile behind the steps (worker)"),
            Patch(color=EAGER_COLOUR, label="graph run without inductor"),
        ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28 if len(ranks) < 3 else -0.12),
        ncol=len(legend) if len(legend) <= 5 else 4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_output_file(Path(out), "picture", png.getbuffer())
