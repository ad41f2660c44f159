"""SGD with momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

Math (torch.optim.SGD docs, ``_single_tensor_sgd``): ``g += wd * p``; with momentum,
``b = g`` on the first step and ``b = momentum * b + (1 - dampening) * g`` after;
``g = g + momentum * b`` (Nesterov) or ``g = b``; ``p -= lr * g``.
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
)
from minitrain.tree import Params

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """``count`` updates done, the last ``lr``, ``momentum_buffer`` (``()`` without momentum)."""

    count: Tensor
    lr: Tensor
    momentum_buffer: Params


def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float | Tensor = 0.0,
    *,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """Stochastic gradient descent with ``torch.optim.SGD``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.sgd(lr=0.1, momentum=0.9)
    >>> params = {"w": torch.tensor([1.0])}
    >>> state = opt.init(params)
    >>> for _ in range(2):
    ...     params, state = opt.update({"w": torch.tensor([1.0])}, state, params)
    >>> params["w"]  # 1 - 0.1 * 1 - 0.1 * 1.9
    tensor([0.7100])
    """
    check_hyperparameter("momentum", momentum, 0.0)
    check_hyperparameter("dampening", dampening, 0.0)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    if nesterov and (momentum == 0 or dampening != 0):
        raise ValueError(
            "invalid nesterov=True: it requires momentum > 0 and dampening = 0; "
            "set momentum or turn nesterov off"
        )
    has_momentum = not (isinstance(momentum, int | float) and momentum == 0)

    def plain_step(p, g, buffers, step, lr, weight_decay):
        g = g + weight_decay * p
        if has_momentum:
            old = buffers["momentum_buffer"]
            later = momentum * old + (1 - dampening) * g
            if isinstance(step, int):
                buf = g if step == 1 else later
            else:
                buf = torch.where(step == 1, g, later)
            buffers = {"momentum_buffer": buf}
            g = g + momentum * buf if nesterov else buf
        return p - lr * g, buffers

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        old = buffers.get("momentum_buffer")
        if streaming.usable([*ps, *gs, *(old or [])]):
            hyperparameters = [
                lr, momentum, dampening, weight_decay, nesterov, step == 1, has_momentum,
            ]
            new_ps, bufs = streaming.update("sgd", hyperparameters, [ps, gs, old], outputs)
            return new_ps, ({"momentum_buffer": bufs} if has_momentum else {})
        ps = owned(ps, outputs)
        bufs = []
        if has_momentum:
            old = buffers["momentum_buffer"]
            # The kernel overwrites the buffers on the first step, so they need no copy.
            fresh = step == 1 and outputs is not None
            bufs = outputs(old) if fresh else owned(old, outputs)
        torch._fused_sgd_(
            ps, gs, bufs, weight_decay=weight_decay, momentum=float(momentum), lr=lr,
            dampening=float(dampening), nesterov=nesterov, maximize=False,
            is_first_step=step == 1,
        )
        return ps, ({"momentum_buffer": bufs} if has_momentum else {})

    rule = Rule(
        buffers=("momentum_buffer",) if has_momentum else (),
        init_buffer=lambda name, p: torch.zeros_like(p, memory_format=torch.preserve_format),
        plain_step=plain_step,
        fast_step=fast_step,
    )
    return make_optimizer(SGDState, rule, lr, weight_decay, mask, impl, (momentum, dampening))
