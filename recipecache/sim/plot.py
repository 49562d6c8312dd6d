"""Stall versus the number of ranks and versus the number of shapes, one line per policy; and
the herd at a job's start versus the number of ranks, with and without the node tier.

matplotlib is imported only here and only when a plot is asked for: it is an optional
dependency (the ``plot`` extra) and slow to import.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..fsutil import check_output_file, write_output_file
from .api import compare, simulate
from .model import DEFAULT_RANKS, DEFAULT_SHAPES, POLICIES, Scenario

log = logging.getLogger(__name__)

_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", "-"))
#: the herd panel's ranks: 8 to 8,192
HERD_RANKS = tuple(8 * 2**i for i in range(11))


def sweep(limit: int) -> list[int]:
    """1, 2, 4, ... below ``limit``, then ``limit``: a log axis reaching the asked-for size."""
    values = [1]
    while values[-1] * 2 < limit:
        values.append(values[-1] * 2)
    return [*values, limit] if limit > 1 else values


def plot_sweeps(path: str | Path, scenario: Scenario, policies: Sequence[str] = POLICIES) -> None:
    check_output_file(Path(path), "--plot")  # before the sweeps, as the write checks it again
    if scenario.schedule == "trace":
        raise ConfigError("--plot sweeps ranks and shapes, which a trace fixes; use schedule iid or adversarial")
    if scenario.weights is not None:
        raise ConfigError("--plot sweeps the number of shapes, which --weights fixes; use --distribution")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib (pip install 'recipecache[plot]')") from exc

    ranks, shapes = scenario.ranks or DEFAULT_RANKS, scenario.shapes or DEFAULT_SHAPES
    axes_spec = (("ranks", sweep(ranks), f"{shapes} shapes"), ("shapes", sweep(shapes), f"{ranks} ranks"))
    fig, axes = plt.subplots(1, len(axes_spec) + 1, figsize=(16.5, 5))
    for ax, (name, values, fixed) in zip(axes, axes_spec, strict=False):  # the last axis is drawn below
        stalls: dict[str, list[float]] = {p: [] for p in policies}
        for value in values:
            for policy, report in compare(policies, scenario.replace(**{name: value})).items():
                stalls[policy].append(report.stall_s)
        for i, (policy, ys) in enumerate(stalls.items()):
            marker, style = _STYLES[i % len(_STYLES)]  # shared often lies under singleflight: tell them apart
            ax.plot(values, ys, marker=marker, linestyle=style, label=policy)
        ax.set_xscale("log", base=2)
        if all(y > 0 for ys in stalls.values() for y in ys):
            ax.set_yscale("log")
        ax.set_xlabel(f"{name} ({fixed})")
        ax.set_ylabel("stall (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    _plot_herd(axes[-1], scenario.replace(ranks=None), shapes)
    fig.suptitle(
        f"compile stall per policy, schedule {scenario.schedule}"
        f"{', node tier' if scenario.node_tier else ''}; right: every rank fetching at job start"
    )
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_output_file(Path(path), "--plot", png.getbuffer())
    log.info("wrote %s", path)


def _plot_herd(ax: Any, scenario: Scenario, shapes: int) -> None:
    """Stall of a job's start vs ranks: every rank needs all ``shapes`` artifacts at once.

    On a warm store that is pure fetching, through one store's bandwidth (the herd); on a
    cold one each shape is compiled once first (single-flight) and then fetched.
    """
    costs = scenario.costs
    per_node = scenario.ranks_per_node
    lines = (
        ("warm store", True, False, "o", "-"),
        (f"warm store, node tier ({per_node} ranks/node)", True, True, "s", "-"),
        ("cold store", False, False, "^", "--"),
        ("cold store, node tier", False, True, "D", "--"),
    )
    for label, warm, tier, marker, style in lines:
        stalls = [
            simulate(
                "singleflight",
                scenario.replace(
                    schedule="startup", ranks=n, steps=1, weights=None, trace=None, warm=warm, node_tier=tier
                ),
            ).stall_s
            for n in HERD_RANKS
        ]
        ax.plot(HERD_RANKS, stalls, marker=marker, linestyle=style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(HERD_RANKS[::2], [f"{n:,}" for n in HERD_RANKS[::2]])
    ax.set_xlabel(f"ranks ({shapes} artifacts of {costs.artifact_mb:g} MB; store {costs.store_mb_s:g} MB/s)")
    ax.set_ylabel("stall at job start (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
