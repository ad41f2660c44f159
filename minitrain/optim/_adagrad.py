"""AdaGrad as ``torch.optim.Adagrad`` (Duchi et al. 2011; torch docs' algorithm box).

Math: ``g += wd * p``; ``clr = lr / (1 + (t - 1) * lr_decay)``; ``sum += g * g``;
``p -= clr * g / (sqrt(sum) + eps)``. The accumulator starts at ``initial_accumulator_value``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from minitrain.optim import streaming
from minitrain.optim.base import (
    Optimizer,
    Rule,
    ScalarOrSchedule,
    WeightDecayMask,
    check_hyperparameter,
    make_optimizer,
    owned,
    step_tensors,
)
from minitrain.tree import Params

__all__ = ["AdagradState", "adagrad"]


class AdagradState(NamedTuple):
    """``count`` updates done, the last ``lr``, and ``sum`` of squared gradients per leaf."""

    count: Tensor
    lr: Tensor
    sum: Params


def adagrad(
    lr: ScalarOrSchedule = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float | Tensor = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """AdaGrad with ``torch.optim.Adagrad``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adagrad(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([3.0, -0.5])}, state, params)
    >>> params["w"]  # each coordinate moves by lr on the first step
    tensor([0.9000, 1.1000])
    """
    check_hyperparameter("lr_decay", lr_decay, 0.0)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    check_hyperparameter("initial_accumulator_value", initial_accumulator_value, 0.0)
    check_hyperparameter("eps", eps, 0.0)

    def plain_step(p, g, buffers, step, lr, weight_decay):
        g = g + weight_decay * p
        clr = lr / (1 + (step - 1) * lr_decay)
        total = buffers["sum"] + g * g
        std = total.sqrt() + eps
        return p - clr * (g / std), {"sum": total}

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        if streaming.usable([*ps, *gs, *buffers["sum"]]):
            hyperparameters = [lr / (1 + (step - 1) * lr_decay), weight_decay, eps]
            slots = [ps, gs, buffers["sum"]]
            new_ps, sums = streaming.update("adagrad", hyperparameters, slots, outputs)
            return new_ps, {"sum": sums}
        ps, sums = owned(ps, outputs), owned(buffers["sum"], outputs)
        torch._fused_adagrad_(
            ps, gs, sums, step_tensors(step, ps), lr=lr, lr_decay=float(lr_decay),
            weight_decay=weight_decay, eps=float(eps), maximize=False,
        )
        return ps, {"sum": sums}

    def init_buffer(name: str, p: Tensor) -> Tensor:
        return torch.full_like(
            p, initial_accumulator_value, memory_format=torch.preserve_format
        )

    rule = Rule(("sum",), init_buffer, plain_step, fast_step)
    return make_optimizer(AdagradState, rule, lr, weight_decay, mask, impl)
