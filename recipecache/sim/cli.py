"""``recipecache sim``: the simulator on the command line (a table, or JSON with ``--json``).

Bad input raises :class:`~recipecache.errors.ConfigError`; the ``recipecache`` main
turns it into a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import quantities
from .api import compare, simulate
from .model import DEFAULT_RANKS_PER_NODE, DISTRIBUTIONS, POLICIES, SCHEDULES, Costs, Report, Scenario

_COSTS = Costs()

#: table columns: (heading, Report attribute, format)
_COLUMNS = (
    ("compiles", "compile_events", "{:d}"),
    ("delays", "compile_delays", "{:d}"),
    ("waits", "wait_events", "{:d}"),
    ("fetches", "fetch_events", "{:d}"),
    ("stall_s", "stall_s", "{:.1f}"),
    ("wasted_s", "wasted_compile_s", "{:.1f}"),
    ("prewarm_s", "prewarm_s", "{:.1f}"),
    ("wall_s", "wall_s", "{:.1f}"),
    ("worst_s", "worst_step_s", "{:.1f}"),
    ("eager", "eager_steps", "{:d}"),
    ("tail_s", "tail_s", "{:.1f}"),
    ("balance", "compile_balance", "{:.2f}"),
    ("remote_mb", "remote_mb", "{:.0f}"),
)
#: policies renamed after the feature they model, by their old names
RENAMED_POLICIES = {"behind": "no_stall"}
#: figures compared against policy none with --compare
_RATIOS = ("stall_s", "compile_delays", "compile_events", "wall_s")


#: the options that take a number, by dest: read by the rule of :mod:`recipecache.quantities` (whole numbers, and
#: numbers with a point allowed); the model checks their bounds
_WHOLE_OPTIONS = ("ranks", "shapes", "steps", "seed", "ranks_per_node", "rank0_shapes")
_NUMBER_OPTIONS = (
    "zipf_exponent",
    "compile_s",
    "compile_spread",
    "compute_s",
    "fetch_latency_s",
    "bandwidth",
    "store_bandwidth",
    "local_bandwidth",
    "artifact_mb",
    "trace_s",
    "eager_slowdown",
    "no_stall_cpu_share",
    "pool_poll_s",
)


def add_parser(subparsers: Any) -> None:
    """Register ``sim`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "sim",
        help="simulate compile stalls of a data-parallel job per cache policy",
        description="Simulate how much time N lockstep ranks lose to compiles, with and without "
        "a shared single-flight cache.",
    )
    p.add_argument("--ranks", help="data-parallel ranks N (default 8, or the trace's)")
    p.add_argument("--shapes", help="distinct shapes S (default 16)")
    p.add_argument("--steps", help="training steps (default: iid 1000, adversarial 1+N*(S-1), trace: all)")
    p.add_argument("--policy", default="singleflight", choices=(*POLICIES, *RENAMED_POLICIES))
    p.add_argument("--schedule", default="iid", choices=SCHEDULES)
    p.add_argument("--trace", help="event-log directory to replay (RECIPECACHE_EVENT_LOG of a run)")
    p.add_argument("--seed", default=0)
    p.add_argument("--distribution", default="zipf", choices=DISTRIBUTIONS, help="iid shape distribution")
    p.add_argument("--zipf-exponent", default=1.0)
    p.add_argument("--weights", help="iid shape weights, comma-separated (fixes S)")
    p.add_argument("--compile-s", default=_COSTS.compile_s, help="median compile seconds per shape")
    p.add_argument(
        "--compile-spread",
        default=_COSTS.compile_spread,
        help="lognormal sigma of compile times (0: all equal)",
    )
    p.add_argument("--compute-s", default=_COSTS.compute_s, help="compute seconds per step")
    p.add_argument("--fetch-latency-s", default=_COSTS.fetch_latency_s)
    p.add_argument(
        "--bandwidth",
        default=_COSTS.bandwidth_mb_s,
        help="one fetch's top rate (what one client takes in and verifies), MB/s",
    )
    p.add_argument(
        "--store-bandwidth",
        default=_COSTS.store_mb_s,
        help="the store's bandwidth, shared by every fetch in flight, MB/s",
    )
    p.add_argument("--local-bandwidth", default=_COSTS.local_mb_s, help="reading a node directory's copy, MB/s")
    p.add_argument("--artifact-mb", default=_COSTS.artifact_mb, help="artifact size, MB")
    p.add_argument(
        "--trace-s",
        default=_COSTS.trace_s,
        help="no_stall: seconds of each compile that are dynamo's trace, paid synchronously by every "
        "rank meeting a shape not yet in the store",
    )
    p.add_argument(
        "--eager-slowdown",
        default=_COSTS.eager_slowdown,
        help="no_stall: how many times longer a step runs without inductor (>= 1)",
    )
    p.add_argument(
        "--no-stall-cpu-share",
        "--behind-cpu-share",  # its name before the policy was named after the feature
        default=_COSTS.no_stall_cpu_share,
        help="no_stall: share of the steps' CPU a background compile takes while it runs "
        "(0 to below 1; 0: a GPU node, where it runs on cores the steps leave idle)",
    )
    p.add_argument(
        "--pool-poll-s",
        default=_COSTS.pool_poll_s,
        help="pool: how often an idle worker polls the store for compiles a busy rank offers; a compile "
        "another rank's worker takes starts this plus one fetch later",
    )
    p.add_argument(
        "--rank0-shapes",
        default=0,
        help="shapes only rank 0 meets (at step 0) and calls every step, beyond the schedule's: an "
        "evaluation only rank 0 runs",
    )
    p.add_argument("--ranks-per-node", default=DEFAULT_RANKS_PER_NODE, help="ranks sharing a node")
    p.add_argument(
        "--node-tier",
        action="store_true",
        help="one rank per node fetches each artifact; the node's others read its copy",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="the store and every node share one host (as load_bench.py on 127.0.0.1)",
    )
    p.add_argument("--warm", action="store_true", help="the store holds every shape when the job starts")
    p.add_argument("--compare", action="store_true", help="every policy on the same schedule, with ratios vs none")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also plot stall vs ranks and vs shapes per policy, and the job-start herd vs ranks "
        "(8 to 8,192) with and without the node tier",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _weights(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    weights = []
    for i, part in enumerate(text.split(","), 1):
        weights.append(quantities.number(f"--weights: weight {i}", part, fraction=True))
    return tuple(weights)


def _read_numbers(args: argparse.Namespace) -> None:
    """Each number option given on the command line (a string; a default is a number already), read by the rule."""
    for dest in (*_WHOLE_OPTIONS, *_NUMBER_OPTIONS):
        text = getattr(args, dest)
        if isinstance(text, str):
            name = "--" + dest.replace("_", "-")
            setattr(args, dest, quantities.number(name, text, fraction=dest in _NUMBER_OPTIONS))


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    _read_numbers(args)
    costs = Costs(
        compile_s=args.compile_s,
        compile_spread=args.compile_spread,
        compute_s=args.compute_s,
        fetch_latency_s=args.fetch_latency_s,
        bandwidth_mb_s=args.bandwidth,
        artifact_mb=args.artifact_mb,
        store_mb_s=args.store_bandwidth,
        local_mb_s=args.local_bandwidth,
        trace_s=args.trace_s,
        eager_slowdown=args.eager_slowdown,
        no_stall_cpu_share=args.no_stall_cpu_share,
        pool_poll_s=args.pool_poll_s,
    )
    return Scenario(
        schedule=args.schedule,
        ranks=args.ranks,
        shapes=args.shapes,
        steps=args.steps,
        seed=args.seed,
        costs=costs,
        distribution=args.distribution,
        zipf_exponent=args.zipf_exponent,
        weights=_weights(args.weights),
        trace=Path(args.trace) if args.trace else None,
        ranks_per_node=args.ranks_per_node,
        node_tier=args.node_tier,
        colocated=args.colocated,
        warm=args.warm,
        rank0_shapes=args.rank0_shapes,
    )


def ratios(reports: dict[str, Report]) -> dict[str, dict[str, float | None]]:
    """Each policy's figures over policy none's (None where none's figure is 0)."""
    base = reports.get("none")
    if base is None:
        return {}
    return {
        policy: {f: (getattr(r, f) / getattr(base, f) if getattr(base, f) else None) for f in _RATIOS}
        for policy, r in reports.items()
    }


def _cell(fmt: str, value: float | None) -> str:
    """A table cell: a figure the policy has none of (``compile_balance`` without a compile) reads ``-``."""
    return "-" if value is None else fmt.format(value)


def table(reports: dict[str, Report]) -> str:
    first = next(iter(reports.values()))
    lines = [
        f"schedule {first.schedule}: {first.ranks} ranks, {first.shapes} shapes, {first.steps} steps; "
        f"worst case N*(S-1)+1 = {first.worst_case_delays} compile delays"
    ]
    vs_none = ratios(reports)
    heading = f"{'policy':<13}" + "".join(f"{h:>11}" for h, _, _ in _COLUMNS)
    lines.append(heading + (f"{'stall/none':>12}" if vs_none else ""))
    for policy, r in reports.items():
        row = f"{policy:<13}" + "".join(f"{_cell(fmt, getattr(r, attr)):>11}" for _, attr, fmt in _COLUMNS)
        if vs_none:
            ratio = vs_none[policy]["stall_s"]
            row += f"{'-' if ratio is None else f'{ratio:.3f}':>12}"
        lines.append(row)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.policy in RENAMED_POLICIES:
        print(
            f"recipecache sim: --policy {args.policy} is deprecated; use {RENAMED_POLICIES[args.policy]}",
            file=sys.stderr,
        )
        args.policy = RENAMED_POLICIES[args.policy]
    scenario = scenario_from_args(args)
    reports = compare(scenario=scenario) if args.compare else {args.policy: simulate(args.policy, scenario)}
    if args.plot:
        from .plot import plot_sweeps

        plot_sweeps(args.plot, scenario)
    if args.json:
        data: dict[str, Any] = (
            reports[args.policy].to_dict()
            if not args.compare
            else {"policies": {p: r.to_dict() for p, r in reports.items()}, "vs_none": ratios(reports)}
        )
        print(json.dumps(data, indent=2))
    else:
        print(table(reports))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
