"""``recipecache``: the admin command line (argparse -> store -> one operation -> exit code).

Exit status: 0 on success, 1 when the operation found a problem (bad entries left by
``verify``, a backend that failed, a failed ``doctor`` check, a path the system refuses), 2 for bad input. Errors are
one line on stderr. ``explain``, ``trace`` and ``doctor`` live in their own modules
(:mod:`recipecache.runs.explain`, :mod:`recipecache.runs.timeline`, :mod:`recipecache.tools.doctor`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import env
from ..argparsing import OneLineArgumentParser
from ..backends import command_line_password_warning
from ..errors import BackendError, ConfigError
from ..fsutil import check_output_file
from ..runs import explain, report, timeline
from ..runs.events import Skipped, open_regular
from ..settings import StoreSettings
from ..sizes import format_size, parse_size
from ..store_admin import StoreAdmin
from . import admin, doctor


def _store(args: argparse.Namespace) -> StoreAdmin:
    store = StoreAdmin.open(StoreSettings.resolve(args.url, namespace=args.namespace))
    store.discover()  # a cluster URL whose seed nodes none answers is bad input (exit 2)
    return store


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def cmd_stats(args: argparse.Namespace) -> int:
    data = admin.namespace_sizes(_store(args))
    lines = [f"store {data['url']}: {data['entries']} entries, {format_size(data['bytes'])}"]
    lines += [
        f"  {name:<24} {n['entries']:>8} entries {format_size(n['bytes']):>12}"
        for name, n in sorted(data["namespaces"].items())
    ]
    _emit(args, data, "\n".join(lines))
    return 0


def _when(unix: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix)) if unix else "-"


def cmd_ls(args: argparse.Namespace) -> int:
    reports = list(admin.inspect_entries(_store(args)))
    lines = [
        f"{'KIND':<10} {'WHAT':<52} {'COMPILE_S':>9} {'SIZE':>10}  {'CREATED':<16}  {'PRODUCER':<18} "
        f"{'LAST USED':<16}  STATUS"
    ]
    for r in reports:
        meta = r.header.meta if r.header else {}
        what = " ".join(str(meta[k]) for k in ("name", "shapes") if meta.get(k)) or (
            r.header.key if r.header else r.storage_key
        )
        compile_s = f"{meta['compile_s']:.1f}" if isinstance(meta.get("compile_s"), (int, float)) else "-"
        producer = f"{r.header.host}/rank{r.header.rank}" if r.header else "?"
        lines.append(
            f"{str(meta.get('kind', '-'))[:10]:<10} {what[:52]:<52} {compile_s:>9} {format_size(r.size):>10}  "
            f"{_when(r.header.created if r.header else None):<16}  {producer[:18]:<18} {_when(r.last_used):<16}  "
            f"{r.problem or ('signed' if r.header and r.header.signed else 'ok')}{' (node copy)' if r.node else ''}"
        )
    _emit(args, [r.to_dict() for r in reports], "\n".join(lines))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _store(args)
    result = admin.verify(store, fix=args.fix)
    removed = {(r.storage_key, r.node) for r in result.removed}  # an entry and its node copy are two
    changed = {(r.storage_key, r.node) for r in result.changed}
    left = Counter(str(r.reason) for r in result.bad if (r.storage_key, r.node) not in removed | changed)
    lines = [f"bad {r.storage_key}{' (node copy)' if r.node else ''}: {r.problem}" for r in result.bad]
    if args.fix:
        lines.append(f"{len(removed)} corrupt entries removed from namespace {store.namespace}")
        if changed:
            lines.append(
                f"{len(changed)} corrupt entries were rewritten or removed by others while verify ran and "
                "are left as they are now (run verify again to check them)"
            )
        if left:
            lines.append(
                f"{left.total()} refused entries left in place "
                f"({', '.join(f'{reason} {n}' for reason, n in sorted(left.items()))}): they are intact, "
                f"only not acceptable with this secret (is it the right one?); jobs that can use them still may"
            )
    else:
        lines.append(f"{len(result.bad)} bad entries found in namespace {store.namespace}")
    _emit(
        args,
        {
            "checked": result.checked,
            "bad": [r.to_dict() for r in result.bad],
            "fixed": args.fix,
            "removed": sorted(key for key, _node in removed),
            "changed": sorted(key for key, _node in changed),
        },
        "\n".join(lines),
    )
    return 1 if left else 0


def cmd_prune(args: argparse.Namespace) -> int:
    try:
        limit = parse_size(args.max_size)
    except ConfigError as exc:
        raise ConfigError(f"--max-size: {exc}") from None
    freed = admin.prune(_store(args), limit)
    _emit(args, {"freed_bytes": freed, "max_size": limit}, f"freed {format_size(freed)} (cap {format_size(limit)})")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    store = _store(args)
    removed = admin.clear(store, all_namespaces=args.all)
    scope = "all namespaces" if args.all else f"namespace {store.namespace}"
    _emit(args, {"removed": removed}, f"removed {removed} entries from {scope}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    store = _store(args)
    count = admin.export_namespace(store, Path(args.file))
    _emit(
        args,
        {"exported": count, "file": args.file},
        f"exported {count} entries of namespace {store.namespace} to {args.file}",
    )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    store = _store(args)
    imported, refused = admin.import_file(store, Path(args.file), unsigned=args.unsigned)
    _emit(
        args,
        {"imported": imported, "refused": refused},
        f"imported {imported} entries into namespace {store.namespace}; refused {refused} that failed verification",
    )
    return 1 if refused else 0


def _say_skipped(skipped: Skipped, where: str) -> None:
    """One line on stderr when the readers of a run directory left something out."""
    if skipped:
        print(f"recipecache: {skipped.describe()} in {where}", file=sys.stderr)


def _check_run_dirs(paths: list[str]) -> None:
    """A run directory that does not exist is bad input (a typo), not a run whose ranks recorded nothing."""
    for path in paths:
        if not Path(path).exists():
            raise ConfigError(f"{path[:200]}: no such run directory")


def cmd_explain(args: argparse.Namespace) -> int:
    _check_run_dirs(args.run_dir)
    skipped = Skipped()
    found = explain.explain(args.run_dir, key=args.key, skipped=skipped)
    _say_skipped(skipped, ", ".join(args.run_dir))
    _emit(args, [g.to_dict() for g in found.groups], explain.format_explanation(found))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    _check_run_dirs([args.run_dir])
    check_output_file(Path(args.output), "trace file")  # both outputs before either is written
    if args.png:
        check_output_file(Path(args.png), "picture")
    skipped = Skipped()
    trace = timeline.write_trace(args.run_dir, args.output, skipped=skipped)
    _say_skipped(skipped, args.run_dir)
    if args.png:
        timeline.draw(args.run_dir, args.png)
    events = trace["traceEvents"]
    ranks = len({e["pid"] for e in events})
    print(
        f"wrote {args.output}: {len(events)} events on {ranks} rank tracks (open in ui.perfetto.dev)"
        + (f"; {args.png}" if args.png else "")
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The job report ``recipecache-run`` prints, for any run directory: one recipecache-run wrote (its
    ``report.json`` gives the job's own fields: exit status, wall time, ranks ended) or ranks of any launcher wrote
    through the start-up hook (:mod:`recipecache.autoenable`); the figures are always the metrics files' now."""
    _check_run_dirs([args.run_dir])
    run_dir = Path(args.run_dir).absolute()
    metrics = report.load_metrics(run_dir)
    launcher_report = _launcher_report(run_dir / LAUNCHER_REPORT)
    job = {k: v for k, v in launcher_report.items() if k not in REPORT_FIGURES}
    job.update(run_dir=str(run_dir), events=str(run_dir / env.RUN_EVENTS_NAME))
    expected = launcher_report["expected_ranks"] if "expected_ranks" in launcher_report else report.world_ranks(metrics)
    data = report.build_report(metrics, expected, graphs=report.load_graphs(run_dir / env.RUN_EVENTS_NAME), **job)
    _say_skipped(Skipped(**data["skipped"]), args.run_dir)
    _emit(args, data, report.format_report(data))
    return 0


