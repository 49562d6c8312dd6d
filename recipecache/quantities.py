"""The one rule for a number a person types: an option, an environment variable, a URL's part or option.

A number is ASCII digits (``0-9``), and where fractions make sense (seconds, sizes) a point
and more ASCII digits: nothing else. Python's own readers each take more, and not the same
more: ``str.isdigit()`` is true for ``²``, which ``int()`` then refuses (a traceback where a
line was due); ``int()`` and ``float()`` take Arabic-Indic ``٣``, fullwidth digits, signs,
surrounding spaces and ``1_0``; ``float()`` takes ``1e3``, ``nan`` and ``inf``. A value one
reader takes and the next (torchrun, a rank, the Gaudi bridge) refuses or reads otherwise
fails late, so every reader of the package goes through this module, which takes only what
all of them read the same way, and within bounds. A value with more than :data:`MAX_DIGITS`
digits is out of every range before it is converted (``int()`` refuses strings of over
4300 digits, ``float()`` turns long ones into ``inf``).

An empty environment variable means "not set" to every reader (the caller's default), as
in torchrun; an empty option value is not a number.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from fractions import Fraction

from .errors import ConfigError, echo

#: ASCII digits, as a pattern to build forms of several numbers from (torchrun's ``MIN:MAX``)
DIGITS = "[0-9]+"
#: a number by the rule, as a pattern (sizes put a unit after it)
DECIMAL = r"[0-9]+(?:\.[0-9]+)?"
_WHOLE = re.compile(DIGITS + r"\Z")
_DECIMAL = re.compile(DECIMAL + r"\Z")
#: digits a number may have before and after its point: past every bound a setting has (2**63 has 19)
MAX_DIGITS = 24


def _too_long(text: str) -> bool:
    whole, _, fraction = text.partition(".")
    return len(whole.lstrip("0")) > MAX_DIGITS or len(fraction) > MAX_DIGITS


def exact(text: str) -> Fraction | None:
    """``text`` as an exact number when it is one by the rule (sizes: ``0.1KB`` is 100 bytes, not 100.00000000000001),
    else None."""
    return Fraction(text) if _DECIMAL.match(text) and not _too_long(text) else None


def whole(text: str, low: int, high: int) -> int | None:
    """``text`` as a whole number from ``low`` to ``high`` (both included), or None when it is not one by the rule."""
    if not _WHOLE.match(text) or _too_long(text):
        return None
    value = int(text)
    return value if low <= value <= high else None


def decimal(text: str, low: float, high: float) -> float | None:
    """``text`` as a number from ``low`` to ``high`` (both included; a point allowed), or None when it is not one by
    the rule."""
    value = exact(text)
    return float(value) if value is not None and low <= value <= high else None


def whole_number(name: str, text: str, low: int, high: int) -> int:
    """``text`` as a whole number from ``low`` to ``high``; ConfigError naming ``name`` (the option or variable the
    value came by) otherwise."""
    value = whole(text, low, high)
    if value is None:
        raise ConfigError(f"{name}={echo(text)} must be a whole number from {low} to {high}")
    return value


def number(name: str, text: str, *, fraction: bool = False) -> float:
    """``text`` by the rule (``fraction``: a point allowed) for commands whose model checks the bounds itself (the
    simulator's); ConfigError naming ``name`` otherwise."""
    value = decimal(text, 0, math.inf) if fraction else whole(text, 0, 10**MAX_DIGITS)
    if value is None:
        kind = "a number (ASCII digits, a point allowed)" if fraction else "a whole number (ASCII digits)"
        raise ConfigError(f"{name}={echo(text)} is not {kind}")
    return value


def argument_type(name: str, *, fraction: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` reading option ``name`` by :func:`number`: a value that is none is argparse's one line."""

    def read(text: str) -> float:
        try:
            return number(name, text, fraction=fraction)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read
