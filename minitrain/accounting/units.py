"""Numbers as napkin math writes them: SI prefixes and significant figures. Pure Python.

>>> si(989.4e12, "FLOP/s"), si(2.5e-6, "s"), si(12, "B"), si(None)
('989.4 TFLOP/s', '2.5 µs', '12 B', '-')
"""

from __future__ import annotations

import math
import re

from minitrain.errors import UserError

__all__ = ["Number", "SECONDS_PER_DAY", "check_numbers", "parse_number", "round_significant", "si"]

Number = int | float
SECONDS_PER_DAY = 86_400

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_BELOW_ONE_SECOND = ((1e-3, "m"), (1e-6, "µ"), (1e-9, "n"), (1e-12, "p"))
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12, "p": 10**15}
_NUMBER = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)([kmbgtp]?)", re.IGNORECASE)


def check_numbers(positive: bool = False, **values: Number) -> None:
    """A :class:`~minitrain.errors.UserError` naming the first of ``values`` that is not a
    finite number ``>= 0`` (``> 0`` when ``positive``)."""
    for name, value in values.items():
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            kind = "positive" if positive else "non-negative"
            raise UserError(f"{name} must be a {kind} finite number, got {value!r}")


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


def parse_number(text: str, name: str, *, whole: bool = False, low: Number | None = None,
                 high: Number | None = None) -> Number:
    """A number typed on the command line, as napkin math writes it (``70e9``, ``70B``,
    ``1.5k``, ``1_000``): finite, an int when ``whole``, at least ``low`` and at most ``high``;
    else a ``ValueError`` naming ``name`` (if given) and what to write.

    >>> parse_number("70B", "--params"), parse_number("1e3", "--seed", whole=True)
    (70000000000.0, 1000)
    >>> parse_number("inf", "--set lr")
    Traceback (most recent call last):
    ...
    ValueError: --set lr: 'inf' is not a finite number; write e.g. 0.01, 1e-3, 1.5k or 70B
    """
    where = f"{name}: {text!r}" if name else repr(text)
    match = _NUMBER.fullmatch(str(text).strip().replace("_", ""))
    if match is None:
        raise ValueError(f"{where} is not a finite number; write e.g. 0.01, 1e-3, 1.5k or 70B")
    digits, scale = match.group(1), _SUFFIXES[match.group(2).lower()]
    if whole and re.fullmatch(r"[+-]?\d+", digits):
        value: Number = int(digits) * scale  # exact, however many digits
    else:
        value = float(digits) * scale
        if not math.isfinite(value):
            raise ValueError(f"{where} is too large for a finite number")
        if whole and not value.is_integer():
            raise ValueError(f"{where} is not a whole number")
        value = int(value) if whole else value
    if low is not None and value < low:
        raise ValueError(f"{where} must be at least {low}")
    if high is not None and value > high:
        raise ValueError(f"{where} must be at most {high}")
    return value
