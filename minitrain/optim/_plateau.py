"""Reduce the learning rate when a metric stops improving, as a gradient transformation.

:func:`reduce_on_plateau` equals ``torch.optim.lr_scheduler.ReduceLROnPlateau`` (its ``step``
method, line for line, with ``torch.where`` for each ``if`` so that nothing waits on the host
and the update runs under ``vmap`` and ``torch.compile``). It is a transformation fed the metric:
``update(updates, state, params=None, *, value)`` first takes ``value`` as torch's
``scheduler.step(value)`` does, then scales ``updates`` by ``lr / initial lr`` with the lr that
results; ``value=None`` (no new metric, e.g. between evaluations) scales by the current lr and
leaves the state as it is. Apply it after ``scale_by_learning_rate`` (or after any transformation
whose updates carry the lr). A torch loop steps the scheduler after the optimizer, so its update
``t`` uses the metrics before ``t``: pass ``value=None`` on the first update and the previous
metric after that to take the same steps.

The updates must be tensors (a number leaf is refused: pass ``torch.tensor(x)``). A
floating-point or complex update keeps its dtype; an integer or bool update is promoted as
``int_tensor * 0.5`` is in torch (and as optax's ``tree_scale`` promotes in JAX), to the default
float dtype, since a scaled step does not fit in an integer. A hand-edited state may hold
numbers, other dtypes or one-element tensors: each field is read as init returns it (float64
``lr`` and ``best``, int64 counters, 0-d), so that its steps are torch's.
"""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import check_hyperparameter, floating_updates, hyperparameter
from minitrain.optim.base import GradientTransformation
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


