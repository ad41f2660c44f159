"""RAdam (Liu et al. 2020), as torch.optim.RAdam computes it, in both weight-decay modes."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import WeightDecayMask, check_pair
from minitrain.optim._family import (
    Rule,
    Scalar,
    family_optimizer,
    moments_rule,
    rule_transform,
    second_moment,
)
from minitrain.optim._host import lerp_weight
from minitrain.optim.base import Optimizer, ScalarOrSchedule
from minitrain.tree import Params

__all__ = ["radam", "scale_by_radam", "ScaleByRadamState"]


class ScaleByRadamState(NamedTuple):
    """``count``, ``exp_avg`` and ``exp_avg_sq``, like torch.optim.RAdam's state."""

    count: Tensor
    exp_avg: Params
    exp_avg_sq: Params


def _sqrt(value: Any) -> Any:
    return value.sqrt() if isinstance(value, Tensor) else math.sqrt(value)


def radam_leaf(g, buffers, p, step, beta1, beta2, eps):
    """Liu et al. 2020, Algorithm 2 (torch's ``_single_tensor_radam``): while the length of
    the approximated SMA ``rho_t`` is at most 5 the step is the bias-corrected momentum;
    after, it is rectified by ``r_t`` and divided by ``sqrt(v_t) + eps`` (before ``-lr``)."""
    exp_avg = torch.lerp(buffers["exp_avg"], g, lerp_weight(1 - beta1, buffers["exp_avg"]))
    exp_avg_sq = second_moment(buffers["exp_avg_sq"], g, beta2)
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2**step / bias_correction2
    traced = isinstance(rho_t, Tensor)
    if not traced and rho_t <= 5.0:
        return exp_avg / bias_correction1, new
    # The clamp only keeps the (unused) early branch of torch.where finite under tracing.
    safe_rho = rho_t.clamp(min=5.0) if traced else rho_t
    rect = _sqrt((safe_rho - 4) * (safe_rho - 2) * rho_inf
                 / ((rho_inf - 4) * (rho_inf - 2) * safe_rho))
    # m_t / (1 - b1^t) * r_t * sqrt(1 - b2^t) / (sqrt(v_t) + eps) with the scalars folded into
    # one factor: four passes over the leaf instead of seven.
    factor = rect * _sqrt(bias_correction2) / bias_correction1
    rectified = exp_avg * factor / (exp_avg_sq.sqrt() + eps)
    if traced:
        return torch.where(rho_t > 5.0, rectified, exp_avg / bias_correction1), new
    return rectified, new




def _rule(b1: Any, b2: Any, eps: Any) -> Rule:
    return moments_rule("scale_by_radam", ScaleByRadamState, radam_leaf, b1, b2, eps)


def scale_by_radam(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8):
    """RAdam's step (before ``-lr``): the first steps are plain momentum (SGD-like).

    >>> import torch
    >>> tx = scale_by_radam()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 3.0000, -0.5000])]
    """
    return rule_transform(_rule(b1, b2, eps))


def radam(lr: ScalarOrSchedule = 1e-3, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
          weight_decay: Any = 0.0, decoupled_weight_decay: bool = False, *,
          maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.RAdam: L2 decay before the step, or decoupled decay (``p -= lr * wd * p``).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.radam(lr=0.1)
    >>> params = {"w": torch.tensor([1.0])}
    >>> params, state = opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.8000])
    """
    b1, b2 = check_pair("betas", betas)
    return family_optimizer(_rule(b1, b2, eps), lr, maximize=maximize, weight_decay=weight_decay,
                            mask=mask, decoupled=bool(decoupled_weight_decay))
