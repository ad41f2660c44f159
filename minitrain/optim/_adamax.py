"""Adamax (Kingma & Ba 2015, section 7.1), as torch.optim.Adamax computes it."""

from __future__ import annotations

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
)
from minitrain.optim._host import lerp_weight
from minitrain.optim.base import Optimizer, ScalarOrSchedule
from minitrain.tree import Params

__all__ = ["adamax", "scale_by_adamax", "ScaleByAdamaxState"]


class ScaleByAdamaxState(NamedTuple):
    """``count``, ``exp_avg`` (first moment) and ``exp_inf`` (decayed infinity norm)."""

    count: Tensor
    exp_avg: Params
    exp_inf: Params


def adamax_leaf(g, buffers, p, step, beta1, beta2, eps):
    """Kingma & Ba 2015, Algorithm 2, with torch's eps inside the max:
    ``u = max(beta2 * u, |g| + eps)``; the step is ``m / u / (1 - beta1^t)``."""
    exp_avg = torch.lerp(buffers["exp_avg"], g, lerp_weight(1 - beta1, buffers["exp_avg"]))
    exp_inf = torch.maximum(beta2 * buffers["exp_inf"], g.abs() + eps)
    bias_correction = 1 - beta1**step
    return exp_avg / exp_inf / bias_correction, {"exp_avg": exp_avg, "exp_inf": exp_inf}




def _rule(b1: Any, b2: Any, eps: Any) -> Rule:
    return moments_rule("scale_by_adamax", ScaleByAdamaxState, adamax_leaf, b1, b2, eps)


def scale_by_adamax(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8):
    """Adamax's step (before ``-lr``).

    >>> import torch
    >>> tx = scale_by_adamax()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1., -1.])]
    """
    return rule_transform(_rule(b1, b2, eps))


def adamax(lr: ScalarOrSchedule = 2e-3, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
           weight_decay: Any = 0.0, *, maximize: bool = False,
           mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.Adamax: L2 weight decay, then Adamax's step, times ``-lr``.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adamax(lr=0.1)
    >>> params = {"w": torch.tensor([1.0])}
    >>> params, state = opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.9000])
    """
    b1, b2 = check_pair("betas", betas)
    return family_optimizer(_rule(b1, b2, eps), lr, maximize=maximize,
                            weight_decay=weight_decay, mask=mask)
