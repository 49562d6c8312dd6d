"""torch settings the tests switch that live in different places on different torch releases."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def compile_on_one_rank() -> Iterator[None]:
    """torch's compile-on-one-rank flag on: ``torch.compiler.config``'s from 2.14 (whose override is a
    context variable, so it is patched, not set and reset from elsewhere), ``torch.distributed.config``'s in 2.13."""
    import torch

    if hasattr(torch.compiler.config, "compile_on_one_rank"):
        with torch.compiler.config.patch(compile_on_one_rank=True):
            yield
        return
    import torch.distributed.config as distributed_config

    distributed_config.compile_on_one_rank = True
    try:
        yield
    finally:
        distributed_config.compile_on_one_rank = False
