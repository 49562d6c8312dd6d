"""Measured versus predicted stall of a recorded run: does the simulator agree with reality?

The launcher's report gives the stall each process measured (compile plus wait seconds,
summed over ranks under ``total.stall_s``). Replaying the run's event logs under
single-flight predicts the same figure as :attr:`Report.rank_stall_s`: the compile
times come from the trace, so what is really predicted is who compiles and how long the
others wait.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .api import simulate
from .model import Report


@dataclass(frozen=True)
class Fidelity:
    measured_s: float
    predicted_s: float
    report: Report

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


def replay(trace_dir: str | Path, report_path: str | Path, field: str = "total.stall_s") -> Fidelity:
    """Replay ``trace_dir`` under single-flight (what the store does) against the measured stall."""
    report = simulate("singleflight", schedule="trace", trace=Path(trace_dir))
    return Fidelity(measured_stall(report_path, field), report.rank_stall_s, report)
