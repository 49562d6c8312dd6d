"""Human sizes (``64MB``, ``1.5GiB``, ``4096``) for URLs and CLI options."""

from __future__ import annotations

import re

from .errors import ConfigError, echo
from .quantities import DECIMAL, exact

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
#: a number by the rule of :mod:`recipecache.quantities`, then (after at most one space) a unit
_SIZE = re.compile(f"({DECIMAL})(?: ?([a-zA-Z]+))?\\Z")


def parse_size(text: str) -> int:
    """Bytes in ``text``, a whole number; raises ConfigError with the accepted forms on anything else.

    Computed exactly (``0.1KB`` is 100 bytes), and a number too long for any size is refused
    before it is converted (:mod:`recipecache.quantities`; a float of 400 nines is infinite).
    """
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    number = exact(m.group(1)) if m else None
    if m is None or unit not in _UNITS or number is None:
        raise ConfigError(
            f"bad size {echo(str(text))}: use a number with an optional unit such as 512MB, 10GiB or 1000000"
        )
    value = number * _UNITS[unit]
    if value.denominator != 1:
        raise ConfigError(f"bad size {echo(str(text))}: not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
