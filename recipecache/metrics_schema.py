"""The metrics file's fields, named once: the writer, the readers and the docs all go through this module.

A rank's metrics file (``metrics-rank<N>.json``) is written by :mod:`recipecache.torch_integration.metrics` and
read by the job report (:mod:`recipecache.runs.report`), no-stall's worker and the benchmarks. Each field used
to be spelt as a string where it was written and again as a path where it was read, so a rename on one side
left the other reading nothing, silently (a missing field counts as 0). Here each field is a :class:`Field`:
its path in the file and one line on what it means. The writer builds the file from fields
(:func:`document`, :func:`record`), readers look fields up (:meth:`Field.read`), and docs/DEVELOPING.md's
table of the fields is :func:`markdown_table` (a test keeps the two equal).

Imports nothing of torch: the report and ``recipecache report`` read metrics without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import reasons

#: a path segment that stands for the keys of a map (a graph key, an artifact kind, a position in a list)
KEY, KIND, INDEX = "<key>", "<kind>", "<n>"
#: the artifact kinds ``lookups`` counts (the store's ``kind``); ``precompiled`` is a whole function (the
#: precompiled tier), ``strides`` a forward's output strides (overlap: what a rank needs to compile the backward
#: of a forward another rank compiles)
LOOKUP_KINDS = ("fx", "aot", "pgo", "isa", "autotune", "precompiled", "strides")
#: the kinds ``cache`` counts: lookups that stand for a compile (FX graphs, precompiled functions)
GRAPH_KINDS = ("fx", "precompiled")


@dataclass(frozen=True)
class Field:
    """One field of the metrics file: where it is (``path``, from the top-level object) and what it means.

    ``former``: the paths older releases wrote it at, which readers still accept (a run directory outlives a
    release).
    """

    path: tuple[str, ...]
    meaning: str
    former: tuple[tuple[str, ...], ...] = ()

    @property
    def name(self) -> str:
        """The dotted path, as the docs and the report's error messages write it."""
        return ".".join(self.path)

    @property
    def key(self) -> str:
        """The field's own name in the object that holds it."""
        return self.path[-1]

    def read(self, data: Mapping[str, Any]) -> Any:
        """The field's value in a metrics file's object (at its current path, else a former one); None if absent
        or if a section on the way is not an object (a damaged file)."""
        for path in (self.path, *self.former):
            value = _at(data, path)
            if value is not None:
                return value
        return None


