"""Gaudi's own compile figures: the bridge's metrics files, read into each rank's report row.

The Intel Gaudi PyTorch bridge writes its metrics when ``PT_HPU_METRICS_FILE`` names a
file (Intel Gaudi docs, "Handling Dynamic Shapes" / "Detecting and Mitigating
Dynamicity": ``PT_HPU_METRICS_FILE=/root/metricslog.json``, dumped at process exit;
``PT_HPU_METRICS_DUMP_TRIGGERS`` takes ``process_exit``, ``metric_change``, ``user``).
What it writes, as the bridge's ``habana_frameworks/torch/hpu/metrics.py``
(``MetricSaver``, ``MetricJsonWriter``) and its tests show:

* the file name gets ``-rank<RANK>`` before the extension when ``RANK`` is set
  (``metrics.json`` -> ``metrics-rank0.json``), and ``.1``, ``.2``, ... appended when that
  file already exists (it never overwrites);
* the JSON format (the default; ``PT_HPU_METRICS_FILE_FORMAT=text`` is the other) is an
  array of ``{"metric_name", "triggered_by", "generated_on", "statistics": {...}}``, one
  per metric and trigger, the closing ``]`` written when the process exits;
* ``graph_compilation`` statistics are ``TotalNumber``, ``TotalTime``, ``AvgTime``;
  ``recipe_cache`` statistics ``TotalHit``, ``TotalMiss``, ``RecipeHit``, ``RecipeMiss``.

The docs do not give ``TotalTime``'s unit, so the report carries it as the bridge wrote it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recipecache.runs.events import open_regular

log = logging.getLogger(__name__)

METRICS_FILE = "PT_HPU_METRICS_FILE"
DUMP_TRIGGERS = "PT_HPU_METRICS_DUMP_TRIGGERS"
#: the launcher's default file, under the run directory (the bridge adds ``-rank<N>``)
DEFAULT_NAME = "hpu-metrics.json"

#: no figure of the bridge's reaches this; a larger one is damage
_MAX_FIGURE = 1e18
#: report field -> (metric name, statistic)
FIELDS = {
    "compiles": ("graph_compilation", "TotalNumber"),
    "compile_time": ("graph_compilation", "TotalTime"),
    "recipe_hits": ("recipe_cache", "TotalHit"),
    "recipe_misses": ("recipe_cache", "TotalMiss"),
}


def rank_environment(run_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The bridge's metrics variables for every rank, unless the user set them: one file per rank, at exit."""
    out = {}
    if not environ.get(METRICS_FILE):
        out[METRICS_FILE] = str(run_dir / DEFAULT_NAME)
    if not environ.get(DUMP_TRIGGERS):
        out[DUMP_TRIGGERS] = "process_exit"
    return out


def parse(text: str) -> dict[str, dict[str, Any]]:
    """The last statistics of each metric in one JSON metrics file; ``{}`` if it is not one.

    A rank killed before exit leaves the array unclosed; it is read as if closed.
    """
    for candidate in (text, text.rstrip().rstrip(",") + "]"):
        try:
            entries = json.loads(candidate)
        except (ValueError, RecursionError):  # not JSON, a number too long to parse, nesting too deep
            continue
        if isinstance(entries, list):
            return {
                e["metric_name"]: e["statistics"]
                for e in entries
                if isinstance(e, dict)
                and isinstance(e.get("metric_name"), str)
                and isinstance(e.get("statistics"), dict)
            }
    return {}


def rank_files(base: Path, *, since: float | None = None) -> dict[int, Path]:
    """The newest metrics file of each rank for the base name ``base`` (written since ``since``)."""
    stem, dot, ext = base.name.rpartition(".")
    stem, ext = (stem, dot + ext) if dot else (base.name, "")
    pattern = re.compile(rf"{re.escape(stem)}-rank(\d+){re.escape(ext)}(\.\d+)?\Z")
    newest: dict[int, tuple[float, Path]] = {}
    if not base.parent.is_dir():
        return {}
    for path in base.parent.iterdir():
        match = pattern.match(path.name)
        if match is None:
            continue
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        rank = int(match.group(1))
        if (since is None or mtime >= since) and (rank not in newest or mtime > newest[rank][0]):
            newest[rank] = (mtime, path)
    return {rank: path for rank, (_mtime, path) in newest.items()}


def load(base: Path, *, since: float | None = None) -> dict[int, dict[str, float]]:
    """Each rank's Gaudi figures (:data:`FIELDS`) from the bridge's files; ranks without a usable file are left out."""
    out: dict[int, dict[str, float]] = {}
    for rank, path in rank_files(base, since=since).items():
        try:
            fh = open_regular(path)  # a FIFO would block the report forever
            if fh is None:
                log.warning("%s is not a regular file; left out of the report", path)
                continue
            with fh:
                metrics = parse(fh.read().decode("utf-8", errors="replace"))
        except OSError as exc:
            log.warning("cannot read %s: %s", path, exc)
            continue
        if not metrics:
            log.warning("%s is not a JSON metrics file of the Gaudi bridge; left out of the report", path)
            continue
        figures: dict[str, float] = {}
        for name, (metric, statistic) in FIELDS.items():
            value: Any = metrics.get(metric, {}).get(statistic)
            if type(value) in (int, float) and abs(value) < _MAX_FIGURE:  # not a bool, NaN, infinite or absurd
                figures[name] = value
        out[rank] = figures
    return out
