"""Cyclic and composite learning-rate schedules: ``torch.optim.lr_scheduler``'s ``OneCycleLR``,
``CyclicLR`` and ``SequentialLR``, value for value (see :mod:`minitrain.optim.schedules`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain.optim._checks import check_hyperparameter
from minitrain.optim.base import Schedule
from minitrain.optim.schedules import (
    Value,
    _check_count,
    _check_step,
    _check_step_dtype,
    _check_steps,
    _check_value,
    _cos,
    _float64,
    _floor,
    _tensor_friendly,
    _where,
)

__all__ = ["one_cycle_schedule", "cyclic_schedule", "sequential_schedule"]


def one_cycle_schedule(
    max_lr: Value,
    total_steps: int,
    pct_start: float = 0.3,
    anneal_strategy: str = "cos",
    div_factor: Value = 25.0,
    final_div_factor: Value = 1e4,
    three_phase: bool = False,
) -> Schedule:
    """The 1cycle policy (Smith & Topin 2019) as ``torch.optim.lr_scheduler.OneCycleLR``.

    From ``max_lr / div_factor`` up to ``max_lr`` over ``pct_start * total_steps`` steps, then
    down to ``max_lr / div_factor / final_div_factor`` (``three_phase``: back down to the start
    first, symmetrically, then to the minimum). ``anneal_strategy`` is ``"cos"`` or
    ``"linear"``. Only the lr: torch's momentum cycling is not part of a schedule. Like torch, a
    step past ``total_steps`` raises (tensor steps extrapolate the last phase instead), and so
    does a ``pct_start`` that leaves a phase without steps (torch divides by zero there).

    >>> schedule = one_cycle_schedule(1.0, total_steps=5, pct_start=0.4, anneal_strategy="linear",
    ...                               div_factor=10.0, final_div_factor=1.0)
    >>> [round(schedule(step), 4) for step in range(5)]
    [0.1, 1.0, 0.7, 0.4, 0.1]
    """
    _check_value("max_lr", max_lr)
    _check_count("total_steps", total_steps, 1)
    check_hyperparameter("pct_start", pct_start, 0.0, 1.0)
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(
            f"invalid anneal_strategy={anneal_strategy!r}: choose 'cos' or 'linear'"
        )
    _check_value("div_factor", div_factor, 0.0, low_open=True)
    _check_value("final_div_factor", final_div_factor, 0.0, low_open=True)
    if not isinstance(three_phase, bool):
        raise ValueError(f"invalid three_phase={three_phase!r}: pass True or False")
    initial_lr = max_lr / div_factor
    min_lr = initial_lr / final_div_factor
    # torch OneCycleLR.__init__: (end_step, start lr, end lr) per phase
    if three_phase:
        phases = [
            (float(pct_start * total_steps) - 1, initial_lr, max_lr),
            (float(2 * pct_start * total_steps) - 2, max_lr, initial_lr),
            (total_steps - 1, initial_lr, min_lr),
        ]
    else:
        phases = [
            (float(pct_start * total_steps) - 1, initial_lr, max_lr),
            (total_steps - 1, max_lr, min_lr),
        ]
    starts = [0.0] + [end for end, _, _ in phases[:-1]]
    if any(end == start for (end, _, _), start in zip(phases, starts, strict=True)):
        raise ValueError(
            f"invalid pct_start={pct_start!r}: with total_steps={total_steps} a phase has no "
            "steps (torch's OneCycleLR divides by zero); pick another pct_start"
        )

    def anneal(start: Any, end: Any, pct: Any) -> Any:  # torch OneCycleLR._annealing_*
        if anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (_cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def phase_value(t: Any, index: int) -> Any:
        end_step, start_lr, end_lr = phases[index]
        return anneal(start_lr, end_lr, (t - starts[index]) / (end_step - starts[index]))

    def schedule(t: Any) -> Any:
        if not isinstance(t, Tensor):
            if t > total_steps:
                raise ValueError(
                    f"one_cycle_schedule was asked for step {t} past total_steps={total_steps}; "
                    "build it with total_steps at least the number of updates"
                )
            index = next(i for i, (end, _, _) in enumerate(phases) if t <= end or
                         i == len(phases) - 1)
            return phase_value(t, index)
        value = phase_value(t, len(phases) - 1)
        for index in reversed(range(len(phases) - 1)):  # torch takes the first phase that fits
            value = torch.where(t <= phases[index][0], phase_value(t, index), value)
        return value

    return _tensor_friendly(schedule)


def cyclic_schedule(
    base_lr: Value,
    max_lr: Value,
    step_size_up: int = 2000,
    step_size_down: int | None = None,
    mode: str = "triangular",
    gamma: Value = 1.0,
    scale_fn: Callable[[Any], Any] | None = None,
    scale_mode: str = "cycle",
) -> Schedule:
    """Cyclical learning rates (Smith 2017) as ``torch.optim.lr_scheduler.CyclicLR``.

    Triangles between ``base_lr`` and ``max_lr``: up over ``step_size_up`` steps, down over
    ``step_size_down`` (default: the same). ``mode`` scales the amplitude: ``"triangular"``
    (never), ``"triangular2"`` (halved each cycle), ``"exp_range"`` (``gamma ** step``); a
    ``scale_fn`` of the cycle number (``scale_mode="cycle"``) or of the step
    (``"iterations"``) replaces the mode. Only the lr: torch's momentum cycling is not part of a
    schedule.

    >>> schedule = cyclic_schedule(0.0, 1.0, step_size_up=2, mode="triangular2")
    >>> [schedule(step) for step in range(9)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.25, 0.5, 0.25, 0.0]
    """
    _check_value("base_lr", base_lr)
    _check_value("max_lr", max_lr)
    _check_value("gamma", gamma)
    _check_count("step_size_up", step_size_up, 1)
    down = step_size_up if step_size_down is None else step_size_down
    _check_count("step_size_down", down, 0)
    if scale_fn is not None and not callable(scale_fn):
        raise ValueError(f"invalid scale_fn={scale_fn!r}: pass a function of the cycle or step")
    if scale_fn is None:
        # torch CyclicLR._init_scale_fn: the modes set their own scale_mode
        if mode == "triangular":
            scale_fn, scale_mode = (lambda x: 1.0), "cycle"
        elif mode == "triangular2":
            # torch: 1 / (2.0 ** (x - 1)), the same powers of two, but it overflows (raises)
            # after 1025 cycles where this one underflows to 0.
            scale_fn, scale_mode = (lambda x: 0.5 ** (x - 1)), "cycle"
        elif mode == "exp_range":
            scale_fn, scale_mode = (lambda x: gamma**x), "iterations"
        else:
            raise ValueError(
                f"invalid mode={mode!r}: choose 'triangular', 'triangular2' or 'exp_range', "
                "or pass scale_fn"
            )
    if scale_mode not in ("cycle", "iterations"):
        raise ValueError(f"invalid scale_mode={scale_mode!r}: choose 'cycle' or 'iterations'")
    total_size = float(step_size_up) + float(down)
    step_ratio = step_size_up / total_size
    # With step_size_down=0 the falling half is never taken; its denominator must not be 0.
    fall = step_ratio - 1 if step_ratio != 1 else -1.0

    def schedule(t: Any) -> Any:
        # torch CyclicLR.get_lr
        cycle = _floor(1 + t / total_size)
        x = 1.0 + t / total_size - cycle
        scale_factor = _where(x <= step_ratio, x / step_ratio, (x - 1) / fall)
        base_height = (max_lr - base_lr) * scale_factor
        return base_lr + base_height * scale_fn(cycle if scale_mode == "cycle" else t)

    return _tensor_friendly(schedule)


def sequential_schedule(schedules: Sequence[Schedule], milestones: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``milestones[i - 1]`` on, restarted at step 0 there
    (``torch.optim.lr_scheduler.SequentialLR``).

    >>> from minitrain.optim import exponential_schedule, linear_schedule
    >>> warmup = linear_schedule(1.0, start_factor=0.5, total_iters=2)
    >>> decay = exponential_schedule(1.0, gamma=0.5)
    >>> schedule = sequential_schedule([warmup, decay], milestones=[3])
    >>> [schedule(step) for step in range(6)]
    [0.5, 0.75, 1.0, 1.0, 0.5, 0.25]
    """
    schedules = list(schedules) if isinstance(schedules, Iterable) else []
    bounds = _check_steps("milestones", milestones)
    if not schedules or not all(callable(s) for s in schedules):
        raise ValueError("sequential_schedule needs a non-empty list of schedules (step -> lr)")
    if len(bounds) != len(schedules) - 1:
        raise ValueError(
            f"sequential_schedule got {len(schedules)} schedules and {len(bounds)} milestones; "
            "pass one milestone fewer than schedules"
        )
    if bounds != sorted(bounds):
        raise ValueError(f"invalid milestones={bounds}: list them in increasing order")
    offsets = [0, *bounds]

    def schedule(step: Any) -> Any:
        if not isinstance(step, Tensor):
            step = _check_step(step)
            index = bisect.bisect_right(bounds, step)  # torch SequentialLR.step
            return schedules[index](step - offsets[index])
        _check_step_dtype(step)
        value = _float64(schedules[0](step), step)
        for index in range(1, len(schedules)):
            start = offsets[index]
            later = _float64(schedules[index]((step - start).clamp(min=0)), step)
            value = torch.where(step >= start, later, value)
        return value

    return schedule
