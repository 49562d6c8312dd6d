"""Synthetic schedules: which shape each rank meets at each step.

* ``iid``: every (step, rank) draws a shape independently. The default distribution is
  Zipf with exponent 1 over the S shapes (shape 0 most common): bucketed sequence
  lengths in real data are skewed, and the rare tail is what keeps compiling late into
  training. ``uniform`` and explicit ``weights`` are the alternatives.
* ``adversarial``: the worst case of the Gaudi docs. Step 0 every rank meets shape 0
  together; then rank by rank, each step one rank meets one shape new to it (rank r meets
  shape s at step ``1 + r*(S-1) + s-1``) while the others meet shape 0 again. Without a
  shared cache every such step is a compile: ``N*(S-1)+1`` delays. Steps past that are
  all known shapes; ``steps`` below it cuts the schedule short.
* ``startup``: every rank meets every shape in the first step, in the same order: a job's
  start, where the whole job wants the same artifacts at once (on a ``warm`` store, the
  herd of fetches the node tier exists for). ``steps`` beyond the first call every shape
  again, served from memory (only policy ``no_stall`` can still be waiting for them).

With ``rank0_shapes`` (:func:`with_rank0_shapes`), rank 0 also meets that many shapes of its
own at step 0, after the schedule's, and calls them at every step (an evaluation only rank 0
runs: issue 47's cold job, where one rank has compiles nobody else can share).

Besides first meetings, each schedule says every call (``Workload.calls``), drawn again
step by step from the same random stream, so policy ``no_stall`` sees each step a shape
still compiling is called in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from .model import DEFAULT_IID_STEPS, DEFAULT_RANKS, DEFAULT_SHAPES, Calls, Scenario, Workload, calls_by_step

#: cells (step x rank) drawn per batch: bounds memory at ~20 MB whatever the job size
_BATCH_CELLS = 1 << 20


def _rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent streams for costs and shapes: changing the schedule keeps the compile times."""
    costs, shapes = np.random.default_rng(seed).spawn(2)
    return costs, shapes


def shape_weights(scenario: Scenario, shapes: int) -> np.ndarray:
    """Normalised probabilities of the iid schedule's shapes."""
    if scenario.weights is not None:
        w = np.asarray(scenario.weights, dtype=float)
        w = w / w.max()  # weights near the float limit would sum to inf, and each then to probability 0
    elif scenario.distribution == "uniform":
        w = np.ones(shapes)
    else:
        w = 1.0 / np.arange(1, shapes + 1) ** scenario.zipf_exponent
    return w / w.sum()


def _fold_first_meetings(draw: np.ndarray, first: np.ndarray, offset: int) -> None:
    """Fold one batch of draws (steps x ranks) into ``first``: flat cell index of each
    (rank, shape)'s first meeting, indexed ``rank * S + shape``."""
    steps, ranks = draw.shape
    shapes = first.size // ranks
    codes = (np.arange(ranks, dtype=np.int64) * shapes)[None, :] + draw
    np.minimum.at(first, codes.ravel(), np.arange(offset, offset + steps * ranks, dtype=np.int64))


