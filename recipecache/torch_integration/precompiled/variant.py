"""What the tier answers a call signature with: a precompiled function that serves it, or the normal path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...reasons import PrecompileDetail, PrecompileShapes, Reason
from .compiled_function import Precompiled
from .traced_values import Values


class Fallback:
    """A signature the tier does not serve: it runs on dynamo's normal path."""

    __slots__ = ("detail",)

    def __init__(self, detail: PrecompileDetail | Reason) -> None:
        self.detail = detail


@dataclass
class Variant:
    """A loaded (or just compiled) precompiled function; ``prefix`` is its bound ``self``, if any."""

    fn: Any
    prefix: tuple[Any, ...]
    #: the values its code was traced with besides the inputs, checked against this process's
    values: Values
    #: its graph takes sizes as inputs (its guards serve many sizes)
    dynamic: bool = False
    #: the artifact it was loaded from or built as (what :meth:`.build.Builder.share` publishes again)
    artifact: Precompiled | None = None

    def refusal(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, loading: bool = False
    ) -> tuple[PrecompileDetail, str] | None:
        """Why it must not serve this call (a traced value changed, its guards reject the inputs), or None.

        ``loading``: it has not served yet, so every traced value is compared; after that, those
        torch's guards do not check (torch's guards then hold the traced values for the rest).
        """
        changed = self.values.changed(lambda: self.fn.prepare_f_locals(*self.prefix, *args, **kwargs), every=loading)
        if changed is not None:
            return PrecompileDetail.VALUE_CHANGED, changed
        if not self.fn.guard_check(*self.prefix, *args, **kwargs):
            return PrecompileDetail.GUARD_FAILED, "its guards reject these inputs"
        return None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.values.refresh(self.fn)
        return self.fn(*self.prefix, *args, **kwargs)

    @property
    def shapes(self) -> PrecompileShapes:
        return PrecompileShapes.DYNAMIC if self.dynamic else PrecompileShapes.STATIC_PER_SHAPE
