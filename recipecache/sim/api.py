"""The simulator's entry points: a scenario in, one report per policy out."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .engine import run_policy
from .model import POLICIES, Report, Scenario, Workload
from .schedules import adversarial_workload, iid_workload, startup_workload, with_rank0_shapes
from .trace import trace_workload

_BUILDERS = {
    "iid": iid_workload,
    "adversarial": adversarial_workload,
    "trace": trace_workload,
    "startup": startup_workload,
}


def build_workload(scenario: Scenario) -> Workload:
    return with_rank0_shapes(_BUILDERS[scenario.schedule](scenario))


def simulate(policy: str = "singleflight", scenario: Scenario | None = None, **fields: Any) -> Report:
    """Simulate one policy. ``fields`` are :class:`Scenario` fields (``ranks=4, schedule="adversarial"``),
    applied over ``scenario`` when both are given."""
    return run_policy(build_workload(_scenario(scenario, fields)), policy)


def compare(policies: Iterable[str] = POLICIES, scenario: Scenario | None = None, **fields: Any) -> dict[str, Report]:
    """Every policy on the *same* workload (same draws, same compile times), so the
    differences are the policies' alone."""
    workload = build_workload(_scenario(scenario, fields))
    return {policy: run_policy(workload, policy) for policy in policies}


def _scenario(scenario: Scenario | None, fields: dict[str, Any]) -> Scenario:
    return (scenario or Scenario()).replace(**fields) if fields else scenario or Scenario()
