"""RMSProp as ``torch.optim.RMSprop`` (Hinton's lecture 6e; Graves 2013 for ``centered``).

Math (torch docs' algorithm box): ``g += wd * p``; ``v = alpha * v + (1 - alpha) * g * g``;
centered: ``ga = lerp(ga, g, 1 - alpha)`` and ``avg = sqrt(v - ga * ga) + eps``, else
``avg = sqrt(v) + eps`` (eps outside the sqrt, unlike optax); with momentum
``b = momentum * b + g / avg`` and ``p -= lr * b``, else ``p -= lr * g / avg``.

torch has no fused RMSProp kernel, so the fast path is a sequence of ``torch._foreach_*``
passes over cache-sized batches of leaves (see ``base.CACHE_BATCH_BYTES``); without donation
the first pass of each buffer writes a fresh tensor instead of updating in place.
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
)
from minitrain.tree import Params

__all__ = ["RMSpropState", "rmsprop"]


class RMSpropState(NamedTuple):
    """``count``, last ``lr``, ``square_avg``; ``momentum_buffer`` and ``grad_avg`` or ``()``."""

    count: Tensor
    lr: Tensor
    square_avg: Params
    momentum_buffer: Params
    grad_avg: Params


def rmsprop(
    lr: ScalarOrSchedule = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float | Tensor = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """RMSProp with ``torch.optim.RMSprop``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.rmsprop(lr=0.01, alpha=0.0, eps=0.0)
    >>> params = {"w": torch.tensor([1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([4.0])}, state, params)
    >>> params["w"]  # alpha=0: v = g * g, so the step is lr * sign(g)
    tensor([0.9900])
    """
    check_hyperparameter("alpha", alpha, 0.0, 1.0)
    check_hyperparameter("eps", eps, 0.0)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    check_hyperparameter("momentum", momentum, 0.0)
    has_momentum = not (isinstance(momentum, int | float) and momentum == 0)
    buffers = ("square_avg",) + (("momentum_buffer",) if has_momentum else ()) + (
        ("grad_avg",) if centered else ()
    )

    def plain_step(p, g, buffers, step, lr, weight_decay):
        g = g + weight_decay * p
        square_avg = alpha * buffers["square_avg"] + (1 - alpha) * (g * g)
        new = {"square_avg": square_avg}
        if centered:
            new["grad_avg"] = torch.lerp(buffers["grad_avg"], g, 1 - alpha)
            avg = (square_avg - new["grad_avg"] * new["grad_avg"]).sqrt() + eps
        else:
            avg = square_avg.sqrt() + eps
        if has_momentum:
            new["momentum_buffer"] = momentum * buffers["momentum_buffer"] + g / avg
            return p - lr * new["momentum_buffer"], new
        return p - lr * (g / avg), new

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        state = [buffers.get(name) for name in ("square_avg", "momentum_buffer", "grad_avg")]
        if streaming.usable([*ps, *gs, *sum(filter(None, state), [])]):
            hyperparameters = [lr, alpha, eps, weight_decay, momentum, centered, has_momentum]
            new_ps, *new_state = streaming.update(
                "rmsprop", hyperparameters, [ps, gs, *state], outputs
            )
            names = ("square_avg", "momentum_buffer", "grad_avg")
            return new_ps, {n: t for n, t in zip(names, new_state, strict=True) if t is not None}
        if weight_decay != 0:
            gs = torch._foreach_add(gs, ps, alpha=weight_decay)
        square_avg = _apply(torch.mul, buffers["square_avg"], (alpha,), {}, outputs)
        torch._foreach_addcmul_(square_avg, gs, gs, value=1 - alpha)
        new = {"square_avg": square_avg}
        if centered:
            grad_avg = _apply(torch.lerp, buffers["grad_avg"], (gs, 1 - alpha), {}, outputs)
            new["grad_avg"] = grad_avg
            avg = torch._foreach_addcmul(square_avg, grad_avg, grad_avg, value=-1)
            torch._foreach_sqrt_(avg)
        else:
            avg = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(avg, eps)
        if has_momentum:
            buf = _apply(torch.mul, buffers["momentum_buffer"], (momentum,), {}, outputs)
            torch._foreach_addcdiv_(buf, gs, avg)
            new["momentum_buffer"] = buf
            return _apply(torch.add, ps, (buf,), {"alpha": -lr}, outputs), new
        return _apply(torch.addcdiv, ps, (gs, avg), {"value": -lr}, outputs), new

    rule = Rule(
        buffers=buffers,
        init_buffer=lambda name, p: torch.zeros_like(p, memory_format=torch.preserve_format),
        plain_step=plain_step,
        fast_step=fast_step,
        fused=False,
    )
    return make_optimizer(RMSpropState, rule, lr, weight_decay, mask, impl, (alpha, momentum))


def _apply(op, tensors, args, kwargs, outputs):
    """``op(t, *args_i, **kwargs)`` for each tensor: in place when donating (``outputs`` None),
    else written into fresh buffers with ``out=`` (one pass, no copy)."""
    targets = tensors if outputs is None else outputs(tensors)
    for index, (t, target) in enumerate(zip(tensors, targets, strict=True)):
        leaf_args = [a[index] if isinstance(a, list | tuple) else a for a in args]
        op(t, *leaf_args, **kwargs, out=target)
    return targets