#: the report recipecache-run leaves in its run directory
LAUNCHER_REPORT = "report.json"
#: what :func:`recipecache.runs.report.build_report` computes (the rest of a launcher's report is the job's own)
REPORT_FIGURES = frozenset(
    ("expected_ranks", "missing_ranks", "total", "ranks", "duplicates", "missed", "skipped", "no_stall")
)


def _launcher_report(path: Path) -> dict[str, Any]:
    """recipecache-run's report in ``path`` when there is a readable one (it carries the job's own fields), else {}."""
    try:
        fh = open_regular(path)
        if fh is None:
            return {}
        with fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # none, or not one recipecache-run wrote: the metrics still tell
        return {}
    if not isinstance(data, dict):
        return {}
    expected = data.get("expected_ranks")
    if not (expected is None or (isinstance(expected, list) and all(type(r) is int for r in expected))):
        return {}
    return data


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = doctor.run_checks(args.url, namespace=args.namespace)
    _emit(args, [c.to_dict() for c in checks], doctor.format_checks(checks))
    return doctor.exit_status(checks)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="recipecache", description="Inspect and manage a recipecache store.")
    common = OneLineArgumentParser(add_help=False)
    common.add_argument("--url", help="store URL (default: $RECIPECACHE_URL or the filesystem default)")
    common.add_argument("--namespace", help="namespace (default: $RECIPECACHE_NAMESPACE or 'default')")
    common.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineArgumentParser)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(func=fn)
        return p

    add("stats", cmd_stats, "entries and bytes per namespace")
    add("ls", cmd_ls, "list the entries of a namespace with their producer and status")
    add("verify", cmd_verify, "check every entry's checksum and signature").add_argument(
        "--fix", action="store_true", help="remove bad entries"
    )
    add("prune", cmd_prune, "evict least-recently-used entries down to a size").add_argument(
        "--max-size", required=True, help="size cap, e.g. 10GiB"
    )
    add("clear", cmd_clear, "remove every entry of a namespace").add_argument(
        "--all", action="store_true", help="every namespace"
    )
    add("export", cmd_export, "write a namespace's verified entries to a file").add_argument("file")
    load = add("import", cmd_import, "verify and load an exported file into a namespace")
    load.add_argument("file")
    load.add_argument(
        "--unsigned",
        action="store_true",
        help="without a secret, import signed entries of another namespace unsigned (drops their "
        "signatures; refused otherwise)",
    )
    add(
        "doctor",
        cmd_doctor,
        "check that this node can share artifacts: store, rights, clock, space, signing, "
        "key inputs (exit 1 if a check fails)",
    )
    why = sub.add_parser(
        "explain",
        help="why graphs were compiled under different keys: the differing key components",
        description="For every graph a job (or several) met under more than one key, the key "
        "components that differ, side by side.",
    )
    why.add_argument("run_dir", nargs="+", help="recipecache-run's run directory (several: compare across jobs)")
    why.add_argument("--key", help="only the graph of this key (a store key, or the start of torch's hash)")
    why.add_argument("--json", action="store_true", help="print JSON")
    why.set_defaults(func=cmd_explain)
    trace = sub.add_parser(
        "trace",
        help="write a job's timeline as a Chrome/Perfetto trace (and a PNG)",
        description="One track per rank: compiles, waits, fetches, publishes, hits and steps.",
    )
    trace.add_argument("run_dir", help="recipecache-run's run directory")
    trace.add_argument("-o", "--output", default="trace.json", help="trace file (default trace.json)")
    trace.add_argument("--png", metavar="FILE", help="also draw the timeline as a picture (needs matplotlib)")
    trace.set_defaults(func=cmd_trace)
    job = sub.add_parser(
        "report",
        help="the job report recipecache-run prints, for the run directory of a job any launcher started",
        description="Per rank and in total: compiles, store hits and misses, waits, stall and saved seconds, "
        "fallbacks; graphs compiled twice; settings the ranks differ in. Ranks enabled by RECIPECACHE_ENABLE=1 "
        "write one run directory per job (./recipecache-runs/<job>, or $RECIPECACHE_RUNS_DIR/<job>).",
    )
    job.add_argument("run_dir", help="the job's run directory (recipecache-run's, or the start-up hook's)")
    job.add_argument("--json", action="store_true", help="print the report as JSON (recipecache-run's report.json)")
    job.set_defaults(func=cmd_report)
    for extension in _EXTENSIONS:
        extension(sub)
    return parser


def _sim_parser(sub: Any) -> None:
    from ..sim.cli import add_parser

    add_parser(sub)


#: subcommands that live with their own layer
_EXTENSIONS: list[Callable[[Any], None]] = [_sim_parser]


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    warning = command_line_password_warning(getattr(args, "url", None), "--url")  # not every command has --url
    if warning:
        print(f"recipecache: warning: {warning}", file=sys.stderr)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"recipecache: error: {exc}", file=sys.stderr)
        return 2
    except BackendError as exc:
        print(f"recipecache: error: {exc.reason}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a path the system refuses (a name too long, no permission): one line, not a traceback
        print(f"recipecache: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
