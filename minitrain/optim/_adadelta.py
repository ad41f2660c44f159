"""Adadelta (Zeiler 2012), as torch.optim.Adadelta computes it."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

from minitrain.optim._checks import WeightDecayMask
from minitrain.optim._family import (
    Rule,
    Scalar,
    check_range,
    family_optimizer,
    rule_transform,
    second_moment,
    zeros,
)
from minitrain.optim.base import Optimizer, ScalarOrSchedule
from minitrain.tree import Params

__all__ = ["adadelta", "scale_by_adadelta", "ScaleByAdadeltaState"]


class ScaleByAdadeltaState(NamedTuple):
    """``count``, ``square_avg`` (running E[g²]) and ``acc_delta`` (running E[Δx²])."""

    count: Tensor
    square_avg: Params
    acc_delta: Params


def adadelta_leaf(g, buffers, p, step, rho, eps):
    """Zeiler 2012, Algorithm 1 (torch's ``_single_tensor_adadelta``): the step is
    ``sqrt(E[Δx²] + eps) / sqrt(E[g²] + eps) * g``, before ``-lr``."""
    square_avg = second_moment(buffers["square_avg"], g, rho)
    std = (square_avg + eps).sqrt()
    delta = (buffers["acc_delta"] + eps).sqrt() / std * g
    acc_delta = second_moment(buffers["acc_delta"], delta, rho)
    return delta, {"square_avg": square_avg, "acc_delta": acc_delta}


def _rule(rho: Any, eps: Any) -> Rule:
    rho = check_range("rho", rho, 0.0, 1.0)
    eps = check_range("eps", eps, 0.0)
    init_leaf = lambda p: {"square_avg": zeros(p), "acc_delta": zeros(p)}  # noqa: E731
    return Rule("scale_by_adadelta", ScaleByAdadeltaState, init_leaf, adadelta_leaf,
                dict(rho=rho, eps=eps))




def scale_by_adadelta(rho: Scalar = 0.9, eps: Scalar = 1e-6):
    """Adadelta's per-coordinate step (before ``-lr``).

    >>> import torch
    >>> tx = scale_by_adadelta(rho=0.0, eps=1e-6)
    >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
    [tensor([0.0010])]
    """
    return rule_transform(_rule(rho, eps))


def adadelta(lr: ScalarOrSchedule = 1.0, rho: Scalar = 0.9, eps: Scalar = 1e-6,
             weight_decay: Any = 0.0, *, maximize: bool = False,
             mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.Adadelta: L2 weight decay, then Adadelta's step, times ``-lr``.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adadelta(lr=1.0, rho=0.0)
    >>> params = {"w": torch.tensor([1.0])}
    >>> params, state = opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.9990])
    """
    return family_optimizer(_rule(rho, eps), lr, maximize=maximize, weight_decay=weight_decay,
                            mask=mask)
