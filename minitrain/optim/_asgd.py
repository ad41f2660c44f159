"""Averaged SGD (Polyak & Juditsky 1992; Bottou 2012's step sizes), as torch.optim.ASGD."""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import WeightDecayMask
from minitrain.optim._family import (
    Rule,
    Scalar,
    add_scaled,
    check_range,
    family_optimizer,
    find_state,
    rule_transform,
    zeros,
)
from minitrain.optim._host import host_tensor
from minitrain.optim.base import Optimizer
from minitrain.tree import Params

__all__ = ["asgd", "scale_by_asgd", "ScaleByAsgdState", "asgd_average"]


def float32(value: float) -> float:
    """``value`` rounded to float32, as ``torch.tensor(value, dtype=torch.float32)`` holds it."""
    return array.array("f", (value,))[0]


class ScaleByAsgdState(NamedTuple):
    """``count``, ``lr`` (the step size ``eta`` of the last update, float32 as torch keeps
    it) and ``ax``, the running average of the params (torch's ``ax``)."""

    count: Tensor
    lr: Tensor
    ax: Params


def asgd_step_sizes(step: Any, lr: Any, lambd: Any, alpha: Any, t0: Any) -> tuple[Any, Any]:
    """``(eta_t, mu_t)`` of update ``t``: torch sets them after update ``t - 1`` to
    ``eta = lr / (1 + lambd * lr * (t - 1))^alpha`` and ``mu = 1 / max(1, t - 1 - t0)``
    (both start at ``lr`` and 1), each held in a float32 tensor (``torch.as_tensor``), so
    rounded to float32 whatever the params' dtype.

    >>> asgd_step_sizes(2, 0.1, 1.0, 1.0, 1e6)  # 0.1 / 1.1 in float32, and 1
    (0.09090909361839294, 1.0)
    """
    eta = lr / (1 + lambd * lr * (step - 1)) ** alpha
    if isinstance(step, Tensor):
        mu = torch.where(step == 1, 1.0, 1 / torch.clamp(step - 1 - t0, min=1.0))
        return _rounded(eta), mu.to(torch.float32).to(step.dtype)
    mu = 1.0 if step == 1 else 1 / max(1.0, step - 1 - t0)
    return _rounded(eta), float32(mu)


def _rounded(value: Any) -> Any:
    """``value`` rounded to float32 (a tensor keeps its dtype, a number stays a float)."""
    if isinstance(value, Tensor):
        return value.to(torch.float32).to(value.dtype) if value.is_floating_point() else value
    return float32(value)


def asgd_leaf(g, buffers, p, step, lambd, eta, mu):
    """torch's ``_single_tensor_asgd``: ``p <- p (1 - lambd eta) - eta g``, then the average
    ``ax <- ax + mu (p - ax)`` (a copy while ``mu == 1``). The update is the full step."""
    update = add_scaled(g, p, lambd) * -eta
    new_p = p + update
    ax = buffers["ax"]
    averaged = ax + (new_p - ax) * mu
    if isinstance(mu, Tensor):
        averaged = torch.where(mu == 1, new_p, averaged)
    elif mu == 1:
        averaged = new_p
    return update, {"ax": averaged}


def _rule(lr: Any, lambd: Any, alpha: Any, t0: Any) -> Rule:
    lr_after = _lr_after(lr)
    lambd = check_range("lambd", lambd, 0.0)
    alpha = check_range("alpha", alpha, 0.0)
    t0 = check_range("t0", t0, -float("inf"))

    def advance(step, lr):  # lr: eta of the last update (kept for learning_rate(state))
        # eta_t is set at the end of update t - 1 from the lr of that update, as torch's ASGD
        # does under an LRScheduler (its group lr then is the schedule's value after t - 2).
        done = torch.clamp(step - 2, min=0).to(torch.int64) if isinstance(step, Tensor) \
            else max(step - 2, 0)  # a traced step is a float64 tensor; counts are ints
        eta, mu = asgd_step_sizes(step, lr_after(done), lambd, alpha, t0)
        return {"lr": eta}, {"eta": eta, "mu": mu}

    return Rule("scale_by_asgd", ScaleByAsgdState, lambda p: {"ax": zeros(p)}, asgd_leaf,
                dict(lambd=lambd), scalars={"lr": lambda: _f32(lr_after(0))}, advance=advance,
                needs_params=True,
                state_hyperparams=(lr, alpha, t0))


def _lr_after(lr: Any) -> Callable[[Any], Any]:
    """``done -> lr``: the lr of the update after ``done`` updates, a constant or a schedule's
    value (checked >= 0, as torch's group lr)."""
    if not callable(lr) or isinstance(lr, Tensor):
        constant = check_range("lr", lr, 0.0)
        return lambda done: constant
    return lambda done: check_range("lr (from the schedule)", lr(done), 0.0)




def _f32(value: Any) -> Tensor:
    return host_tensor(value, torch.float32).clone()


def scale_by_asgd(lr: Any = 1e-2, lambd: Scalar = 1e-4,
                  alpha: Scalar = 0.75, t0: Scalar = 1e6):
    """ASGD's whole step ``-eta_t (g + lambd p)``, keeping the average of the params in
    ``ax`` (read it with :func:`asgd_average`). ``lr`` is ``eta``'s start: a number, not a
    schedule.

    >>> import torch
    >>> tx = scale_by_asgd(lr=0.5, lambd=0.0)
    >>> params = [torch.ones(1)]
    >>> updates, state = tx.update([torch.ones(1)], tx.init(params), params)
    >>> updates, state.ax
    ([tensor([-0.5000])], [tensor([0.5000])])
    """
    return rule_transform(_rule(lr, lambd, alpha, t0))


def asgd(lr: Any = 1e-2, lambd: Scalar = 1e-4, alpha: Scalar = 0.75,
         t0: Scalar = 1e6, weight_decay: Any = 0.0, *, maximize: bool = False,
         mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.ASGD: L2 decay, then ASGD's step; the averaged params are
    ``asgd_average(state)``.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.asgd(lr=0.5, lambd=0.0)
    >>> params = {"w": torch.tensor([1.0])}
    >>> params, state = opt.update({"w": torch.tensor([1.0])}, opt.init(params), params)
    >>> params["w"], mt.optim.asgd_average(state)["w"]
    (tensor([0.5000]), tensor([0.5000]))
    """
    return family_optimizer(_rule(lr, lambd, alpha, t0), maximize=maximize,
                            weight_decay=weight_decay, mask=mask)


def asgd_average(state: Any) -> Params:
    """The averaged params ``ax`` held in an ASGD state (also inside a chain's state)."""
    found = find_state(state, ScaleByAsgdState)
    if found is None:
        raise ValueError("asgd_average expects the state of mt.optim.asgd or scale_by_asgd")
    return found.ax
