"""A correction to what torch's guard-state pickler writes into a precompiled artifact: gradients no guard reads.

``aot_compile`` pickles the guards' state (``torch._dynamo.guards.GuardsStatePickler``): each
tensor a guard reads becomes a fake tensor rebuilt on load by ``_unpickle_tensor``, which also
assigns it the tensor's ``.grad``. That gradient is pickled like any other value, and a value no
guard reads is pickled as torch's ``_Missing`` placeholder, which ``_unpickle_tensor`` then
assigns to ``.grad``: ``TypeError: assigned grad expected to be a Tensor or None but got grad
of type _Missing``. So on torch 2.13 and 2.14 an artifact traced while the parameters held gradients
(a shape first met in a later step of a loop whose ``zero_grad`` follows the forward, as Lightning's
does) loads in no process. Torch 2.15 assigns ``None`` for a placeholder itself (its
``_unpickle_tensor``); there the correction changes nothing a loader sees.

A gradient no guard reads is not part of what the guards check, so the artifact records none
(``None``, what the tensor had before its first backward): :func:`install` wraps the pickler's
``reducer_override`` so that a tensor's gradient is written only where the guards read it. Where a
guard does read it (code that branches on ``p.grad``), it is pickled as torch pickles it.
"""

from __future__ import annotations

import functools
from typing import Any

#: where ``_unpickle_tensor`` takes the gradient among its arguments (its fifth parameter, ``grad``: checked by
#: :data:`..compat.HOOKS`)
GRAD = 4

_installed = False


def install() -> None:
    """Correct torch's guard-state pickler in this process (idempotent): see the module docstring.

    Called before the tier's first ``aot_compile``; it changes only what torch would have written
    as an unloadable artifact, so it stays on for the process.
    """
    global _installed
    if _installed:
        return
    from torch._dynamo.guards import GuardsStatePickler

    original = GuardsStatePickler.reducer_override

    @functools.wraps(original)
    def reducer_override(self: Any, obj: Any) -> Any:
        reduced = original(self, obj)
        if isinstance(reduced, tuple) and reduced and reduced[0] == type(self)._unpickle_tensor:
            func, args = reduced
            grad = args[GRAD]
            if grad is not None and id(grad) not in self.guard_tree_values:
                return func, (*args[:GRAD], None, *args[GRAD + 1 :])
        return reduced

    GuardsStatePickler.reducer_override = reducer_override
    _installed = True