def _at(data: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = data
    for part in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


RANK = Field(("rank",), "the process's rank (`RANK`)")
HOST = Field(("host",), "the host it ran on")
PID = Field(("pid",), "its process id")
WORLD_SIZE = Field(
    ("world_size",), "the job's ranks when `enable()` ran: the report lists every rank that left no file"
)
SETTINGS = Field(
    ("settings",),
    "what the ranks of a job must agree on to share artifacts (threads, store, namespace, node tier), by name: "
    "the report says which differ between ranks",
)
WALL_S = Field(("wall_s",), "seconds since the metrics began (`enable()`)")
ENABLE = Field(("enable",), "what `enable()` cost, for a job's timeline; `null` before it ended")
ENABLE_START = Field(("enable", "start"), "when `enable()` started (Unix seconds)")
ENABLE_S = Field(("enable", "s"), "the seconds it took (mostly torch's own imports)")
COMPILES = Field(
    ("graph_compilation", "TotalNumber"), "graphs inductor compiled in this process (codegen that ran here, any graph)"
)
COMPILE_S = Field(("graph_compilation", "TotalTime"), "their seconds")
AVERAGE_COMPILE_S = Field(("graph_compilation", "AvgTime"), "seconds per compile (0 without compiles)")
HITS = Field(("cache", "TotalHit"), f"graph lookups the store served (kinds `{' '.join(GRAPH_KINDS)}`)")
MISSES = Field(("cache", "TotalMiss"), "graph lookups it did not serve")
LOCAL_HITS = Field(
    ("local_hits",),
    "lookups torch's own local cache served, by cache (`fx`, `aot`): the store was never asked; `{}` when this "
    "torch lacks the counters",
)
LOCAL_FX_HITS = Field(("local_hits", "fx"), "FX graphs of those (the report's `local_hits`)")
LOCAL_AOT_HITS = Field(("local_hits", "aot"), "AOTAutograd entries of those")
WAITS = Field(("waits",), "lookups that waited for another process's compile")
WAIT_S = Field(("wait_s",), "their seconds")
STALL_S = Field(("stall_s",), "compile + wait seconds: the time this process held up its peers")
SAVED_S = Field(("saved_s",), "for each hit used, the seconds its producer spent compiling it")
REFUSED = Field(("refused",), f"entries the store refused (`{' '.join(sorted(reasons.REFUSED))}`)")
FALLBACKS = Field(
    ("fallbacks",),
    "lookups and publishes the cache could not help with, by reason, each event once (the store's and the "
    "integration's own); each reason warned about once",
)
FALLBACK_DETAILS = Field(("fallback_details",), "for each reason, what its first fallback here said")
LOOKUPS = Field(("lookups",), f"per artifact kind (`{' '.join(LOOKUP_KINDS)}`), the store's counts")
LOOKUP_HIT = Field(("lookups", KIND, "hit"), "lookups of the kind the store served")
LOOKUP_MISS = Field(("lookups", KIND, "miss"), "lookups of the kind it did not")
LOOKUP_PUT = Field(("lookups", KIND, "put"), "artifacts of the kind this process published")
KERNELS_INSTALLED = Field(("kernels", "installed"), "kernel files of served artifacts written into torch's cache")
KERNELS_SHIPPED = Field(("kernels", "shipped"), "kernel files published with this process's artifacts")
PRECOMPILE_FALLBACKS = Field(
    ("precompile_fallbacks",), "call signatures the precompiled tier sent to the normal path, by detail"
)
PRECOMPILE_FALLBACK_DETAILS = Field(
    ("precompile_fallback_details",), "the first of those, each with its cause (bounded: the counts go on)"
)
PRECOMPILE_FALLBACK_DETAIL = Field(("precompile_fallback_details", INDEX, "detail"), "its detail")
PRECOMPILE_FALLBACK_MESSAGE = Field(("precompile_fallback_details", INDEX, "message"), "the tier's message")
PRECOMPILE_FALLBACK_ERROR = Field(
    ("precompile_fallback_details", INDEX, "error"), "`module.Type: message` of the exception behind it, if any"
)
PRECOMPILE_SHAPES = Field(
    ("precompile_shapes",),
    "call signatures the precompiled tier served, by how their artifact was built (`static_per_shape`, `dynamic`)",
)
STALE_SOURCES = Field(("stale_sources",), "precompiled artifacts found for other code than this process runs")
NO_STALL_EAGER_CALLS = Field(("no_stall", "eager_calls"), "no-stall: calls run without inductor")
NO_STALL_EAGER_S = Field(("no_stall", "eager_s"), "their seconds")
NO_STALL_SWITCHES = Field(("no_stall", "switches"), "switches to a compiled graph")
NO_STALL_COMPILES = Field(("no_stall", "compiles"), "compiles run behind the steps, in a worker")
NO_STALL_COMPILE_S = Field(("no_stall", "compile_s"), "their seconds")
NO_STALL_FAILED = Field(("no_stall", "failed"), "compiles behind that failed")
NO_STALL_INLINE = Field(("no_stall", "inline"), "graphs no worker can compile, compiled inline by this process")
NO_STALL_UNFINISHED = Field(("no_stall", "unfinished"), "compiles behind ended unfinished at exit (past the grace)")
NO_STALL_WORKERS = Field(("no_stall", "workers"), "worker processes started")
NO_STALL_RETRIES = Field(("no_stall", "retries"), "retries of a failed compile")
NO_STALL_KEY_MISMATCHES = Field(("no_stall", "key_mismatches"), "compiles whose worker computed another key")
NO_STALL_POOL_TAKEN = Field(("no_stall", "pool_taken"), "compile pool: other processes' graphs compiled here")
NO_STALL_POOL_HANDED = Field(("no_stall", "pool_handed"), "compile pool: graphs of this process another compiled")
NO_STALL_POOL_TAKEOVERS = Field(
    ("no_stall", "pool_takeovers"), "compile pool: graphs taken back from a taker that failed or died"
)
NO_STALL_GUARD_REJECTED = Field(
    ("no_stall", "guard_rejected"), "calls after a switch the compiled graph's guards rejected (run without inductor)"
)
NO_STALL_GRAPHS = Field(
    ("no_stall", "graphs"), "per graph key, what no-stall did with it here", former=(("behind", "graphs"),)
)
GRAPH_NAME = Field(("no_stall", "graphs", KEY, "name"), "the graph's function")
GRAPH_SHAPES = Field(("no_stall", "graphs", KEY, "shapes"), "its input shapes")
GRAPH_EAGER_CALLS = Field(("no_stall", "graphs", KEY, "eager_calls"), "its calls run without inductor")
GRAPH_EAGER_S = Field(("no_stall", "graphs", KEY, "eager_s"), "their seconds")
GRAPH_SWITCHED_AT = Field(
    ("no_stall", "graphs", KEY, "switched_at"), "when this process switched to the compiled graph (Unix seconds)"
)
GRAPH_SWITCH_S = Field(("no_stall", "graphs", KEY, "switch_s"), "the switch's seconds")
GRAPH_COMPILE_S = Field(("no_stall", "graphs", KEY, "compile_s"), "seconds of this process's compile behind")
GRAPH_FAILED = Field(("no_stall", "graphs", KEY, "failed"), "why that compile failed (only if it did)")
GRAPH_UNFINISHED = Field(
    ("no_stall", "graphs", KEY, "unfinished"), "why it was ended unfinished at exit (only if it was)"
)
GRAPH_GUARD_REJECTED = Field(
    ("no_stall", "graphs", KEY, "guard_rejected"), "calls after the switch the guards rejected (only if any)"
)
STORE = Field(("store",), "the store's own counters (`Store.stats()`)")
STORE_PUTS = Field(("store", "puts"), "artifacts of every kind this process wrote (the report's `puts`)")

#: what the lookups of each artifact kind count (``lookups``, and the store's ``by_kind``)
OUTCOMES = tuple(field.key for field in (LOOKUP_HIT, LOOKUP_MISS, LOOKUP_PUT))
#: no-stall's counters, in the file's order (:meth:`recipecache.torch_integration.metrics.Metrics.no_stall` takes
#: them by name)
NO_STALL_COUNTS = (
    NO_STALL_EAGER_CALLS,
    NO_STALL_EAGER_S,
    NO_STALL_SWITCHES,
    NO_STALL_COMPILES,
    NO_STALL_COMPILE_S,
    NO_STALL_FAILED,
    NO_STALL_INLINE,
    NO_STALL_UNFINISHED,
    NO_STALL_WORKERS,
    NO_STALL_RETRIES,
    NO_STALL_KEY_MISMATCHES,
    NO_STALL_POOL_TAKEN,
    NO_STALL_POOL_HANDED,
    NO_STALL_POOL_TAKEOVERS,
    NO_STALL_GUARD_REJECTED,
)
#: every field, in the file's order (a section's fields after it)
FIELDS = (
    RANK,
    HOST,
    PID,
    WORLD_SIZE,
    SETTINGS,
    WALL_S,
    ENABLE,
    ENABLE_START,
    ENABLE_S,
    COMPILES,
    COMPILE_S,
    AVERAGE_COMPILE_S,
    HITS,
    MISSES,
    LOCAL_HITS,
    LOCAL_FX_HITS,
    LOCAL_AOT_HITS,
    WAITS,
    WAIT_S,
    STALL_S,
    SAVED_S,
    REFUSED,
    FALLBACKS,
    FALLBACK_DETAILS,
    LOOKUPS,
    LOOKUP_HIT,
    LOOKUP_MISS,
    LOOKUP_PUT,
    KERNELS_INSTALLED,
    KERNELS_SHIPPED,
    PRECOMPILE_FALLBACKS,
    PRECOMPILE_FALLBACK_DETAILS,
    PRECOMPILE_FALLBACK_DETAIL,
    PRECOMPILE_FALLBACK_MESSAGE,
    PRECOMPILE_FALLBACK_ERROR,
    PRECOMPILE_SHAPES,
    STALE_SOURCES,
    *NO_STALL_COUNTS,
    NO_STALL_GRAPHS,
    GRAPH_NAME,
    GRAPH_SHAPES,
    GRAPH_EAGER_CALLS,
    GRAPH_EAGER_S,
    GRAPH_SWITCHED_AT,
    GRAPH_SWITCH_S,
    GRAPH_COMPILE_S,
    GRAPH_FAILED,
    GRAPH_UNFINISHED,
    GRAPH_GUARD_REJECTED,
    STORE,
    STORE_PUTS,
)


def document(values: Mapping[Field, Any]) -> dict[str, Any]:
    """The metrics file's object from each field's value, sections made as the fields' paths go (in the order
    given, which is the file's)."""
    out: dict[str, Any] = {}
    for field, value in values.items():
        *sections, key = field.path
        target = out
        for section in sections:
            target = target.setdefault(section, {})
        target[key] = value
    return out


def record(values: Mapping[Field, Any]) -> dict[str, Any]:
    """One entry of a section keyed by graph, kind or position (a no-stall graph's row, a fallback's detail): each
    field's value under its own name."""
    return {field.key: value for field, value in values.items()}


def markdown_table() -> str:
    """The fields as docs/DEVELOPING.md lists them: a row per field, the section that holds it (its dotted path,
    empty at the top level), its name and its meaning. Section and name apart: ``no_stall.workers`` written whole
    would read as a module's attribute to the docs' name check (tests/docs/test_doc_names.py)."""
    rows = [
        f"| {_code('.'.join(field.path[:-1]))} | {_code(field.key)} | {field.meaning}{_formerly(field)} |"
        for field in FIELDS
    ]
    return "\n".join(["| section | field | meaning |", "|---|---|---|", *rows])


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _formerly(field: Field) -> str:
    return f" (formerly {', '.join(_code('.'.join(path)) for path in field.former)})" if field.former else ""
