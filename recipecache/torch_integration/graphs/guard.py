"""Every hook's own failures are swallowed and counted: the cache may fail, training may not."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ...reasons import Reason
from ..metrics import Metrics

log = logging.getLogger(__name__)

R = TypeVar("R")


class Guard:
    """Runs the hooks' work, counting what raises as fallback ``hook_error`` in ``metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def __call__(self, fn: Callable[..., R], *args: Any) -> R | None:
        """``fn(*args)``, or None with a counted ``hook_error`` if it raises: our bugs must not stop a compile."""
        try:
            return fn(*args)
        except Exception as exc:
            log.debug("recipecache hook %s failed", getattr(fn, "__name__", fn), exc_info=True)
            self.metrics.fallback(
                Reason.HOOK_ERROR, f"{getattr(fn, '__name__', fn)}: {exc!r}; torch goes on without it"
            )
            return None
