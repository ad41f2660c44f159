"""``torch.optim.lr_scheduler.ReduceLROnPlateau`` as a gradient transformation fed the metric."""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import (
    check_state_type,
    checked,
    floating_updates,
    one_lr,
    tensor_leaves,
)
from minitrain.optim.base import GradientTransformation
from minitrain.optim.schedules import _check_step
from minitrain.tree import Params

__all__ = ["ReduceLROnPlateauState", "reduce_on_plateau"]


class ReduceLROnPlateauState(NamedTuple):
    """The scheduler's counters, as 0-d tensors: ``lr`` (float64, torch's ``group["lr"]``),
    ``best`` (float64), ``num_bad_epochs``, ``cooldown_counter`` and ``count`` (metrics seen,
    torch's ``last_epoch``), int64."""

    lr: Tensor
    best: Tensor
    num_bad_epochs: Tensor
    cooldown_counter: Tensor
    count: Tensor


def reduce_on_plateau(lr: float | Tensor = 1.0, mode: str = "min", factor: float | Tensor = 0.1,
                      patience: int | np.integer = 10, threshold: float | Tensor = 1e-4,
                      threshold_mode: str = "rel", cooldown: int | np.integer = 0,
                      min_lr: float | Tensor = 0.0,
                      eps: float | Tensor = 1e-8) -> GradientTransformation:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau`` (its arguments and defaults):
    ``update(updates, state, params=None, *, value)`` steps it as ``scheduler.step(value)``
    (each ``if`` a ``torch.where``: it runs under ``vmap`` and ``torch.compile``) and scales
    ``updates`` by ``state.lr / lr`` (``lr``: the optimizer's starting lr); ``value=None`` keeps
    the state. Apply it after ``scale_by_learning_rate``; to take a torch loop's steps
    (scheduler after optimizer), pass ``value=None`` first and the previous metric after that.

    >>> tx, grads = reduce_on_plateau(lr=0.1, factor=0.5, patience=1), {"w": torch.ones(1)}
    >>> state = tx.init(grads)
    >>> for loss in [1.0, 0.5, 0.6, 0.7, 0.8]:
    ...     updates, state = tx.update(grads, state, value=loss)
    >>> float(state.lr), updates["w"]
    (0.05, tensor([0.5000]))
    """
    if mode not in ("min", "max"):
        raise ValueError(f"invalid mode={mode!r}: choose 'min' or 'max'")
    if threshold_mode not in ("rel", "abs"):
        raise ValueError(f"invalid threshold_mode={threshold_mode!r}: choose 'rel' or 'abs'")
    lr = checked("lr", one_lr(lr), 0.0, low_open=True, high_open=True)  # one element: 0-d
    factor = checked("factor", factor, 0.0, 1.0, high_open=True)
    threshold, min_lr = checked("threshold", threshold, 0.0), checked("min_lr", min_lr, 0.0)
    eps = checked("eps", eps, 0.0)
    patience, cooldown = _check_step(patience, "patience"), _check_step(cooldown, "cooldown")
    worst = math.inf if mode == "min" else -math.inf  # torch _init_is_better: mode_worse

    def init(params: Params) -> ReduceLROnPlateauState:
        leaves = tensor_leaves("reduce_on_plateau", params, "params leaf")
        device = leaves[0].device if leaves else None
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return ReduceLROnPlateauState(torch.as_tensor(lr, dtype=torch.float64, device=device),
                                      torch.tensor(worst, dtype=torch.float64, device=device),
                                      zero, zero, zero)

    def update(updates: Any, state: ReduceLROnPlateauState, params: Params | None = None, *,
               value: Any = None) -> tuple[Any, ReduceLROnPlateauState]:
        state = _checked(state)
        floating = floating_updates("reduce_on_plateau", updates)  # tensor leaves, named if not
        if value is not None:  # a new metric: torch's step
            current = _metric(value, state.best)
            better = _is_better(current, state.best, mode, threshold_mode, threshold)
            state = _step(state, current, better, patience, cooldown, factor, min_lr, eps)
        scale = state.lr / lr  # integer and bool updates promoted first, as int_tensor * 0.5
        return tree.map(lambda u: u * scale.to(u.dtype), floating), state

    return GradientTransformation(init, update)


def _checked(state: Any) -> ReduceLROnPlateauState:
    """``state``, refused in one line unless its fields are what init makes: 0-d tensors,
    float64 ``lr`` and ``best``, int64 counters."""
    check_state_type("reduce_on_plateau", ReduceLROnPlateauState, state)
    for name, value in zip(state._fields, state, strict=True):
        real = name in ("lr", "best")
        dtype = torch.float64 if real else torch.int64
        if not isinstance(value, Tensor) or value.dtype != dtype or value.dim():
            kind = f"a {value.dtype} tensor of shape {tuple(value.shape)}" \
                if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"reduce_on_plateau state.{name} is {kind}; pass "
                             f"{'a real number' if real else 'an integer'} as a 0-d {dtype} "
                             f"tensor, as init returns")
    return state


def _metric(value: Any, like: Tensor) -> Tensor:
    """The metric as a float64 0-d tensor on the state's device: whatever torch's
    ``float(metrics)`` takes (a number, a 0-d array, a one-element tensor), detached."""
    if isinstance(value, np.ndarray) and value.ndim or isinstance(value, Tensor) and \
            value.numel() != 1:  # torch's float() takes a one-element tensor, a 0-d array
        raise ValueError(f"reduce_on_plateau value has shape {tuple(value.shape)}; pass one "
                         "number (e.g. the mean validation loss)")
    if isinstance(value, Tensor):
        if value.is_complex() or value.dtype == torch.bool or value.is_meta:
            raise ValueError(f"reduce_on_plateau value is a {value.dtype} tensor on "
                             f"{value.device}; pass a real number")
        value = value.to_dense() if value.layout != torch.strided else value
        return value.detach().reshape(()).to(dtype=torch.float64, device=like.device)
    if isinstance(value, np.ndarray):
        value = value[()]
    if isinstance(value, bool) or not isinstance(value, numbers.Real | decimal.Decimal):
        raise ValueError(f"reduce_on_plateau value is {type(value).__name__}; pass a float or "
                         f"0-d tensor")
    try:
        number = float(value)
    except (OverflowError, ValueError) as error:
        raise ValueError(f"reduce_on_plateau value of type {type(value).__name__} is no float "
                         f"({error}); pass a float") from None
    return torch.tensor(number, dtype=torch.float64, device=like.device)


def _is_better(a: Tensor, best: Tensor, mode: str, threshold_mode: str, threshold: Any) -> Tensor:
    """torch's ``ReduceLROnPlateau._is_better``."""
    if threshold_mode == "rel":
        bound = best * (1.0 - threshold) if mode == "min" else best * (threshold + 1.0)
    else:
        bound = best - threshold if mode == "min" else best + threshold
    return a < bound if mode == "min" else a > bound


def _step(state: ReduceLROnPlateauState, current: Tensor, better: Tensor, patience: int,
          cooldown: int, factor: Any, min_lr: Any, eps: Any) -> ReduceLROnPlateauState:
    """torch's ``ReduceLROnPlateau.step`` and ``_reduce_lr``, each ``if`` a ``torch.where``."""
    best = torch.where(better, current, state.best)
    bad = torch.where(better, 0, state.num_bad_epochs + 1)
    in_cooldown = state.cooldown_counter > 0
    cooldown_counter = torch.where(in_cooldown, state.cooldown_counter - 1, state.cooldown_counter)
    bad = torch.where(in_cooldown, 0, bad)
    reduce = bad > patience
    new_lr = torch.clamp(state.lr * factor, min=min_lr)
    lr_now = torch.where(reduce & (state.lr - new_lr > eps), new_lr, state.lr)
    cooldown_counter = torch.where(reduce, cooldown, cooldown_counter)
    bad = torch.where(reduce, 0, bad)
    return ReduceLROnPlateauState(lr_now, best, bad, cooldown_counter, state.count + 1)
