"""Learning-rate schedules: pure functions ``step -> lr`` of the number of updates done.

Each takes a Python int or a 0-d integer tensor (under ``vmap`` / ``torch.compile``; computed in
float64 with torch ops only) and answers in kind. ``linear_warmup_schedule`` and
``cosine_schedule`` follow optax; the rest equal the ``torch.optim.lr_scheduler`` of the same
arguments stepped once per update (``init_value`` is the optimizer's lr there), by torch's
closed forms (``_get_closed_form_lr``), to rounding."""

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

__all__ = [
    "constant_schedule", "linear_warmup_schedule", "cosine_schedule",
    "warmup_cosine_decay_schedule", "exponential_decay",
    "step_schedule", "multistep_schedule", "cosine_annealing_schedule",
    "cosine_warm_restarts_schedule", "linear_schedule", "polynomial_schedule",
    "constant_factor_schedule", "one_cycle_schedule", "cyclic_schedule", "sequential_schedule",
]

Value = float | Tensor
"""A real hyperparameter of a schedule: a float or a 0-d tensor (swept, or differentiated)."""


def constant_schedule(value: float) -> Schedule:
    """The same lr at every step.

    >>> constant_schedule(0.1)(1000)
    0.1
    """
    check_hyperparameter("value", value, 0.0)
    return lambda step: value


