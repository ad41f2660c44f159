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
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._core import GradientTransformation
from minitrain.optim.base import check_hyperparameter
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
    lr: float = 1.0,
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int = 0,
    min_lr: float = 0.0,
    eps: float = 1e-8,
) -> GradientTransformation:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau`` as a transformation fed the metric.

    ``lr`` is the starting lr (the optimizer's, in torch): ``min_lr`` and ``eps`` are in its
    units and the updates are scaled by ``state.lr / lr``, so with the default ``lr=1.0`` the
    scale is the lr factor itself. The other arguments are torch's, with its defaults: after
    more than ``patience`` metrics without an improvement (by ``threshold``, relative or
    absolute) the lr is multiplied by ``factor`` (not below ``min_lr``; a change smaller than
    ``eps`` is skipped), then ``cooldown`` metrics are ignored.

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
    check_hyperparameter("lr", lr, 0.0, low_open=True, high_open=True)
    check_hyperparameter("factor", factor, 0.0, 1.0, high_open=True)
    check_hyperparameter("threshold", threshold, 0.0)
    check_hyperparameter("min_lr", min_lr, 0.0)
    check_hyperparameter("eps", eps, 0.0)
    for name, count in (("patience", patience), ("cooldown", cooldown)):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"invalid {name}={count!r}: it must be an int >= 0")
    worst = math.inf if mode == "min" else -math.inf  # torch _init_is_better: mode_worse

    def is_better(a: Tensor, best: Tensor) -> Tensor:  # torch ReduceLROnPlateau._is_better
        if mode == "min" and threshold_mode == "rel":
            return a < best * (1.0 - threshold)
        if mode == "min":
            return a < best - threshold
        if threshold_mode == "rel":
            return a > best * (threshold + 1.0)
        return a > best + threshold

    def init(params: Params) -> ReduceLROnPlateauState:
        leaves = tree.leaves(params)
        device = leaves[0].device if leaves and isinstance(leaves[0], Tensor) else None

        def scalar(value: Any, dtype: torch.dtype) -> Tensor:
            return torch.tensor(value, dtype=dtype, device=device)

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
        if value is None:  # no new metric: scale by the current lr
            return _scaled(updates, state.lr / lr), state
        current = _metric(value, state.best)
        # torch ReduceLROnPlateau.step, each `if` a torch.where
        better = is_better(current, state.best)
        best = torch.where(better, current, state.best)
        bad = torch.where(better, 0, state.num_bad_epochs + 1)
        in_cooldown = state.cooldown_counter > 0
        cooldown_counter = torch.where(in_cooldown, state.cooldown_counter - 1,
                                       state.cooldown_counter)
        bad = torch.where(in_cooldown, 0, bad)
        reduce = bad > patience
        # torch ReduceLROnPlateau._reduce_lr
        new_lr = torch.clamp(state.lr * factor, min=min_lr)
        lr_now = torch.where(reduce & (state.lr - new_lr > eps), new_lr, state.lr)
        cooldown_counter = torch.where(reduce, cooldown, cooldown_counter)
        bad = torch.where(reduce, 0, bad)
        new_state = ReduceLROnPlateauState(lr_now, best, bad, cooldown_counter, state.count + 1)
        return _scaled(updates, lr_now / lr), new_state

    return GradientTransformation(init, update)


def _scaled(updates: Any, scale: Tensor) -> Any:
    return tree.map(lambda u: u * scale.to(u.dtype), updates)


def _metric(value: Any, like: Tensor) -> Tensor:
    """The metric as a float64 0-d tensor on the state's device (torch takes ``float(metrics)``;
    the metric is not differentiated through)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"reduce_on_plateau value has shape {tuple(value.shape)}; pass one number "
                "(e.g. the mean validation loss)"
            )
        if value.is_complex() or value.is_meta:
            raise ValueError(
                f"reduce_on_plateau value is a {value.dtype} tensor on {value.device}; pass a "
                "real number"
            )
        return value.detach().reshape(()).to(dtype=torch.float64, device=like.device)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"reduce_on_plateau value is {type(value).__name__}; pass a float or 0-d tensor"
        )
    return torch.tensor(float(value), dtype=torch.float64, device=like.device)
