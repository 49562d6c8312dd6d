"""The compile-stall simulator: how much a data-parallel job loses to compiles, per policy.

>>> from recipecache.sim import simulate
>>> simulate("none", schedule="adversarial", ranks=4, shapes=3).compile_delays   # N*(S-1)+1
9

See :mod:`recipecache.sim.engine` for the model and :mod:`recipecache.sim.trace` for replay.
"""

from __future__ import annotations

from .api import build_workload, compare, simulate
from .engine import run_policy
from .model import POLICIES, SCHEDULES, Costs, RankFigures, Report, Scenario, Workload, worst_case_delays

__all__ = [
    "POLICIES",
    "SCHEDULES",
    "Costs",
    "RankFigures",
    "Report",
    "Scenario",
    "Workload",
    "build_workload",
    "compare",
    "run_policy",
    "simulate",
    "worst_case_delays",
]
