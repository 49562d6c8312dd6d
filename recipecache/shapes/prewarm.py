"""Compile the shapes a job will meet before its first step, spread over the ranks.

Bucketing leaves a known, small set of input shapes; :func:`prewarm` compiles them up
front so the training loop meets no compile at all. With the shared store enabled
(``recipecache.enable()``) each rank compiles only its share (shape ``i`` on rank
``i mod world_size``) and publishes it; then every rank runs every shape once, which
for the shapes other ranks compiled is a store hit (installed, not compiled).

Every rank runs the same number of forward/backward passes in each phase, so the
collectives inside a DDP-wrapped model (its gradient all-reduce) stay matched even when
the shapes do not divide evenly over the ranks. Gradients and buffers are restored
afterwards: prewarming changes no training state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import env

log = logging.getLogger(__name__)


def _run(fn: Callable[..., Any], inputs: Sequence[Any], backward: bool) -> None:
    out = fn(*inputs)
    if backward and isinstance(out, torch.Tensor) and out.requires_grad:
        (out if out.dim() == 0 else out.float().sum()).backward()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shares(shapes: int, rank: int, world: int) -> list[int]:
    """The shape index this rank runs in each round of the compile phase.

    Round ``i`` gives rank ``r`` shape ``i * world + r``; past the end a rank repeats a
    shape (its own first, or one another rank is compiling, which it then waits for),
    so every rank runs the same number of rounds.
    """
    rounds = -(-shapes // world)
    return [i * world + rank if i * world + rank < shapes else rank % shapes for i in range(rounds)]


def prewarm(
    fn: Callable[..., Any],
    example_inputs: Sequence[Sequence[Any]],
    *,
    backward: bool = True,
    module: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Compile ``fn`` (a ``torch.compile``'d module or function) for every input tuple in ``example_inputs``.

    ``backward`` also compiles the backward graph (a scalar output is backpropagated
    as is, any other tensor through its sum). ``module`` is the model whose gradients
    and buffers are saved and restored (default: ``fn`` itself when it is a module).
    Returns the seconds of the compile phase and the install phase on this rank.
    """
    if not example_inputs:
        return {"compile_s": 0.0, "install_s": 0.0}
    model = module if module is not None else fn if isinstance(fn, torch.nn.Module) else None
    # clones: backward accumulates into an existing .grad in place
    grads = (
        {p: None if p.grad is None else p.grad.detach().clone() for p in model.parameters()}
        if model is not None
        else {}
    )
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if model is not None else {}
    rank, world = _world()
    start = time.perf_counter()
    for index in _shares(len(example_inputs), rank, world):
        _run(fn, example_inputs[index], backward)
    if world > 1:
        dist.barrier()
    middle = time.perf_counter()
    for inputs in example_inputs:
        _run(fn, inputs, backward)
    end = time.perf_counter()
    if model is not None:
        with torch.no_grad():
            for p, g in grads.items():
                p.grad = g
            own = dict(model.named_buffers())
            for name, saved in buffers.items():
                own[name].copy_(saved)
    log.info(
        "recipecache: prewarmed %d shapes on rank %d/%d: compile %.1f s, install %.1f s",
        len(example_inputs),
        rank,
        world,
        middle - start,
        end - middle,
    )
    return {"compile_s": middle - start, "install_s": end - middle}


def declare_shapes(
    fn: Callable[..., Any],
    example_inputs: Sequence[Sequence[Any]],
    **options: Any,
) -> dict[str, float] | None:
    """Tell recipecache the shapes ``fn`` will meet; prewarms them when the launcher asked.

    ``recipecache-run --prewarm`` sets ``RECIPECACHE_PREWARM=1``; without it this is a
    no-op returning None, so a script can declare its shapes unconditionally. Options are
    those of :func:`prewarm`.
    """
    if not env.switch(env.PREWARM):
        return None
    return prewarm(fn, example_inputs, **options)
