"""The simulator's data: what a job costs (:class:`Costs`), what it meets (:class:`Workload`),
what a policy made of it (:class:`Report`), and the scenario knobs (:class:`Scenario`).

The workload holds only *first meetings*: the (step, rank, shape) where a rank meets a
shape for the first time. A later meeting of the same shape on the same rank is served
from the process's own in-memory cache (as torch.compile does) and costs nothing, so the
engine never needs to look at it; this is what lets 1024 ranks x 10,000 steps run in
seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

#: none: every rank compiles every shape it meets; shared: a store without coordination
#: (fetch what some rank has finished, else compile too); singleflight: wait for the rank
#: already compiling; prewarm: the shape set compiled up front across ranks, then singleflight;
#: no_stall: nobody waits for a compile (``--no-stall``): a rank traces a new shape, runs it
#: without inductor while one rank's worker compiles it behind the steps, and switches when it lands;
#: pool: no_stall whose busy workers hand queued compiles to any rank's idle worker (issue 47).
POLICIES = ("none", "shared", "singleflight", "prewarm", "no_stall", "pool")
SCHEDULES = ("iid", "adversarial", "trace", "startup")
DISTRIBUTIONS = ("zipf", "uniform")

DEFAULT_RANKS = 8
DEFAULT_SHAPES = 16
DEFAULT_IID_STEPS = 1000
DEFAULT_RANKS_PER_NODE = 8
#: largest cost figure (seconds, MB, MB/s, factors) accepted: sums of a job's worth of them stay finite
#: (``--compile-s 1e308`` overflowed to inf and broke the engine's event queue)
MAX_COST = 1e9


#: the largest sizes a simulation takes: far beyond any job, within what its arrays can index and what ends (issue 28:
#: ``--ranks 10**20`` raised numpy's "Maximum allowed dimension exceeded", ``--steps 10**20`` ran for ever; 1024 ranks x
#: 10**5 steps take 3 s of CPU)
MOST = {"ranks": 1 << 20, "shapes": 1 << 20, "steps": 1_000_000, "ranks_per_node": 1 << 20, "rank0_shapes": 1 << 20}


def worst_case_delays(ranks: int, shapes: int) -> int:
    """The Gaudi docs' closed form: N ranks each compiling S shapes alone stall N*(S-1)+1 steps."""
    return ranks * (shapes - 1) + 1 if shapes else 0


@dataclass(frozen=True)
class Costs:
    """Seconds and sizes that price a step; defaults are a mid-size torch.compile job.

    ``compile_spread`` is the sigma of a lognormal around ``compile_s`` (its median), drawn
    once per shape: real compile times vary by graph, not by which rank compiles it.

    A fetch moves ``artifact_mb`` from the store at ``bandwidth_mb_s`` at most (what one
    client can take in and verify), and concurrent fetches share the store's own
    ``store_mb_s`` (its network and CPU): a thousand ranks fetching at job start each get a
    thousandth of it. A rank that reads its node directory's copy instead (node tier)
    does so at ``local_mb_s``.

    Policy ``behind`` splits a compile: its first ``trace_s`` seconds are dynamo's trace,
    which stays synchronous on every rank that meets the shape; the rest runs in a worker
    behind the steps. A step that runs a graph without inductor meanwhile takes
    ``eager_slowdown`` times its compute, and while a background compile runs it takes
    ``no_stall_cpu_share`` of the CPU the steps would use (0, the default, is a GPU node: the
    compile runs on cores the steps leave idle; on a CPU-only node the compile competes
    with the steps). The compile's own time stays ``compile_s - trace_s``: a measured
    compile time already holds whatever it competed with.

    Policy ``pool`` hands a queued compile to another rank's idle worker at the price of
    ``pool_poll_s`` (the taker polls the store for offers that often) plus one fetch (the
    graph to the taker, its artifact back through the store).
    """

    compile_s: float = 20.0
    compile_spread: float = 0.0
    compute_s: float = 0.5
    fetch_latency_s: float = 0.005
    bandwidth_mb_s: float = 500.0
    artifact_mb: float = 20.0
    store_mb_s: float = 2500.0
    local_mb_s: float = 2000.0
    trace_s: float = 2.0
    eager_slowdown: float = 1.5
    no_stall_cpu_share: float = 0.0
    pool_poll_s: float = 0.5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or not 0 <= value <= MAX_COST:
                raise ConfigError(
                    f"{f.name.replace('_', '-')} must be a finite number from 0 to {MAX_COST:g}, not {value}"
                )
        if self.eager_slowdown < 1:
            raise ConfigError(
                f"eager-slowdown must be >= 1 (a step without inductor is no faster), not {self.eager_slowdown}"
            )
        if self.no_stall_cpu_share >= 1:
            raise ConfigError(f"no-stall-cpu-share must be >= 0 and < 1, not {self.no_stall_cpu_share}")
        for name, what in (
            ("bandwidth_mb_s", "bandwidth"),
            ("store_mb_s", "store bandwidth"),
            ("local_mb_s", "local bandwidth"),
        ):
            if getattr(self, name) == 0:
                raise ConfigError(f"{what} must be > 0 MB/s")

    @property
    def fetch_s(self) -> float:
        """One artifact download: latency plus size over bandwidth."""
        return self.fetch_latency_s + self.artifact_mb / self.bandwidth_mb_s

    def compile_times(self, shapes: int, rng: np.random.Generator) -> np.ndarray:
        if self.compile_spread == 0:
            return np.full(shapes, self.compile_s)
        return self.compile_s * rng.lognormal(0.0, self.compile_spread, shapes)

    def trace_times(self, compile_s: np.ndarray) -> np.ndarray:
        """Each shape's synchronous trace: ``trace_s``, but never more than its whole compile."""
        return np.minimum(self.trace_s, compile_s)


