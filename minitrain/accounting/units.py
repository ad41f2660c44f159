"""Numbers as napkin math writes them: SI prefixes and significant figures. Pure Python.

>>> si(989.4e12, "FLOP/s"), si(2.5e-6, "s"), si(12, "B"), si(None)
('989.4 TFLOP/s', '2.5 µs', '12 B', '-')
"""

from __future__ import annotations

import math

__all__ = ["Number", "SECONDS_PER_DAY", "round_significant", "si"]

Number = int | float
SECONDS_PER_DAY = 86_400

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_BELOW_ONE_SECOND = ((1e-3, "m"), (1e-6, "µ"), (1e-9, "n"), (1e-12, "p"))


def si(value: Number | None, unit: str = "", digits: int = 4) -> str:
    """``value`` with a decimal prefix and ``digits`` significant digits (seconds below one in
    ms, µs, ns); None as ``-``.

    >>> si(1.5e9), si(0.25, "s"), si(123456, "B", digits=3)
    ('1.5 G', '250 ms', '123 kB')
    """
    if value is None:
        return "-"
    if not math.isfinite(value) or value == 0:
        return f"{value:g} {unit}".strip()
    scales = _BELOW_ONE_SECOND if unit == "s" and abs(value) < 1 else _PREFIXES
    for scale, prefix in scales:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}".strip()


def round_significant(value: Number, digits: int = 1) -> float:
    """``value`` rounded to ``digits`` significant figures, as napkin math rounds.

    >>> round_significant(5.065728e17)
    5e+17
    """
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))