def linear_warmup_schedule(peak_value: float, warmup_steps: int,
                           init_value: float = 0.0) -> Schedule:
    """Linear ramp from ``init_value`` to ``peak_value`` over ``warmup_steps``, then constant.

    >>> schedule = linear_warmup_schedule(1.0, warmup_steps=4)
    >>> [schedule(step) for step in range(6)]
    [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _check_values(peak_value=peak_value, init_value=init_value)
    warmup_steps = _check_step(warmup_steps, "warmup_steps", 0)
    return _tensor_friendly(lambda step: _warmup(step, peak_value, warmup_steps, init_value))


def cosine_schedule(peak_value: float, decay_steps: int, warmup_steps: int = 0,
                    init_value: float = 0.0, end_value: float = 0.0,
                    exponent: float = 1.0) -> Schedule:
    """Linear warmup to ``peak_value``, then cosine decay (Loshchilov & Hutter 2017, eq. 5),
    raised to ``exponent``, to ``end_value`` at ``decay_steps``, warmup included.

    >>> schedule = cosine_schedule(1.0, decay_steps=10, warmup_steps=2)
    >>> [round(schedule(step), 3) for step in (0, 1, 2, 6, 10, 20)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _check_values(peak_value=peak_value, init_value=init_value)
    warmup_steps = _check_step(warmup_steps, "warmup_steps", 0)
    check_hyperparameter("end_value", end_value, 0.0)
    if decay_steps <= warmup_steps:
        raise ValueError(f"invalid decay_steps={decay_steps}: it must exceed "
                         f"warmup_steps={warmup_steps}")

    def schedule(step: Any) -> Any:
        progress = _clip((step - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
        cosine = 0.5 * (1 + _cos(math.pi * progress))
        decayed = end_value + (peak_value - end_value) * cosine**exponent
        warm = _warmup(step, peak_value, warmup_steps, init_value)
        return _where(step < warmup_steps, warm, decayed)

    return _tensor_friendly(schedule)


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """optax's name and argument order for :func:`cosine_schedule`.

    >>> schedule = warmup_cosine_decay_schedule(0.0, 1.0, 2, 10, exponent=2.0)
    >>> [round(schedule(step), 3) for step in (0, 1, 2, 6, 10)]
    [0.0, 0.5, 1.0, 0.25, 0.0]
    """
    return cosine_schedule(peak_value, decay_steps, warmup_steps, init_value, end_value, exponent)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:
    """optax ``exponential_decay``: ``init_value * decay_rate ** ((t - transition_begin) /
    transition_steps)`` after ``transition_begin`` (the exponent floored with ``staircase``),
    bounded by ``end_value``; a constant ``init_value`` where ``transition_steps <= 0`` or
    ``decay_rate == 0``, as in optax.

    >>> schedule = exponential_decay(1.0, transition_steps=2, decay_rate=0.5, end_value=0.3)
    >>> [round(schedule(step), 4) for step in range(5)]
    [1.0, 0.7071, 0.5, 0.3536, 0.3]
    """
    if transition_steps <= 0 or decay_rate == 0:
        return _tensor_friendly(lambda t: init_value)
    begin = max(transition_begin, 0)

    def schedule(t: Any) -> Any:
        exponent = (t - begin) / transition_steps
        value = _where(t - begin <= 0, init_value,
                       init_value * decay_rate ** (_floor(exponent) if staircase else exponent))
        if end_value is None:
            return value
        return _clip(value, end_value, math.inf) if decay_rate < 1 else \
            _clip(value, -math.inf, end_value)

    return _tensor_friendly(schedule)


def step_schedule(init_value: Value, step_size: int, gamma: Value = 0.1) -> Schedule:
    """Multiply the lr by ``gamma`` every ``step_size`` steps (``torch.optim.lr_scheduler.StepLR``;
    ``step_size=1`` is ``ExponentialLR``).

    >>> schedule = step_schedule(1.0, step_size=2, gamma=0.5)
    >>> [schedule(step) for step in range(5)]
    [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    _check_values(init_value=init_value, gamma=gamma)
    step_size = _check_step(step_size, "step_size", 1)
    # torch StepLR._get_closed_form_lr
    return _tensor_friendly(lambda t: _decay(init_value, gamma, t // step_size))


def multistep_schedule(init_value: Value, milestones: Sequence[int],
                       gamma: Value = 0.1) -> Schedule:
    """Multiply the lr by ``gamma`` at each milestone, twice at one listed twice
    (``torch.optim.lr_scheduler.MultiStepLR``).

    >>> schedule = multistep_schedule(1.0, milestones=[2, 4], gamma=0.5)
    >>> [schedule(step) for step in range(6)]
    [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    """
    _check_values(init_value=init_value, gamma=gamma)
    bounds = sorted(_check_steps("milestones", milestones))
    # torch MultiStepLR._get_closed_form_lr: base_lr * gamma ** bisect_right(milestones, epoch)
    return _tensor_friendly(lambda t: _decay(init_value, gamma, _passed(t, bounds)))


def cosine_annealing_schedule(init_value: Value, T_max: int, eta_min: Value = 0.0) -> Schedule:
    """Cosine from ``init_value`` down to ``eta_min`` over ``T_max`` steps, then up again
    (``CosineAnnealingLR``; SGDR, Loshchilov & Hutter 2017, eq. 5, no restarts).

    >>> schedule = cosine_annealing_schedule(1.0, T_max=4)
    >>> [round(schedule(step), 4) for step in range(9)]
    [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.1464, 0.5, 0.8536, 1.0]
    """
    _check_values(init_value=init_value, eta_min=eta_min)
    T_max = _check_step(T_max, "T_max", 1)
    # torch CosineAnnealingLR._get_closed_form_lr
    return _tensor_friendly(lambda t: eta_min + (init_value - eta_min)
                            * (1 + _cos(math.pi * t / T_max)) / 2)


def cosine_warm_restarts_schedule(init_value: Value, T_0: int, T_mult: int = 1,
                                  eta_min: Value = 0.0) -> Schedule:
    """Cosine annealing restarted after ``T_0``, then ``T_0 * T_mult``, ... steps
    (``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``; SGDR, Loshchilov & Hutter 2017).

    >>> schedule = cosine_warm_restarts_schedule(1.0, T_0=2, T_mult=2)
    >>> [schedule(step) for step in range(7)]
    [1.0, 0.5, 1.0, 0.8535533905932737, 0.5, 0.14644660940672627, 1.0]
    """
    _check_values(init_value=init_value, eta_min=eta_min)
    T_0 = _check_step(T_0, "T_0", 1)
    T_mult = _check_step(T_mult, "T_mult", 1)

    def start(n: Any) -> Any:  # the first step of restart n (torch's step(epoch))
        return T_0 * (T_mult**n - 1) / (T_mult - 1)

    def schedule(t: Any) -> Any:
        if T_mult == 1:  # T_cur, steps since the last restart, and T_i, the length of this cycle
            t_cur, t_i = t % T_0, T_0
        else:  # the logarithm can land one off at a boundary, so n is corrected both ways
            n = _floor(_log(t / T_0 * (T_mult - 1) + 1) / math.log(T_mult))
            n = _where(t < start(n), n - 1, n)
            n = _where(t >= start(n + 1), n + 1, n)
            t_cur, t_i = t - start(n), T_0 * T_mult**n
        # torch CosineAnnealingWarmRestarts.get_lr
        return eta_min + (init_value - eta_min) * (1 + _cos(math.pi * t_cur / t_i)) / 2

    return _tensor_friendly(schedule)


def linear_schedule(init_value: Value, start_factor: Value = 1.0 / 3, end_factor: Value = 1.0,
                    total_iters: int = 5) -> Schedule:
    """``init_value`` times a factor going linearly from ``start_factor`` to ``end_factor`` over
    ``total_iters`` steps, then constant (``torch.optim.lr_scheduler.LinearLR``).

    >>> schedule = linear_schedule(1.0, start_factor=0.25, total_iters=3)
    >>> [schedule(step) for step in range(5)]
    [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    check_hyperparameter("init_value", init_value, 0.0)
    check_hyperparameter("start_factor", start_factor, 0.0, 1.0, low_open=True)
    check_hyperparameter("end_factor", end_factor, 0.0, 1.0)
    total_iters = _check_step(total_iters, "total_iters", 1)
    # torch LinearLR._get_closed_form_lr
    return _tensor_friendly(lambda t: init_value * (
        start_factor + (end_factor - start_factor) * _clip(t, 0, total_iters) / total_iters))


def polynomial_schedule(init_value: Value, total_iters: int = 5, power: Value = 1.0) -> Schedule:
    """``init_value * (1 - step / total_iters) ** power``, then 0
    (``torch.optim.lr_scheduler.PolynomialLR``).

    >>> schedule = polynomial_schedule(1.0, total_iters=4, power=2.0)
    >>> [schedule(step) for step in range(6)]
    [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    """
    _check_values(init_value=init_value, power=power)
    total_iters = _check_step(total_iters, "total_iters", 1)
    # torch PolynomialLR._get_closed_form_lr
    return _tensor_friendly(lambda t: init_value * (1.0 - _clip(t, 0, total_iters) / total_iters)
                            ** power)


def constant_factor_schedule(init_value: Value, factor: Value = 1.0 / 3,
                             total_iters: int = 5) -> Schedule:
    """``init_value * factor`` for ``total_iters >= 1`` steps, then ``init_value``
    (``torch.optim.lr_scheduler.ConstantLR``).

    >>> schedule = constant_factor_schedule(1.0, factor=0.5, total_iters=2)
    >>> [schedule(step) for step in range(4)]
    [0.5, 0.5, 1.0, 1.0]
    """
    check_hyperparameter("init_value", init_value, 0.0)
    check_hyperparameter("factor", factor, 0.0, 1.0, low_open=True)
    total_iters = _check_step(total_iters, "total_iters", 1)
    # torch ConstantLR._get_closed_form_lr
    return _tensor_friendly(lambda t: _where(t >= total_iters, init_value, init_value * factor))


def one_cycle_schedule(max_lr: Value, total_steps: int, pct_start: float = 0.3,
                       anneal_strategy: str = "cos", div_factor: Value = 25.0,
                       final_div_factor: Value = 1e4, three_phase: bool = False) -> Schedule:
    """The 1cycle policy (Smith & Topin 2019), the lr of ``OneCycleLR``: up from ``max_lr /
    div_factor`` to ``max_lr`` over ``pct_start * total_steps`` steps, then down to ``max_lr /
    div_factor / final_div_factor``. An int step past ``total_steps`` raises, as in torch.

    >>> schedule = one_cycle_schedule(1.0, total_steps=5, pct_start=0.4, anneal_strategy="linear",
    ...                               div_factor=10.0, final_div_factor=1.0)
    >>> [round(schedule(step), 4) for step in range(5)]
    [0.1, 1.0, 0.7, 0.4, 0.1]
    """
    check_hyperparameter("max_lr", max_lr, 0.0)
    total_steps = _check_step(total_steps, "total_steps", 1)
    check_hyperparameter("pct_start", pct_start, 0.0, 1.0)
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(f"invalid anneal_strategy={anneal_strategy!r}: choose 'cos' or 'linear'")
    check_hyperparameter("div_factor", div_factor, 0.0, low_open=True)
    check_hyperparameter("final_div_factor", final_div_factor, 0.0, low_open=True)
    if not isinstance(three_phase, bool):
        raise ValueError(f"invalid three_phase={three_phase!r}: pass True or False")
    initial_lr = max_lr / div_factor
    min_lr = initial_lr / final_div_factor
    # torch OneCycleLR.__init__: (end_step, start lr, end lr) per phase
    up = (float(pct_start * total_steps) - 1, initial_lr, max_lr)
    phases = ([up, (float(2 * pct_start * total_steps) - 2, max_lr, initial_lr),
               (total_steps - 1, initial_lr, min_lr)] if three_phase
              else [up, (total_steps - 1, max_lr, min_lr)])
    starts = [0.0] + [end for end, _, _ in phases[:-1]]
    if any(end == start for (end, _, _), start in zip(phases, starts, strict=True)):
        raise ValueError(f"invalid pct_start={pct_start!r}: with total_steps={total_steps} a "
                         "phase has no steps (torch's OneCycleLR divides by zero); pick another "
                         "pct_start")

    def phase_value(t: Any, index: int) -> Any:  # torch OneCycleLR._annealing_*
        end_step, start, end = phases[index]
        pct = (t - starts[index]) / (end_step - starts[index])
        if anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (_cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def schedule(t: Any) -> Any:
        if not isinstance(t, Tensor) and t > total_steps:
            raise ValueError(f"one_cycle_schedule was asked for step {t} past total_steps="
                             f"{total_steps}; build it with total_steps at least the number "
                             "of updates")
        value = phase_value(t, len(phases) - 1)
        for index in reversed(range(len(phases) - 1)):  # torch takes the first phase that fits
            value = _where(t <= phases[index][0], phase_value(t, index), value)
        return value

    return _tensor_friendly(schedule)


def cyclic_schedule(base_lr: Value, max_lr: Value, step_size_up: int = 2000,
                    step_size_down: int | None = None, mode: str = "triangular",
                    gamma: Value = 1.0, scale_fn: Callable[[Any], Any] | None = None,
                    scale_mode: str = "cycle") -> Schedule:
    """Cyclical learning rates (Smith 2017), the lr of ``CyclicLR``: triangles between
    ``base_lr`` and ``max_lr``, their height scaled by ``mode`` or ``scale_fn``.

    >>> schedule = cyclic_schedule(0.0, 1.0, step_size_up=2, mode="triangular2")
    >>> [schedule(step) for step in range(9)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.25, 0.5, 0.25, 0.0]
    """
    _check_values(base_lr=base_lr, max_lr=max_lr, gamma=gamma)
    step_size_up = _check_step(step_size_up, "step_size_up", 1)
    down = step_size_up if step_size_down is None else step_size_down
    down = _check_step(down, "step_size_down", 0)
    if scale_fn is not None and not callable(scale_fn):
        raise ValueError(f"invalid scale_fn={scale_fn!r}: pass a function of the cycle or step")
    # torch CyclicLR._init_scale_fn: the modes set their own scale_mode. torch's triangular2
    # is 1 / (2.0 ** (x - 1)), the same powers of two, but it overflows (raises) after 1025
    # cycles where this one underflows to 0.
    modes = {"triangular": ((lambda x: 1.0), "cycle"),
             "triangular2": ((lambda x: 0.5 ** (x - 1)), "cycle"),
             "exp_range": ((lambda x: gamma**x), "iterations")}
    if scale_fn is None:
        if mode not in modes:
            raise ValueError(f"invalid mode={mode!r}: choose 'triangular', 'triangular2' or "
                             "'exp_range', or pass scale_fn")
        scale_fn, scale_mode = modes[mode]
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

    >>> warmup = linear_schedule(1.0, start_factor=0.5, total_iters=2)
    >>> decay = step_schedule(1.0, 1, gamma=0.5)
    >>> schedule = sequential_schedule([warmup, decay], milestones=[3])
    >>> [schedule(step) for step in range(6)]
    [0.5, 0.75, 1.0, 1.0, 0.5, 0.25]
    """
    schedules = list(schedules) if isinstance(schedules, Iterable) else []
    bounds = _check_steps("milestones", milestones)
    if not schedules or not all(callable(s) for s in schedules):
        raise ValueError("sequential_schedule needs a non-empty list of schedules (step -> lr)")
    if len(bounds) != len(schedules) - 1:
        raise ValueError(f"sequential_schedule got {len(schedules)} schedules and {len(bounds)} "
                         "milestones; pass one milestone fewer than schedules")
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


# -- one formula for int and 0-d tensor steps, and the checks of a schedule's arguments ----


def _tensor_friendly(formula: Callable[[Any], Any]) -> Schedule:
    """A schedule from ``formula(t)``: ``t`` a Python int, or a float64 tensor for a tensor step
    (integer math stays exact in float64 below 2**53)."""

    def schedule(step: Any) -> Any:
        if isinstance(step, Tensor):
            _check_step_dtype(step)
            return _float64(formula(step.to(torch.float64)), step)
        return formula(_check_step(step))

    return schedule


def _check_step(value: Any, name: str = "step", low: int = 0) -> int:
    """``value`` as an int >= ``low`` (a step: a number of updates), refused unless it is a
    ``numbers.Integral`` other than bool."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low:
        return int(value)
    raise ValueError(f"invalid {name}={value!r}: pass an int >= {low}")


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


def _check_values(**values: Any) -> None:
    for name, value in values.items():
        check_hyperparameter(name, value, 0.0)


def _check_steps(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, str | bytes | Tensor) or not isinstance(values, Iterable):
        raise ValueError(f"invalid {name}={values!r}: pass a list of ints >= 0")
    return [_check_step(value, name) for value in values]


def _warmup(step: Any, peak_value: float, warmup_steps: int, init_value: float) -> Any:
    if warmup_steps == 0:
        return peak_value
    fraction = _clip(step / warmup_steps, 0.0, 1.0)
    return init_value + (peak_value - init_value) * fraction


def _either(number_op: Callable[..., Any], tensor_op: Callable[..., Any]) -> Callable[..., Any]:
    """One function of a Python number or a tensor (its first argument)."""
    return lambda x, *args: tensor_op(x, *args) if isinstance(x, Tensor) else number_op(x, *args)


_clip = _either(lambda value, low, high: min(max(value, low), high), torch.clamp)
_cos = _either(math.cos, torch.cos)
_floor = _either(math.floor, torch.floor)
_log = _either(math.log, torch.log)


def _where(condition: Any, a: Any, b: Any) -> Any:
    if isinstance(condition, Tensor):
        if not isinstance(a, Tensor) and not isinstance(b, Tensor):
            a = _float64(a, condition)  # two Python numbers would give float32
        return torch.where(condition, a, b)
    return a if condition else b
