"""Stall versus the number of ranks and versus the number of shapes, one line per policy.

matplotlib is imported only here and only when a plot is asked for: it is an optional
dependency (the ``plot`` extra) and slow to import.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .api import compare
from .model import DEFAULT_RANKS, DEFAULT_SHAPES, POLICIES, Scenario

log = logging.getLogger(__name__)

_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."))


def sweep(limit: int) -> list[int]:
    """1, 2, 4, ... below ``limit``, then ``limit``: a log axis reaching the asked-for size."""
    values = [1]
    while values[-1] * 2 < limit:
        values.append(values[-1] * 2)
    return values + [limit] if limit > 1 else values


def plot_sweeps(path: str | Path, scenario: Scenario, policies: Sequence[str] = POLICIES) -> None:
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
    fig, axes = plt.subplots(1, len(axes_spec), figsize=(11, 4.5))
    for ax, (name, values, fixed) in zip(axes, axes_spec):
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
    fig.suptitle(f"compile stall per policy, schedule {scenario.schedule}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    log.info("wrote %s", path)