@dataclass(frozen=True)
class Scenario:
    """Everything that fixes a workload; the policy is applied afterwards, so one workload
    serves every policy of a comparison.

    ``ranks``/``shapes``/``steps`` left None take the schedule's natural value: the trace's
    own, the adversarial schedule's full length ``1 + N*(S-1)``, the startup schedule's one
    step, or the module defaults. ``weights`` (iid only) overrides ``distribution`` and
    fixes the number of shapes.

    Deployment: ranks ``r`` with equal ``r // ranks_per_node`` share a node; with
    ``node_tier`` one rank per node fetches each artifact from the store and the node's
    others read its copy. ``colocated``: every node and the store run on one host (as
    ``benchmarks/load_bench.py`` does on 127.0.0.1), so reading a node copy takes its share
    of the same bandwidth as the store's fetches (at ``local_mb_s``/``store_mb_s`` of the
    cost), and one fetch's own cap does not apply. ``warm``: the store already holds every
    shape when the job starts.

    ``rank0_shapes``: shapes beyond the schedule's that only rank 0 meets, every one of them
    at every step (an evaluation only rank 0 runs, issue 47): the compiles a cold job puts
    on one rank whatever the others do. Synthetic schedules only; a trace has its own.
    """

    schedule: str = "iid"
    ranks: int | None = None
    shapes: int | None = None
    steps: int | None = None
    seed: int = 0
    costs: Costs = field(default_factory=Costs)
    distribution: str = "zipf"
    zipf_exponent: float = 1.0
    weights: tuple[float, ...] | None = None
    trace: Path | None = None
    ranks_per_node: int = DEFAULT_RANKS_PER_NODE
    node_tier: bool = False
    colocated: bool = False
    warm: bool = False
    rank0_shapes: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r} (choose from {', '.join(SCHEDULES)})")
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError(f"unknown distribution {self.distribution!r} (choose from {', '.join(DISTRIBUTIONS)})")
        for name, least in (
            ("ranks", 1),
            ("shapes", 1),
            ("steps", 0),
            ("ranks_per_node", 1),
            ("seed", 0),
            ("rank0_shapes", 0),
        ):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ConfigError(f"{name} must be >= {least}, not {value}")
            if value is not None and name in MOST and value > MOST[name]:
                raise ConfigError(f"{name} must be at most {MOST[name]:,}, not {value}")
        if not math.isfinite(self.zipf_exponent) or self.zipf_exponent < 0:
            raise ConfigError(f"zipf exponent must be >= 0, not {self.zipf_exponent}")
        if self.schedule == "trace":
            if self.trace is None:
                raise ConfigError("schedule trace needs a trace directory (--trace DIR)")
            if self.shapes is not None or self.weights is not None:
                raise ConfigError("the trace fixes the shapes; drop --shapes/--weights with schedule trace")
            if self.rank0_shapes:
                raise ConfigError("the trace fixes the shapes each rank meets; drop --rank0-shapes with schedule trace")
        elif self.trace is not None:
            raise ConfigError(f"a trace directory only applies to schedule trace, not {self.schedule}")
        if self.weights is not None:
            if self.schedule != "iid":
                raise ConfigError("weights only apply to schedule iid")
            for i, w in enumerate(self.weights, 1):
                if not math.isfinite(w) or w < 0:
                    beyond = " (a number past 1.8e308 reads as inf)" if w == math.inf else ""
                    raise ConfigError(f"weight {i} is {w:g}{beyond}: each weight must be a finite number >= 0")
            if not any(self.weights):
                raise ConfigError("every weight is 0: at least one shape must have a weight above 0")
            if self.shapes is not None and self.shapes != len(self.weights):
                raise ConfigError(f"{len(self.weights)} weights given for {self.shapes} shapes")

    def replace(self, **changes: Any) -> Scenario:
        return dataclasses.replace(self, **changes)


