"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import WeightDecayMask, check_pair
from minitrain.optim._family import (
    Rule,
    Scalar,
    check_betas,
    family_optimizer,
    rule_transform,
    zeros,
)
from minitrain.optim._host import lerp_weight
from minitrain.optim.base import Optimizer, ScalarOrSchedule
from minitrain.tree import Params

__all__ = ["lion", "scale_by_lion", "ScaleByLionState"]


class ScaleByLionState(NamedTuple):
    """``count`` and ``exp_avg``, Lion's single momentum buffer (as lion-pytorch names it)."""

    count: Tensor
    exp_avg: Params


def lion_leaf(g, buffers, p, step, beta1, beta2):
    """Chen et al. 2023, Algorithm 2: the step is ``sign(beta1 m + (1 - beta1) g)``; then
    ``m <- beta2 m + (1 - beta2) g``."""
    m = buffers["exp_avg"]
    return (torch.sign(torch.lerp(m, g, lerp_weight(1 - beta1, m))),
            {"exp_avg": torch.lerp(m, g, lerp_weight(1 - beta2, m))})


def _rule(b1: Any, b2: Any) -> Rule:
    beta1, beta2 = check_betas((b1, b2), high_open=False)
    return Rule("scale_by_lion", ScaleByLionState, lambda p: {"exp_avg": zeros(p)}, lion_leaf,
                dict(beta1=beta1, beta2=beta2))




def scale_by_lion(b1: Scalar = 0.9, b2: Scalar = 0.99):
    """Lion's sign step (before weight decay and ``-lr``).

    >>> import torch
    >>> tx = scale_by_lion()
    >>> tx.update([torch.tensor([3.0, -0.5, 0.0])], tx.init([torch.zeros(3)]))[0]
    [tensor([ 1., -1.,  0.])]
    """
    return rule_transform(_rule(b1, b2))


def lion(lr: ScalarOrSchedule = 1e-4, betas: tuple[Any, Any] = (0.9, 0.99),
         weight_decay: Any = 0.0, *, maximize: bool = False,
         mask: WeightDecayMask = None) -> Optimizer:
    """Lion with decoupled weight decay: ``p <- p - lr (sign(...) + wd p)`` (lion-pytorch's
    ``Lion`` defaults; its ``decoupled_weight_decay=True`` is ``weight_decay=wd / lr``).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.lion(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> params, state = opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.9000, 1.1000])
    """
    b1, b2 = check_pair("betas", betas)
    return family_optimizer(_rule(b1, b2), lr, maximize=maximize, weight_decay=weight_decay,
                            mask=mask, decoupled=True)