def reduce_on_plateau(
    lr: float | Tensor = 1.0,
    mode: str = "min",
    factor: float | Tensor = 0.1,
    patience: int | np.integer = 10,
    threshold: float | Tensor = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int | np.integer = 0,
    min_lr: float | Tensor = 0.0,
    eps: float | Tensor = 1e-8,
) -> GradientTransformation:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau`` as a transformation fed the metric.

    ``lr`` is the starting lr (the optimizer's, in torch): ``min_lr`` and ``eps`` are in its
    units and the updates are scaled by ``state.lr / lr``, so with the default ``lr=1.0`` the
    scale is the lr factor itself. The other arguments are torch's, with its defaults: after
    more than ``patience`` metrics without an improvement (by ``threshold``, relative or
    absolute) the lr is multiplied by ``factor`` (not below ``min_lr``; a change smaller than
    ``eps`` is skipped), then ``cooldown`` metrics are ignored. A float argument may be a
    one-element tensor, ``patience`` and ``cooldown`` numpy integers, as torch takes them.

    >>> import torch
    >>> tx = reduce_on_plateau(lr=0.1, factor=0.5, patience=1)
    >>> grads = {"w": torch.ones(1)}
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
    # one-element tensors as 0-d, so that the state stays 0-d
    lr, factor, threshold, min_lr, eps = (
        hyperparameter(name, value) for name, value in (
            ("lr", lr), ("factor", factor), ("threshold", threshold), ("min_lr", min_lr),
            ("eps", eps)))
    check_hyperparameter("lr", lr, 0.0, low_open=True, high_open=True)
    check_hyperparameter("factor", factor, 0.0, 1.0, high_open=True)
    check_hyperparameter("threshold", threshold, 0.0)
    check_hyperparameter("min_lr", min_lr, 0.0)
    check_hyperparameter("eps", eps, 0.0)
    patience, cooldown = _count("patience", patience), _count("cooldown", cooldown)
    worst = math.inf if mode == "min" else -math.inf  # torch _init_is_better: mode_worse

    def init(params: Params) -> ReduceLROnPlateauState:
        leaves = _tensor_leaves(params, "params")
        device = leaves[0].device if leaves else None

        def scalar(value: Any, dtype: torch.dtype) -> Tensor:
            return torch.as_tensor(value, dtype=dtype, device=device)

        zero = scalar(0, torch.int64)
        return ReduceLROnPlateauState(
            scalar(lr, torch.float64), scalar(worst, torch.float64), zero, zero, zero
        )

    def update(
        updates: Any, state: ReduceLROnPlateauState, params: Params | None = None, *,
        value: Any = None,
    ) -> tuple[Any, ReduceLROnPlateauState]:
        if not isinstance(state, ReduceLROnPlateauState):
            raise ValueError(
                f"reduce_on_plateau got a state of {type(state).__name__}; pass the state "
                "returned by its init(params)"
            )
        _tensor_leaves(updates, "updates")
        state = _coerced(state)
        if value is None:  # no new metric: scale by the current lr
            return _scaled(updates, state.lr / lr), state
        current = _metric(value, state.best)
        better = _is_better(current, state.best, mode, threshold_mode, threshold)
        new_state = _step(state, current, better, patience, cooldown, factor, min_lr, eps)
        return _scaled(updates, new_state.lr / lr), new_state

    return GradientTransformation(init, update)


def _count(name: str, value: Any) -> int:
    """``patience`` or ``cooldown`` as an int (a numpy integer too, as torch takes it)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"invalid {name}={value!r}: it must be an int >= 0")
    return int(value)


def _tensor_leaves(values: Any, what: str) -> list[Tensor]:
    """The leaves of ``values``, refused with the first leaf's name unless all are tensors."""
    leaves = tree.leaves(values)
    if all(isinstance(leaf, Tensor) for leaf in leaves):
        return leaves
    name, leaf = next((n, v) for n, v in tree.named_leaves(values) if not isinstance(v, Tensor))
    raise ValueError(
        f"reduce_on_plateau {what} leaf {name!r} is {type(leaf).__name__}; pass a tree of "
        "tensors (e.g. torch.tensor(2.0) for a number)"
    )


def _scaled(updates: Any, scale: Tensor) -> Any:
    """``updates * scale`` leaf by leaf, integer and bool leaves promoted first as every
    transformation promotes them (:func:`~minitrain.optim._checks.floating_updates`: to the
    default float dtype, torch's ``int_tensor * 0.5``)."""
    floating = floating_updates("reduce_on_plateau", updates)
    return tree.map(lambda u: u * scale.to(u.dtype), floating)


def _coerced(state: ReduceLROnPlateauState) -> ReduceLROnPlateauState:
    """``state`` with each field a 0-d tensor of init's dtype (float64 ``lr`` and ``best``,
    int64 counters) on the device of its first tensor field."""
    device = next((field.device for field in state if isinstance(field, Tensor)), None)
    return ReduceLROnPlateauState(*(
        _field(name, value, name in ("lr", "best"), device)
        for name, value in zip(state._fields, state, strict=True)
    ))


def _field(name: str, value: Any, real: bool, device: torch.device | None) -> Tensor:
    """One state field as a 0-d float64 (``real``) or int64 tensor; refused when it is not a
    real number (``real``) or an integer, or has more than one element."""
    dtype = torch.float64 if real else torch.int64
    if isinstance(value, Tensor):
        ok = value.numel() == 1 and value.dtype != torch.bool and not value.is_complex() and (
            real or not value.is_floating_point())
        kind = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    else:
        ok = not isinstance(value, bool) and isinstance(
            value, numbers.Real if real else numbers.Integral)
        kind = type(value).__name__
    if not ok:
        number = "a real number" if real else "an integer"
        raise ValueError(
            f"reduce_on_plateau state.{name} is {kind}; pass {number} or a one-element tensor "
            f"of one, as init returns ({dtype}, 0-d)"
        )
    if not isinstance(value, Tensor):
        return torch.tensor(value, dtype=dtype, device=device)
    return (value.reshape(()) if value.dim() else value).to(dtype)


def _metric(value: Any, like: Tensor) -> Tensor:
    """The metric as a float64 0-d tensor on the state's device (torch takes ``float(metrics)``:
    a number, a 0-d numpy array, a one-element tensor; the metric is not differentiated
    through)."""
    if isinstance(value, np.ndarray):
        if value.ndim:
            raise ValueError(
                f"reduce_on_plateau value is an array of shape {value.shape}; pass one number "
                "(e.g. the mean validation loss)"
            )
        value = value[()]
    if isinstance(value, Tensor):
        return _tensor_metric(value).to(dtype=torch.float64, device=like.device)
    if isinstance(value, bool) or not isinstance(value, numbers.Real | decimal.Decimal):
        raise ValueError(
            f"reduce_on_plateau value is {type(value).__name__}; pass a float or 0-d tensor"
        )
    try:
        number = float(value)
    except (OverflowError, ValueError) as error:
        raise ValueError(
            f"reduce_on_plateau value of type {type(value).__name__} is no float ({error}); "
            "pass a float"
        ) from None
    return torch.tensor(number, dtype=torch.float64, device=like.device)


def _tensor_metric(value: Tensor) -> Tensor:
    """A one-element real tensor metric, detached, 0-d and dense."""
    if value.numel() != 1:
        raise ValueError(
            f"reduce_on_plateau value has shape {tuple(value.shape)}; pass one number "
            "(e.g. the mean validation loss)"
        )
    if value.is_complex() or value.dtype == torch.bool or value.is_meta:
        raise ValueError(
            f"reduce_on_plateau value is a {value.dtype} tensor on {value.device}; pass a "
            "real number"
        )
    if value.layout != torch.strided:
        value = value.to_dense()
    return value.detach().reshape(())


def _is_better(a: Tensor, best: Tensor, mode: str, threshold_mode: str, threshold: Any) -> Tensor:
    """torch's ``ReduceLROnPlateau._is_better``."""
    if mode == "min" and threshold_mode == "rel":
        return a < best * (1.0 - threshold)
    if mode == "min":
        return a < best - threshold
    if threshold_mode == "rel":
        return a > best * (threshold + 1.0)
    return a > best + threshold


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
