"""Measured versus predicted figures of a recorded run: does the simulator agree with reality?

The launcher's report gives the stall each process measured (compile plus wait seconds,
summed over ranks under ``total.stall_s``). Replaying the run's event logs under
single-flight predicts the same figure as :attr:`Report.rank_stall_s`: the compile
times come from the trace, so what is really predicted is who compiles and how long the
others wait.

A run with ``--no-stall`` is replayed under ``no_stall`` (``pool``: with the compile pool, the default). Nobody waits there, so the figure
is the eager steps: the (rank, step) pairs that ran a graph without inductor, counted
from the run's ``eager`` records (:func:`~recipecache.sim.trace.recorded_eager_steps`)
against :attr:`Report.eager_steps`. The compile and step times come from the trace, so
what is predicted is how many steps each background compile takes to land. The replay
knows a key's calls only up to the step its rank switched in the run, so a compile that
lands later in the replay than in the run is not counted beyond it: the prediction errs
low, never high, there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .api import simulate
from .model import Report
from .trace import recorded_eager_steps

#: the policies a recorded run can be checked against: what the store does, ``--no-stall`` without the compile pool
#: (``RECIPECACHE_COMPILE_POOL=0``) and with it
FIDELITY_POLICIES = ("singleflight", "no_stall", "pool")
#: the policies whose figure is the eager steps (nobody waits)
_BEHIND = ("no_stall", "pool")


@dataclass(frozen=True)
class Fidelity:
    """``measured_s`` and ``predicted_s`` are the compared ``figure``: seconds, or under
    ``no_stall`` a count of eager steps."""

    measured_s: float
    predicted_s: float
    report: Report
    figure: str = "stall (compile + wait, summed over ranks), s"

    @property
    def relative_error(self) -> float:
        if self.measured_s == 0:
            return 0.0 if self.predicted_s == 0 else math.inf
        return abs(self.predicted_s - self.measured_s) / self.measured_s


def measured_stall(report_path: str | Path, field: str = "total.stall_s") -> float:
    """The number at dotted ``field`` of a run's report JSON."""
    try:
        value = json.loads(Path(report_path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read run report {report_path}: {exc}") from None
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"run report {report_path} has no {field}")
        value = value[part]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{field} in {report_path} is not a number: {value!r}")
    return float(value)


def replay(
    trace_dir: str | Path,
    report_path: str | Path | None = None,
    field: str = "total.stall_s",
    *,
    policy: str = "singleflight",
) -> Fidelity:
    """Replay ``trace_dir`` under ``policy`` against what the run measured: under single-flight
    (what the store does) the stall at ``field`` of the run's report, under ``no_stall`` (a
    ``--no-stall`` run) the eager steps of its event logs."""
    if policy not in FIDELITY_POLICIES:
        raise ConfigError(f"fidelity replays policy {' or '.join(FIDELITY_POLICIES)}, not {policy!r}")
    report = simulate(policy, schedule="trace", trace=Path(trace_dir))
    if policy in _BEHIND:
        return Fidelity(
            float(recorded_eager_steps(trace_dir)),
            float(report.eager_steps),
            report,
            "eager steps ((rank, step) pairs run without inductor)",
        )
    if report_path is None:
        raise ConfigError("a single-flight replay compares with the run's report: name it")
    return Fidelity(measured_stall(report_path, field), report.rank_stall_s, report)
