"""Adam and AdamW as ``torch.optim.Adam`` / ``torch.optim.AdamW`` (Kingma & Ba 2015,
Algorithm 1; Loshchilov & Hutter 2019 for decoupled weight decay; Reddi et al. 2018 for AMSGrad).

Math (torch docs' algorithm box): Adam ``g += wd * p``, AdamW ``p *= 1 - lr * wd``;
``m = lerp(m, g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) * g * g``; AMSGrad keeps
``v_max = max(v_max, v)``; ``p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``.
"""

from __future__ import annotations

import math
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

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """``count``, last ``lr``, ``exp_avg``, ``exp_avg_sq``; ``max_exp_avg_sq`` or ``()``."""

    count: Tensor
    lr: Tensor
    exp_avg: Params
    exp_avg_sq: Params
    max_exp_avg_sq: Params


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | Tensor = 0.0,
    amsgrad: bool = False,
    *,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """Adam with L2 weight decay, with ``torch.optim.Adam``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adam(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([5.0, -0.01])}, state, params)
    >>> params["w"]  # the first step moves each coordinate by about lr
    tensor([0.9000, 1.1000])
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, mask, impl, decoupled=False)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | Tensor = 1e-2,
    amsgrad: bool = False,
    *,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """Adam with decoupled weight decay, with ``torch.optim.AdamW``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adamw(lr=0.1, weight_decay=0.5, mask=lambda name, p: p.ndim >= 2)
    >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
    >>> state = opt.init(params)
    >>> grads = {"w": torch.zeros(1, 1), "b": torch.zeros(1)}
    >>> params, state = opt.update(grads, state, params)
    >>> params["w"].item(), params["b"].item()  # only the matrix decays: 1 - 0.1 * 0.5
    (0.949999988079071, 1.0)
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, mask, impl, decoupled=True)


def _adam(lr, betas, eps, weight_decay, amsgrad, mask, impl, *, decoupled: bool) -> Optimizer:
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"invalid betas={betas!r}: pass a pair (beta1, beta2)")
    beta1, beta2 = betas
    check_hyperparameter("betas[0]", beta1, 0.0, 1.0, high_open=True)
    check_hyperparameter("betas[1]", beta2, 0.0, 1.0, high_open=True)
    check_hyperparameter("eps", eps, 0.0)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    buffers = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())

    def plain_step(p, g, buffers, step, lr, weight_decay):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        exp_avg = torch.lerp(buffers["exp_avg"], g, 1 - beta1)
        exp_avg_sq = beta2 * buffers["exp_avg_sq"] + (1 - beta2) * (g * g)
        new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        second = exp_avg_sq
        if amsgrad:
            second = new["max_exp_avg_sq"] = torch.maximum(buffers["max_exp_avg_sq"], exp_avg_sq)
        bias_correction1, bias_correction2_sqrt = step
        denom = second.sqrt() / bias_correction2_sqrt + eps
        return p - (lr / bias_correction1) * (exp_avg / denom), new

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        if streaming.usable([*ps, *gs, *sum(buffers.values(), [])]):
            bias_correction1, bias_correction2_sqrt = bias_corrections(step)
            hyperparameters = [
                beta1, beta2, eps, weight_decay, lr, lr / bias_correction1, bias_correction2_sqrt,
                decoupled, amsgrad,
            ]
            slots = [ps, gs, buffers["exp_avg"], buffers["exp_avg_sq"],
                     buffers.get("max_exp_avg_sq")]
            new_ps, *new_buffers = streaming.update("adam", hyperparameters, slots, outputs)
            return new_ps, dict(zip(buffers, new_buffers, strict=False))
        ps = owned(ps, outputs)
        new = {name: owned(buffers[name], outputs) for name in buffers}
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(
            ps, gs, new["exp_avg"], new["exp_avg_sq"], new.get("max_exp_avg_sq", []),
            step_tensors(step, ps), lr=lr, beta1=float(beta1), beta2=float(beta2),
            weight_decay=weight_decay, eps=float(eps), amsgrad=amsgrad, maximize=False,
        )
        return ps, new

    def bias_corrections(step):
        return 1 - beta1**step, _sqrt(1 - beta2**step)

    rule = Rule(
        buffers=buffers,
        init_buffer=lambda name, p: torch.zeros_like(p, memory_format=torch.preserve_format),
        plain_step=plain_step,
        fast_step=fast_step,
        step_scalars=bias_corrections,
    )
    return make_optimizer(AdamState, rule, lr, weight_decay, mask, impl, (beta1, beta2))


def _sqrt(value):
    return value.sqrt() if isinstance(value, Tensor) else math.sqrt(value)