def _iid_draws(scenario: Scenario, ranks: int, shapes: int, steps: int) -> Iterator[tuple[int, np.ndarray]]:
    """The iid schedule's shapes as (first step, steps x ranks draw) batches; the same every time."""
    _, shape_rng = _rngs(scenario.seed)
    cdf = np.cumsum(shape_weights(scenario, shapes))
    cdf[-1] = 1.0  # a uniform draw below 1 always lands on a shape despite rounding
    batch = max(1, _BATCH_CELLS // ranks)
    for start in range(0, steps, batch):
        rows = min(batch, steps - start)
        yield start, np.searchsorted(cdf, shape_rng.random((rows, ranks)), side="right")


def _one_call_per_rank(draws: Callable[[], Iterator[tuple[int, np.ndarray]]]) -> Callable[[], Iterator[Calls]]:
    """``Workload.calls`` of a schedule where every rank calls one shape per step."""

    def calls() -> Iterator[Calls]:
        for start, draw in draws():
            ranks = np.arange(draw.shape[1], dtype=np.int64)
            for row, shapes in enumerate(draw):
                yield start + row, ranks, shapes

    return calls


def iid_workload(scenario: Scenario) -> Workload:
    ranks = scenario.ranks or DEFAULT_RANKS
    shapes = len(scenario.weights) if scenario.weights is not None else scenario.shapes or DEFAULT_SHAPES
    steps = DEFAULT_IID_STEPS if scenario.steps is None else scenario.steps
    cost_rng, _ = _rngs(scenario.seed)
    never = np.iinfo(np.int64).max
    first = np.full(ranks * shapes, never, dtype=np.int64)
    for start, draw in _iid_draws(scenario, ranks, shapes, steps):
        _fold_first_meetings(draw, first, start * ranks)
    met = np.flatnonzero(first != never)
    order = np.argsort(first[met], kind="stable")
    cell, code = first[met][order], met[order]
    return Workload(
        scenario=scenario,
        ranks=ranks,
        shapes=shapes,
        steps=steps,
        step=cell // ranks,
        rank=code // shapes,
        shape=code % shapes,
        compute_s=np.full(steps, scenario.costs.compute_s),
        compile_s=scenario.costs.compile_times(shapes, cost_rng),
        fetch_s=scenario.costs.fetch_s,
        fetch_mb=scenario.costs.artifact_mb,
        calls=_one_call_per_rank(lambda: _iid_draws(scenario, ranks, shapes, steps)),
    )


def adversarial_workload(scenario: Scenario) -> Workload:
    ranks = scenario.ranks or DEFAULT_RANKS
    shapes = scenario.shapes or DEFAULT_SHAPES
    full = 1 + ranks * (shapes - 1)
    steps = full if scenario.steps is None else scenario.steps
    later = ranks * (shapes - 1)
    step = np.concatenate([np.zeros(ranks, dtype=np.int64), 1 + np.arange(later, dtype=np.int64)])
    rank = np.concatenate([np.arange(ranks, dtype=np.int64), np.repeat(np.arange(ranks, dtype=np.int64), shapes - 1)])
    shape = np.concatenate([np.zeros(ranks, dtype=np.int64), np.tile(np.arange(1, shapes, dtype=np.int64), ranks)])
    keep = step < steps
    cost_rng, _ = _rngs(scenario.seed)

    def draws() -> Iterator[tuple[int, np.ndarray]]:
        """Shape 0 everywhere but at each rank's new shapes, one steps x ranks batch at a time."""
        batch = max(1, _BATCH_CELLS // ranks)
        for start in range(0, steps, batch):
            draw = np.zeros((min(batch, steps - start), ranks), dtype=np.int64)
            new = (step >= max(start, 1)) & (step < start + len(draw))
            draw[step[new] - start, rank[new]] = shape[new]
            yield start, draw

    return Workload(
        scenario=scenario,
        ranks=ranks,
        shapes=shapes,
        steps=steps,
        step=step[keep],
        rank=rank[keep],
        shape=shape[keep],
        compute_s=np.full(steps, scenario.costs.compute_s),
        compile_s=scenario.costs.compile_times(shapes, cost_rng),
        fetch_s=scenario.costs.fetch_s,
        fetch_mb=scenario.costs.artifact_mb,
        calls=_one_call_per_rank(draws),
    )


def startup_workload(scenario: Scenario) -> Workload:
    ranks = scenario.ranks or DEFAULT_RANKS
    shapes = scenario.shapes or DEFAULT_SHAPES
    steps = 1 if scenario.steps is None else scenario.steps
    cells = ranks * shapes if steps else 0
    cost_rng, _ = _rngs(scenario.seed)
    rank = np.repeat(np.arange(ranks, dtype=np.int64), shapes)
    shape = np.tile(np.arange(shapes, dtype=np.int64), ranks)

    def calls() -> Iterator[Calls]:
        for t in range(steps):
            yield t, rank, shape

    return Workload(
        scenario=scenario,
        ranks=ranks,
        shapes=shapes,
        steps=steps,
        step=np.zeros(cells, dtype=np.int64),
        rank=rank[:cells],
        shape=shape[:cells],
        compute_s=np.full(steps, scenario.costs.compute_s),
        compile_s=scenario.costs.compile_times(shapes, cost_rng),
        fetch_s=scenario.costs.fetch_s,
        fetch_mb=scenario.costs.artifact_mb,
        calls=calls,
    )


def with_rank0_shapes(w: Workload) -> Workload:
    """``w`` with the scenario's ``rank0_shapes`` added: shapes ``S..S+E-1``, met by rank 0 at step 0 after its
    other shapes of that step and called by it at every step after its other calls. Their compile times come
    from a stream of their own, so the schedule's shapes keep theirs."""
    extra = w.scenario.rank0_shapes
    if not extra:
        return w
    own = np.arange(w.shapes, w.shapes + extra, dtype=np.int64)
    step, rank, shape = w.step, w.rank, w.shape
    if w.steps:
        at = int(np.count_nonzero((step == 0) & (rank == 0)))  # first meetings are sorted by step, then rank
        step, rank = (
            np.insert(step, at, np.zeros(extra, dtype=np.int64)),
            np.insert(rank, at, np.zeros(extra, dtype=np.int64)),
        )
        shape = np.insert(shape, at, own)
    costs_rng = np.random.default_rng(w.scenario.seed).spawn(3)[2]  # _rngs' two streams are the first two
    base = w.calls if w.calls is not None else lambda: calls_by_step(w.step, w.rank, w.shape)

    def calls() -> Iterator[Calls]:
        nothing = np.zeros(0, dtype=np.int64)
        theirs = base()
        upcoming = next(theirs, None)
        for t in range(w.steps):
            ranks, shapes = nothing, nothing
            if upcoming is not None and upcoming[0] == t:
                _, ranks, shapes = upcoming
                upcoming = next(theirs, None)
            at = int(np.searchsorted(ranks, 0, side="right"))
            yield t, np.insert(ranks, at, np.zeros(extra, dtype=np.int64)), np.insert(shapes, at, own)

    return dataclasses.replace(
        w,
        shapes=w.shapes + extra,
        step=step,
        rank=rank,
        shape=shape,
        compile_s=np.concatenate([w.compile_s, w.scenario.costs.compile_times(extra, costs_rng)]),
        calls=calls,
    )
