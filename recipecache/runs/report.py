"""One report for a whole job, aggregated from the per-rank metrics files.

``recipecache-run`` prints it when its job ends, and ``recipecache report RUN_DIR`` prints it for a run
directory that ranks of any launcher wrote (:mod:`recipecache.torch_integration.autoenable`), so it lives with the run analysis
both can import.

Pure functions over the metrics format of :mod:`recipecache.metrics_schema` (every field read here is
one of its fields) so they can be tested on synthetic files. A rank whose file is missing (it crashed, or
was killed before it could write) or unreadable is listed as such, never silently dropped: a report that
quietly covers fewer ranks would understate the job's stall.

Per rank:

* ``hits`` and ``misses`` count graph lookups (the metrics' ``cache`` TotalHit/TotalMiss: FX
  graphs and precompiled functions, the lookups that stand for a compile); ``puts`` counts
  every artifact the rank wrote to the store, of every kind (the store's count: AOTAutograd
  entries, PGO state, CPU probes and autotuning results too, and the precompiled tier's
  copies under the key naming their code). The two were never of the same kinds, so
  ``lookups`` gives each kind's hits, misses and puts side by side (the store counts each
  once, by kind: the metrics' ``lookups``), and the table prints them for the total.
* ``stall_s`` = compile seconds + wait seconds: the time this rank held up the
  collective (its peers sat in the next all-reduce meanwhile).
* ``saved_s``: for each hit, what the producing rank spent compiling that artifact
  (recorded by the torch integration; 0 when the field is absent).
* ``local_hits``: graphs torch served from its own local cache, so the store was never
  asked (a rerun on warm nodes has no store hits, and is no less cached for it).
* ``hpu`` (Gaudi jobs): the bridge's own compile count and recipe-cache hits and misses
  (:mod:`launcher.hpu_metrics`).

The report also lists graphs compiled by more than one rank and ranks that compiled a
graph others had loaded, with the reason (:mod:`recipecache.runs.explain`).

The launcher adds the job's fields, among them ``hung_ranks``: the ranks it had to end
because they were still running ``exit_grace_s`` after their script finished on every
rank of the node (see :mod:`launcher.exit_watch`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import metrics_schema as schema
from ..fsutil import write_output_file
from ..reasons import Reason
from .events import Skipped, is_seconds, open_regular
from .explain import analyse_run

log = logging.getLogger(__name__)

#: the fallback of a graph that uses a rank's process groups and stays keyed per rank
RANK_BOUND = str(Reason.RANK_BOUND)
_METRICS_FILE = re.compile(r"^metrics-rank(\d+)\.json\Z")

#: report field -> the metrics field it sums
_COUNTS: dict[str, schema.Field] = {
    "compiles": schema.COMPILES,
    "hits": schema.HITS,
    # graphs torch's own local cache served (the store was not asked)
    "local_hits": schema.LOCAL_FX_HITS,
    "misses": schema.MISSES,
    "puts": schema.STORE_PUTS,
    "waits": schema.WAITS,
    # artifacts refused for a bad checksum or signature (forged or tampered); compiled locally instead
    "refused": schema.REFUSED,
}
_SECONDS: dict[str, schema.Field] = {
    "compile_s": schema.COMPILE_S,
    "wait_s": schema.WAIT_S,
    "saved_s": schema.SAVED_S,
}
#: fields every rank row and the total carry, in print order
FIELDS = (*_COUNTS, *_SECONDS, "stall_s")
#: the most ranks a job's metrics may say it has (``world_size``): the report lists every one it lacks
MOST_RANKS = 1 << 20


@dataclass(frozen=True)
class Unreadable:
    """A rank's metrics file exists but could not be used (kept apart from a missing file)."""

    error: str


