"""Learning-rate schedules: pure functions ``step -> lr`` of the number of updates done.

Each schedule accepts a Python int (the fast path, logging) or a 0-d integer tensor (the plain
path under ``vmap`` / ``torch.compile``) and answers in kind. Shapes follow optax's
``linear_schedule``, ``warmup_cosine_decay_schedule`` and torch's ``StepLR``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from minitrain.optim.base import Schedule, check_hyperparameter

__all__ = ["constant_schedule", "linear_warmup_schedule", "cosine_schedule", "step_schedule"]


def constant_schedule(value: float) -> Schedule:
    """The same lr at every step.

    >>> constant_schedule(0.1)(1000)
    0.1
    """
    check_hyperparameter("value", value, 0.0)
    return lambda step: value


def linear_warmup_schedule(
    peak_value: float, warmup_steps: int, init_value: float = 0.0
) -> Schedule:
    """Linear ramp from ``init_value`` to ``peak_value`` over ``warmup_steps``, then constant.

    >>> schedule = linear_warmup_schedule(1.0, warmup_steps=4)
    >>> [schedule(step) for step in range(6)]
    [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _check_common(peak_value, warmup_steps, init_value)

    def schedule(step: Any) -> Any:
        return _warmup(step, peak_value, warmup_steps, init_value)

    return schedule


def cosine_schedule(
    peak_value: float,
    decay_steps: int,
    warmup_steps: int = 0,
    init_value: float = 0.0,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warmup to ``peak_value``, then cosine decay to ``end_value`` at ``decay_steps``.

    ``decay_steps`` counts the warmup too (optax ``warmup_cosine_decay_schedule``); after it,
    the lr stays at ``end_value``. Cosine annealing: Loshchilov & Hutter 2017, eq. 5.

    >>> schedule = cosine_schedule(1.0, decay_steps=10, warmup_steps=2)
    >>> [round(schedule(step), 3) for step in (0, 1, 2, 6, 10, 20)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _check_common(peak_value, warmup_steps, init_value)
    check_hyperparameter("end_value", end_value, 0.0)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"invalid decay_steps={decay_steps}: it must exceed warmup_steps={warmup_steps}"
        )

    def schedule(step: Any) -> Any:
        progress = _clip((step - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
        cosine = 0.5 * (1 + _cos(math.pi * progress))
        decayed = end_value + (peak_value - end_value) * cosine
        if warmup_steps == 0:
            return decayed
        warm = _warmup(step, peak_value, warmup_steps, init_value)
        return _where(step < warmup_steps, warm, decayed)

    return schedule


def step_schedule(init_value: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """Multiply the lr by ``gamma`` every ``step_size`` steps (``torch.optim.lr_scheduler.StepLR``).

    >>> schedule = step_schedule(1.0, step_size=2, gamma=0.5)
    >>> [schedule(step) for step in range(5)]
    [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    check_hyperparameter("init_value", init_value, 0.0)
    check_hyperparameter("gamma", gamma, 0.0)
    if step_size < 1:
        raise ValueError(f"invalid step_size={step_size}: it must be at least 1")
    return lambda step: init_value * gamma ** (step // step_size)


def _check_common(peak_value: float, warmup_steps: int, init_value: float) -> None:
    check_hyperparameter("peak_value", peak_value, 0.0)
    check_hyperparameter("init_value", init_value, 0.0)
    if warmup_steps < 0:
        raise ValueError(f"invalid warmup_steps={warmup_steps}: it must be 0 or more")


def _warmup(step: Any, peak_value: float, warmup_steps: int, init_value: float) -> Any:
    if warmup_steps == 0:
        return peak_value if not isinstance(step, Tensor) else torch.full_like(
            step, peak_value, dtype=torch.float32
        )
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
        return torch.where(condition, a, b)
    return a if condition else b
