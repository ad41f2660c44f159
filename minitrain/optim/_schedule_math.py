"""What every schedule is built from: one formula for Python int and 0-d tensor steps, and the
checks of a schedule's arguments."""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain.optim._checks import check_hyperparameter
from minitrain.optim.base import Schedule


def _tensor_friendly(formula: Callable[[Any], Any]) -> Schedule:
    """A schedule from ``formula(t)``: ``t`` a Python int, or a float64 tensor for a tensor step
    (integer math stays exact in float64 below 2**53)."""

    def schedule(step: Any) -> Any:
        if isinstance(step, Tensor):
            _check_step_dtype(step)
            return _float64(formula(step.to(torch.float64)), step)
        return formula(_check_step(step))

    return schedule


def _check_step(step: Any, name: str = "step") -> int:
    """``step`` as an int: a number of updates, from 0 (``numbers.Integral``, not bool)."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool) and step >= 0:
        return int(step)
    raise ValueError(f"invalid {name}={step!r}: pass a number of updates, an int >= 0")


def _check_step_dtype(step: Tensor) -> None:
    """A tensor step must hold integers (its sign is not read: that would wait on the device)."""
    if step.is_floating_point() or step.is_complex() or step.dtype == torch.bool:
        raise ValueError(f"invalid step of dtype {step.dtype}: pass an integer tensor")


def _decay(init_value: Any, gamma: Any, count: Any) -> Any:
    """``init_value * gamma ** count`` in two halves (the same on int and tensor steps): past
    the float range it is inf, as torch's recursive lr, where a Python ``gamma ** count``
    raises even while the product still fits."""
    half = count // 2
    try:
        return init_value * gamma**half * gamma ** (count - half)
    except OverflowError:  # gamma ** half alone is past the range, so the product is too
        return _where(init_value == 0, 0.0, init_value * math.inf)


def _float64(value: Any, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(torch.float64)
    return torch.full_like(like, value, dtype=torch.float64)


def _passed(t: Any, bounds: list[int]) -> Any:
    """How many of the sorted ``bounds`` are <= ``t`` (``bisect_right``)."""
    if not isinstance(t, Tensor):
        return bisect.bisect_right(bounds, t)
    return sum(((t >= bound).to(torch.float64) for bound in bounds), torch.zeros_like(t))


def _min(value: Any, high: int) -> Any:
    return value.clamp(max=high) if isinstance(value, Tensor) else min(value, high)


def _floor(value: Any) -> Any:
    return torch.floor(value) if isinstance(value, Tensor) else math.floor(value)


def _check_values(**values: Any) -> None:
    for name, value in values.items():
        _check_value(name, value)


def _check_value(name: str, value: Any, low: float = 0.0, high: float = math.inf,
                 *, low_open: bool = False) -> None:
    if isinstance(value, Tensor) and value.numel() != 1:
        raise ValueError(f"invalid {name}: a tensor of shape {tuple(value.shape)}; pass a float "
                         f"or 0-d tensor")
    check_hyperparameter(name, value, low, high, low_open=low_open)


def _check_count(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"invalid {name}={value!r}: it must be an int >= {low}")


def _check_steps(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, str | bytes | Tensor) or not isinstance(values, Iterable):
        raise ValueError(f"invalid {name}={values!r}: pass a list of ints >= 0")
    return [_check_step(value, name) for value in values]


def _check_common(peak_value: float, warmup_steps: int, init_value: float) -> None:
    check_hyperparameter("peak_value", peak_value, 0.0)
    check_hyperparameter("init_value", init_value, 0.0)
    if warmup_steps < 0:
        raise ValueError(f"invalid warmup_steps={warmup_steps}: it must be 0 or more")


def _warmup(step: Any, peak_value: float, warmup_steps: int, init_value: float) -> Any:
    if warmup_steps == 0:
        return peak_value
    fraction = _clip(step / warmup_steps, 0.0, 1.0)
    return init_value + (peak_value - init_value) * fraction


def _clip(value: Any, low: float, high: float) -> Any:
    if isinstance(value, Tensor):
        return value.clamp(low, high)
    return min(max(value, low), high)


def _cos(value: Any) -> Any:
    return torch.cos(value) if isinstance(value, Tensor) else math.cos(value)


def _where(condition: Any, a: Any, b: Any) -> Any:
    if isinstance(condition, Tensor):
        if not isinstance(a, Tensor) and not isinstance(b, Tensor):
            a = _float64(a, condition)  # two Python numbers would give float32
        return torch.where(condition, a, b)
    return a if condition else b