def load_metrics(run_dir: Path, *, since: float | None = None) -> dict[int, dict[str, Any] | Unreadable]:
    """The metrics files of ``run_dir`` by rank.

    ``since`` (a Unix time) ignores files last written before it, so a rank that
    crashed in a rerun is not covered by the file its predecessor left in a reused run
    directory.
    """
    found: dict[int, dict[str, Any] | Unreadable] = {}
    if not run_dir.is_dir():
        return found
    for path in sorted(run_dir.iterdir()):
        match = _METRICS_FILE.match(path.name)
        if match is None:
            continue
        try:
            if since is not None and path.stat().st_mtime < since:
                log.info("ignoring %s: written before this job started", path)
                continue
            fh = open_regular(path)  # a FIFO would block the report forever
            if fh is None:
                found[int(match.group(1))] = Unreadable(f"{path.name}: not a regular file")
                continue
            with fh:
                data = json.loads(fh.read().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: not UTF-8, not JSON, a huge number
            found[int(match.group(1))] = Unreadable(f"{path.name}: {exc.__class__.__name__}: {str(exc)[:200]}")
            continue
        problem = _damage(data)
        found[int(match.group(1))] = Unreadable(f"{path.name}: {problem}") if problem else data
    return found


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _damage(data: Any) -> str | None:
    """What makes ``data`` no metrics file (a field the report reads of the wrong type or range), or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    for name, field in (*_COUNTS.items(), *_SECONDS.items()):
        value = field.read(data)
        if value is not None and not (_count(value) if name in _COUNTS else is_seconds(value)):
            return f"{field.name} is not a {'count' if name in _COUNTS else 'number of seconds'}"
    fallbacks = schema.FALLBACKS.read(data)
    if fallbacks is not None and not (isinstance(fallbacks, dict) and all(map(_count, fallbacks.values()))):
        return f"{schema.FALLBACKS.name} is not a map of counts"
    details = schema.FALLBACK_DETAILS.read(data)
    if details is not None and not (isinstance(details, dict) and all(isinstance(v, str) for v in details.values())):
        return f"{schema.FALLBACK_DETAILS.name} is not a map of texts"
    lookups = schema.LOOKUPS.read(data)
    if lookups is not None and not (
        isinstance(lookups, dict)
        and all(
            isinstance(counts, dict) and all(_count(counts.get(name, 0)) for name in schema.OUTCOMES)
            for counts in lookups.values()
        )
    ):
        return f"{schema.LOOKUPS.name} is not a map of {'/'.join(schema.OUTCOMES)} counts by kind"
    settings = schema.SETTINGS.read(data)
    if settings is not None and not (
        isinstance(settings, dict) and all(v is None or type(v) in (str, int, bool) for v in settings.values())
    ):
        return f"{schema.SETTINGS.name} is not a map of texts, numbers and switches"
    world = schema.WORLD_SIZE.read(data)
    if world is not None and not (_count(world) and 1 <= world <= MOST_RANKS):
        return f"{schema.WORLD_SIZE.name} is not a number of ranks from 1 to {MOST_RANKS}"
    for field, ok in ((schema.HOST, lambda v: type(v) is str), (schema.PID, _count), (schema.WALL_S, is_seconds)):
        value = field.read(data)
        if value is not None and not ok(value):
            return f"{field.name} is of the wrong type"
    return None


def load_graphs(events_dir: Path, *, since: float | None = None) -> dict[str, Any]:
    """Duplicate compiles and misses of graphs others loaded, from the job's event logs (none without them).

    Its ``skipped`` entry counts what the readers left out (:class:`recipecache.runs.events.Skipped`: damaged
    records, files that are not regular files), which the report shows.
    """
    if not events_dir.is_dir():
        return {}
    skipped = Skipped()
    graphs = analyse_run(events_dir, since=since, skipped=skipped).to_dict()
    return {**graphs, "skipped": asdict(skipped)}


def rank_row(rank: int, data: Mapping[str, Any]) -> dict[str, Any]:
    """One rank's line of the report from its metrics; absent fields count as 0."""
    row: dict[str, Any] = {
        "rank": rank,
        "status": "ok",
        "host": schema.HOST.read(data),
        "pid": schema.PID.read(data),
        "wall_s": schema.WALL_S.read(data),
    }
    row.update({name: int(field.read(data) or 0) for name, field in _COUNTS.items()})
    row.update({name: float(field.read(data) or 0.0) for name, field in _SECONDS.items()})
    row["stall_s"] = row["compile_s"] + row["wait_s"]
    # no-stall's compiles behind the steps (its own graphs and, with the compile pool, other ranks'): compile work
    # of this rank all the same, off its steps' path
    row["behind_s"] = float(schema.NO_STALL_COMPILE_S.read(data) or 0.0)
    # the integration's own count: the store's fallbacks plus lookups that failed and bad artifacts
    fallbacks = schema.FALLBACKS.read(data)
    row["fallbacks"] = {str(k): int(v) for k, v in fallbacks.items()} if isinstance(fallbacks, Mapping) else {}
    details = schema.FALLBACK_DETAILS.read(data)
    row["fallback_details"] = {str(k): str(v) for k, v in details.items()} if isinstance(details, Mapping) else {}
    settings = schema.SETTINGS.read(data)
    row["settings"] = dict(settings) if isinstance(settings, Mapping) else {}
    lookups = schema.LOOKUPS.read(data)
    row["lookups"] = (
        {str(kind): {name: int(counts.get(name, 0)) for name in schema.OUTCOMES} for kind, counts in lookups.items()}
        if isinstance(lookups, Mapping)
        else {}
    )
    return row


def build_report(
    metrics: Mapping[int, Mapping[str, Any] | Unreadable],
    expected_ranks: Iterable[int] | None,
    *,
    hpu: Mapping[int, Mapping[str, float]] | None = None,
    graphs: Mapping[str, Any] | None = None,
    **job: Any,
) -> dict[str, Any]:
    """The job report: ``ranks`` (sorted by rank; missing ones included), ``total`` and ``job`` fields.

    ``expected_ranks`` None means the launcher cannot know which ranks it started (an
    elastic rendezvous): the report then covers the ranks it found and says so. ``hpu``
    is each rank's Gaudi figures (:func:`launcher.hpu_metrics.load`), folded into its row
    and the total; ``graphs`` the ``duplicates`` and ``missed`` lists of
    :meth:`recipecache.runs.explain.Analysis.to_dict`, copied into the report, and the ``skipped``
    counts of :func:`load_graphs`.
    """
    expected = set(expected_ranks) if expected_ranks is not None else set()
    rows: list[dict[str, Any]] = []
    for rank in sorted(expected | set(metrics)):
        data = metrics.get(rank)
        if data is None:
            rows.append({"rank": rank, "status": "missing"})
        elif isinstance(data, Unreadable):
            rows.append({"rank": rank, "status": "unreadable", "error": data.error})
        else:
            rows.append(rank_row(rank, data))
    ok = [r for r in rows if r["status"] == "ok"]
    total: dict[str, Any] = {name: sum(r[name] for r in ok) for name in FIELDS}
    fallbacks: Counter[str] = Counter()
    lookups: dict[str, Counter[str]] = {}
    for r in ok:
        fallbacks.update(r["fallbacks"])
        for kind, counts in r["lookups"].items():
            lookups.setdefault(kind, Counter()).update(counts)
    total["fallbacks"] = dict(fallbacks)
    total["per_rank_graphs"] = per_rank_graphs(ok)
    total["lookups"] = {kind: {name: counts[name] for name in schema.OUTCOMES} for kind, counts in lookups.items()}
    total["ranks_reported"] = len(ok)
    total["settings_differ"] = settings_differ(ok)
    total["compile_balance"] = compile_balance(ok)
    if hpu:
        figures: Counter[str] = Counter()
        for r in ok:
            if r["rank"] in hpu:
                r["hpu"] = dict(hpu[r["rank"]])
                figures.update(r["hpu"])
        total["hpu"] = dict(figures)
    return {
        **job,
        "expected_ranks": sorted(expected) if expected_ranks is not None else None,
        "missing_ranks": [r["rank"] for r in rows if r["status"] != "ok"],
        "total": total,
        "ranks": rows,
        "duplicates": list((graphs or {}).get("duplicates", [])),
        "missed": list((graphs or {}).get("missed", [])),
        "skipped": dict((graphs or {}).get("skipped", asdict(Skipped()))),
        "no_stall": no_stall_graphs(metrics),
    }


def world_ranks(metrics: Mapping[int, Mapping[str, Any] | Unreadable]) -> list[int] | None:
    """Every rank of the job, from the world size its ranks' metrics give (the largest), so a rank that left no
    metrics is listed as missing; None when no metrics file says (an older release's)."""
    sizes = [
        size
        for data in metrics.values()
        if isinstance(data, Mapping) and (size := schema.WORLD_SIZE.read(data)) is not None
    ]
    return list(range(max(sizes))) if sizes else None


def settings_differ(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The settings the ranks report (:meth:`recipecache.torch_integration.metrics.Metrics.settings`) that are not
    the same on every rank: name -> each value with its ranks. A job whose launcher chose the thread count or the
    namespace differently on some ranks shares nothing between those and the others; this says so."""
    values: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        for name, value in row.get("settings", {}).items():
            entry = values.setdefault(name, {}).setdefault(json.dumps(value), {"value": value, "ranks": []})
            entry["ranks"].append(row["rank"])
    return {name: list(by_value.values()) for name, by_value in sorted(values.items()) if len(by_value) > 1}


def compile_balance(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How the job's compile seconds fell on its ranks and nodes (issue 47): a cold job's wall is set by the rank
    with the most compile work on its path, not by the job's total. ``largest_over_mean`` is the busiest rank's
    seconds over the mean of all reporting ranks (1.0: evenly spread), ``by_node`` the seconds and ranks per host,
    with the same ratio over nodes. A rank's seconds are its inline compiles' and those it ran behind the steps
    (no-stall). ``rows``: the reporting ranks' rows. None with fewer than two ranks or no compile."""
    rows = list(rows)
    seconds = {r["rank"]: r["compile_s"] + r.get("behind_s", 0.0) for r in rows}
    total = sum(seconds.values())
    if len(seconds) < 2 or total <= 0:
        return None
    mean = total / len(seconds)
    busiest = max(seconds, key=lambda rank: (seconds[rank], -rank))
    by_node: dict[str, dict[str, Any]] = {}
    for r in rows:
        node = by_node.setdefault(str(r.get("host") or "?"), {"compile_s": 0.0, "ranks": []})
        node["compile_s"] += seconds[r["rank"]]
        node["ranks"].append(r["rank"])
    node_mean = total / len(by_node)
    return {
        "mean_s": mean,
        "largest_s": seconds[busiest],
        "largest_rank": busiest,
        "largest_over_mean": seconds[busiest] / mean,
        "by_node": dict(sorted(by_node.items())),
        "node_largest_over_mean": max(node["compile_s"] for node in by_node.values()) / node_mean,
    }


def format_compile_balance(balance: Mapping[str, Any] | None) -> list[str]:
    if balance is None:
        return []
    nodes = "; ".join(
        f"{host} {node['compile_s']:.1f} s (rank{'s' if len(node['ranks']) > 1 else ''} "
        f"{', '.join(map(str, node['ranks']))})"
        for host, node in balance["by_node"].items()
    )
    return [
        f"compile seconds: rank {balance['largest_rank']} compiled longest, {balance['largest_s']:.1f} s, "
        f"{balance['largest_over_mean']:.2f}x the mean of {balance['mean_s']:.1f} s per rank; by node: {nodes}"
        + (f" (largest {balance['node_largest_over_mean']:.2f}x the mean)" if len(balance["by_node"]) > 1 else "")
    ]


def _no_stall_rows(data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A rank's well-formed no-stall graph rows (:data:`~recipecache.metrics_schema.NO_STALL_GRAPHS`, at its former
    path in metrics an older release wrote); damaged ones left out."""
    graphs = schema.NO_STALL_GRAPHS.read(data)
    if not isinstance(graphs, Mapping):
        return {}
    return {
        str(key): row
        for key, row in graphs.items()
        if isinstance(row, Mapping)
        and _count(row.get(schema.GRAPH_EAGER_CALLS.key))
        and is_seconds(row.get(schema.GRAPH_COMPILE_S.key))
        and (row.get(schema.GRAPH_SWITCHED_AT.key) is None or is_seconds(row.get(schema.GRAPH_SWITCHED_AT.key)))
    }


def no_stall_graphs(metrics: Mapping[int, Mapping[str, Any] | Unreadable]) -> list[dict[str, Any]]:
    """No-stall, per graph: who compiled it behind the steps and for how long, and per rank the calls it
    ran without inductor and when it switched to the compiled graph (Unix time; None: it never did)."""
    out: dict[str, dict[str, Any]] = {}
    for rank in sorted(metrics):
        data = metrics[rank]
        if isinstance(data, Unreadable):
            continue
        for key, row in _no_stall_rows(data).items():
            graph = out.setdefault(
                key,
                {
                    "key": key,
                    "name": str(row.get(schema.GRAPH_NAME.key, "graph")),
                    "shapes": str(row.get(schema.GRAPH_SHAPES.key, "")),
                    "compiled_by": [],
                    "compile_s": 0.0,
                    "ranks": {},
                },
            )
            compile_s = row[schema.GRAPH_COMPILE_S.key]
            if compile_s:
                graph["compiled_by"].append(rank)
                graph["compile_s"] += float(compile_s)
            if not row[schema.GRAPH_EAGER_CALLS.key] and row.get(schema.GRAPH_SWITCHED_AT.key) is None:
                continue  # compiled for another rank (the compile pool), never run here
            eager_s: Any = row.get(schema.GRAPH_EAGER_S.key)
            failed, unfinished = row.get(schema.GRAPH_FAILED.key), row.get(schema.GRAPH_UNFINISHED.key)
            graph["ranks"][str(rank)] = {
                "eager_calls": int(row[schema.GRAPH_EAGER_CALLS.key]),
                "eager_s": float(eager_s) if is_seconds(eager_s) else 0.0,
                "switched_at": row.get(schema.GRAPH_SWITCHED_AT.key),
                **({"failed": str(failed)} if failed else {}),
                **({"unfinished": str(unfinished)} if unfinished else {}),
            }
    return list(out.values())


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a table for people: one line per rank and a total, then what was compiled twice."""
    with_hpu = "hpu" in report["total"]
    head = (
        f"{'rank':>6} {'compiles':>8} {'hits':>6} {'local':>6} {'misses':>6} {'puts':>5} {'waits':>5} "
        f"{'compile_s':>9} {'wait_s':>8} {'stall_s':>8} {'saved_s':>8} {'refused':>7}  "
        + (f"{'hpu_compiles':>12} {'recipe_hits':>11} {'recipe_misses':>13}  " if with_hpu else "")
        + "fallbacks"
    )
    lines = [head]

    def line(label: str, r: Mapping[str, Any]) -> str:
        fallbacks = ", ".join(f"{k}={v}" for k, v in sorted(r["fallbacks"].items())) or "-"
        hpu = r.get("hpu", {})
        gaudi = (
            f"{hpu.get('compiles', '-'):>12} {hpu.get('recipe_hits', '-'):>11} {hpu.get('recipe_misses', '-'):>13}  "
            if with_hpu
            else ""
        )
        return (
            f"{label:>6} {r['compiles']:>8} {r['hits']:>6} {r['local_hits']:>6} {r['misses']:>6} {r['puts']:>5} "
            f"{r['waits']:>5} {r['compile_s']:>9.2f} {r['wait_s']:>8.2f} {r['stall_s']:>8.2f} {r['saved_s']:>8.2f} "
            f"{r['refused']:>7}  {gaudi}{fallbacks}"
        )

    for r in report["ranks"]:
        if r["status"] == "missing":
            lines.append(f"{r['rank']:>6}  no metrics file: the rank crashed, was killed, or ran without recipecache")
        elif r["status"] == "unreadable":
            lines.append(f"{r['rank']:>6}  unreadable metrics: {r['error']}")
        else:
            lines.append(line(str(r["rank"]), r))
    lines.append(line("total", report["total"]))
    kinds = report["total"].get("lookups")
    if kinds:
        lines.append(
            "by kind, hits/misses/puts: "
            + ", ".join(f"{kind} {counts['hit']}/{counts['miss']}/{counts['put']}" for kind, counts in kinds.items())
            + " (the hits and misses columns count graph lookups, the puts column every kind)"
        )
    lines += format_compile_balance(report["total"].get("compile_balance"))
    if report["expected_ranks"] is None:
        lines.append(
            f"ranks of this node unknown before the job (elastic rendezvous): "
            f"{report['total']['ranks_reported']} rank(s) reported"
        )
    elif report["missing_ranks"]:
        lines.append(f"WARNING: no usable metrics from rank(s) {', '.join(map(str, report['missing_ranks']))}")
    for name, values in (report["total"].get("settings_differ") or {}).items():
        lines.append(
            f"WARNING: the ranks differ in {name}: "
            + "; ".join(f"{value['value']} on rank(s) {', '.join(map(str, value['ranks']))}" for value in values)
            + " (ranks that differ in what enters the keys share no artifacts)"
        )
    hung = report.get("hung_ranks")
    if hung:
        lines.append(
            f"WARNING: rank(s) {', '.join(str(r['rank']) for r in hung)} still running "
            f"{report['exit_grace_s']:g} s after the script finished on every rank of this node; ended "
            f"(the exit status is the scripts' own; see hung_ranks in the report)"
        )
    lines += format_graphs(report)
    lines += format_no_stall(report)
    skipped = Skipped(**report.get("skipped", {}))
    if skipped:
        lines.append(f"WARNING: reading the event logs {skipped.describe()}")
    return "\n".join(lines)


def per_rank_graphs(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Graphs that use a rank's process groups yet were keyed per rank (fallback ``rank_bound``): how many, on
    which ranks, and why (the first such rank's own words), or None when every such graph was shared."""
    bound = [r for r in rows if r["fallbacks"].get(RANK_BOUND)]
    if not bound:
        return None
    return {
        "graphs": sum(r["fallbacks"][RANK_BOUND] for r in bound),
        "ranks": [r["rank"] for r in bound],
        "why": bound[0].get("fallback_details", {}).get(RANK_BOUND, ""),
    }


def format_graphs(report: Mapping[str, Any]) -> list[str]:
    """The report's duplicate compiles and misses of graphs other ranks loaded, a line each."""
    lines = []
    bound = report["total"].get("per_rank_graphs")
    if bound:
        lines.append(
            f"keyed per rank, not shared between ranks (rank_bound: {bound['graphs']} graph lookup(s) on "
            f"rank(s) {', '.join(map(str, bound['ranks']))}): {bound['why'] or 'no reason recorded'}"
        )
    duplicates, missed = report.get("duplicates") or [], report.get("missed") or []
    if duplicates:
        lines.append(
            f"compiled by more than one rank ({len(duplicates)} graph(s); recipecache explain RUN_DIR "
            "shows differing keys):"
        )
        for dup in duplicates:
            first, *others = dup["compiles"]
            again = "; ".join(f"rank {c['rank']} again: {c['reason']}" for c in others)
            lines.append(f"  {dup['label']}: rank {first['rank']} first ({first['seconds']:.1f} s); {again}")
    if missed:
        lines.append("compiled though other ranks had loaded it from the store:")
        lines += [f"  rank {m['rank']}: {m['label']}: {m['reason']}" for m in missed]
    return lines


def format_no_stall(report: Mapping[str, Any]) -> list[str]:
    """No-stall's lines: per graph, seconds compiled behind and by whom, and per rank its eager calls and switch."""
    graphs = report.get("no_stall") or report.get("behind") or []  # "behind": a report an older release wrote
    if not graphs:
        return []
    lines = ["ran without inductor while compiling behind the steps (no-stall):"]
    for graph in graphs:
        ranks = "; ".join(
            f"rank {rank}: {row['eager_calls']} eager call(s), "
            + (
                f"switched at {time.strftime('%H:%M:%S', time.localtime(row['switched_at']))}"
                if row["switched_at"] is not None
                else f"never switched{' (' + (row.get('failed') or row['unfinished']) + ')' if row.keys() & {'failed', 'unfinished'} else ''}"
            )
            for rank, row in graph["ranks"].items()
        )
        lines.append(f"  {graph['name']} {graph['shapes']}: {no_stall_outcome(graph)}; {ranks}")
    return lines


def no_stall_outcome(graph: Mapping[str, Any]) -> str:
    """What became of a graph no-stall compiled behind the steps, in the words a user needs: who published it, or
    why nothing was published and what the next job does about it."""
    rows = graph["ranks"].values()
    if graph["compiled_by"]:
        by = ", ".join(map(str, graph["compiled_by"]))
        return f"compiled behind by rank {by} in {graph['compile_s']:.1f} s and published"
    if any(row["switched_at"] is not None for row in rows):
        return "compiled by another process (an earlier job, or a rank of another node) and loaded from the store"
    if any("unfinished" in row for row in rows):
        return (
            "NOT published: still compiling when the job ended, past the exit grace (--exit-grace); the compile was "
            "ended and the next job compiles it"
        )
    if any("failed" in row for row in rows):
        return "NOT published: the compile behind failed; the next job compiles it"
    return "NOT published: no rank of this job compiled it; the next job compiles it"


def write_report(report: Mapping[str, Any], path: Path) -> None:
    """Write the JSON report atomically, so a reader never sees half of it; onto a new name or a regular file only
    (ConfigError otherwise: what took the path's place since the launcher checked it is left as it is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_output_file(path, "--report", (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())