#: one step's graph calls: (step, rank of each call, shape of each call), by rank, in call order
Calls = tuple[int, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Workload:
    """A scenario turned into numbers: first meetings sorted by (step, rank, order met).

    ``compute_s[t]`` is step t's compute time, the same on every rank (lockstep makes a
    step as long as its slowest rank, so per-rank compute spread would only add a constant).

    ``calls`` yields every call, not only first meetings, step by step (steps without calls
    may be left out): policy ``no_stall`` needs them, because a shape still compiling costs a
    slower step at each call until it lands. It is a generator function, so a schedule can
    draw its calls again batch by batch instead of holding steps x ranks of them.
    ``trace_s`` is each shape's synchronous trace inside ``compile_s`` and ``eager_slowdown``
    how much longer a step runs without inductor; None takes them from the scenario's costs.
    """

    scenario: Scenario
    ranks: int
    shapes: int
    steps: int
    step: np.ndarray
    rank: np.ndarray
    shape: np.ndarray
    compute_s: np.ndarray
    compile_s: np.ndarray
    #: one fetch with the store to itself: latency plus ``fetch_mb`` at one client's rate
    fetch_s: float
    #: megabytes a fetch moves through the store, shared with concurrent fetches (0: a
    #: replayed trace, whose measured fetch time is all there is)
    fetch_mb: float = 0.0
    calls: Callable[[], Iterator[Calls]] | None = None
    trace_s: np.ndarray | None = None
    eager_slowdown: float | None = None


def calls_by_step(step: np.ndarray, rank: np.ndarray, shape: np.ndarray) -> Iterator[Calls]:
    """(step, rank, shape) arrays sorted by step, rank and order, as ``Workload.calls`` yields them."""
    bounds = np.flatnonzero(np.diff(step)) + 1
    for first, ranks, shapes in zip(
        [0, *bounds.tolist()], np.split(rank, bounds), np.split(shape, bounds), strict=True
    ):
        if len(ranks):
            yield int(step[first]), ranks, shapes


def compile_balance(compile_s: list[float]) -> float | None:
    """The busiest rank's compile seconds over the mean per rank (1.0: evenly spread), as the run report's
    ``compile_balance`` says it of a real job: a cold job under no-stall ends when the busiest worker does, not
    when the job's total would on all of them. None without a compile."""
    total = sum(compile_s)
    return max(compile_s) * len(compile_s) / total if total > 0 else None


@dataclass(frozen=True)
class RankFigures:
    rank: int
    compiles: int
    compile_s: float
    waits: int
    wait_s: float
    fetches: int
    fetch_s: float


@dataclass(frozen=True)
class Report:
    """What one policy did to one workload.

    ``stall_s`` is job time lost to the cache: ``wall_s - compute_s`` where ``compute_s``
    is the same job with every artifact already in memory (prewarm time included).
    ``rank_stall_s`` is the sum over ranks of the seconds each spent compiling or waiting,
    which is what each process's metrics file calls ``stall_s``. ``compile_delays``
    counts steps in which at least one rank compiled (prewarm compiles are not in a step).
    ``wasted_compile_s`` is compile work beyond the first compile of each shape.
    ``first_meetings`` counts the (rank, shape) pairs met: the events the engine played.
    ``remote_fetches``/``remote_mb`` are what crossed the store (with a node tier at most
    one fetch per node and shape), ``node_reads`` the fetches served by a node's copy.
    ``worst_step_s`` is the longest step, compute included: what a rank meeting a new
    shape costs the job at once.

    Under ``no_stall`` no rank waits for a compile (``compile_delays`` and ``wait_s`` are 0):
    ``compile_s`` is the work done behind the steps (not stall), ``trace_s`` the synchronous
    traces summed over ranks (its ``rank_stall_s``), ``eager_steps`` the (rank, step) pairs
    that ran a graph without inductor and ``eager_s`` what those and the CPU the background
    compiles took added to the steps, per rank, summed; ``fetch_events`` include the
    switches to a landed artifact. Under ``pool`` a rank's ``compiles``/``compile_s`` are
    what its worker ran, for whichever rank met the shape; ``handoffs`` counts the compiles
    another rank's worker took.

    ``compile_balance`` is the largest of the ranks' ``compile_s`` over their mean (None
    without a compile). ``first_step_s`` is step 0's length, compute included (iteration 0
    of a real job; prewarm time is not in it). ``tail_s``: how long background compiles ran
    on past the last step (a real job waits for them within its exit grace, so they reach
    the next job), 0 for the stalling policies, whose compiles end inside their step.
    """

    policy: str
    schedule: str
    ranks: int
    shapes: int
    steps: int
    first_meetings: int
    compile_events: int
    compile_delays: int
    worst_case_delays: int
    wait_events: int
    fetch_events: int
    compile_s: float
    wasted_compile_s: float
    wait_s: float
    fetch_s: float
    prewarm_s: float
    compute_s: float
    wall_s: float
    stall_s: float
    rank_stall_s: float
    per_rank: list[RankFigures]
    compile_balance: float | None = None
    remote_fetches: int = 0
    remote_mb: float = 0.0
    node_reads: int = 0
    worst_step_s: float = 0.0
    trace_s: float = 0.0
    eager_steps: int = 0
    eager_s: float = 0.0
    first_step_s: float = 0.0
    tail_s: float = 0.0
    handoffs: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
