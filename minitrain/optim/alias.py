"""The torch.optim classics as chains of transformations (optax ``_src/alias.py``).

Each alias takes ``torch.optim``'s arguments and defaults and returns
``as_optimizer(chain(...))`` in torch's order: ``-g`` when maximizing, L2 ``weight_decay`` before
the rule (decoupled after it, for AdamW), then ``-lr``. ``minitrain.optim.kernels`` runs these
chains as torch's fused kernels or the streaming C kernel; the chain is the definition.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from minitrain.optim._checks import WeightDecayMask, check_pair
from minitrain.optim._family import torch_order
from minitrain.optim._transforms_rules import (
    add_decayed_weights,
    keeps_momentum_buffer,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_rms,
    trace,
)
from minitrain.optim.base import Optimizer, ScalarOrSchedule, as_optimizer

__all__ = ["sgd", "adam", "adamw", "adagrad", "rmsprop"]

Scalar = float | int | Tensor


def _checked_maximize(maximize: Any) -> bool:
    if not isinstance(maximize, bool):
        raise ValueError(f"invalid maximize={maximize!r}: pass True or False")
    return maximize


def sgd(lr: ScalarOrSchedule = 1e-3, momentum: Scalar = 0.0, dampening: Scalar = 0.0,
        nesterov: bool = False, weight_decay: Scalar = 0.0, *, maximize: bool = False,
        mask: WeightDecayMask = None) -> Optimizer:
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
    momentum_part = trace(momentum, dampening, nesterov)  # checks all three
    rule = [momentum_part] if keeps_momentum_buffer(momentum) else []
    return as_optimizer(torch_order(rule, lr, maximize=_checked_maximize(maximize),
                                    decay=add_decayed_weights(weight_decay, mask)), strict=True)


def adam(lr: ScalarOrSchedule = 1e-3, betas: tuple[Scalar, Scalar] = (0.9, 0.999),
         eps: Scalar = 1e-8, weight_decay: Scalar = 0.0, amsgrad: bool = False, *,
         maximize: bool = False, mask: WeightDecayMask = None,
         decoupled_weight_decay: bool = False) -> Optimizer:
    """Adam with L2 weight decay, with ``torch.optim.Adam``'s arguments and defaults;
    ``decoupled_weight_decay=True`` makes it AdamW (as torch's Adam then is). Kingma & Ba 2015,
    Algorithm 1; Reddi et al. 2018 for AMSGrad.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adam(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([5.0, -0.01])}, state, params)
    >>> params["w"]  # the first step moves each coordinate by about lr
    tensor([0.9000, 1.1000])
    """
    beta1, beta2 = check_pair("betas", betas)
    return as_optimizer(torch_order(
        [scale_by_adam(beta1, beta2, eps=eps, amsgrad=amsgrad)], lr,
        maximize=_checked_maximize(maximize), decay=add_decayed_weights(weight_decay, mask),
        decoupled=bool(decoupled_weight_decay)), strict=True)


def adamw(lr: ScalarOrSchedule = 1e-3, betas: tuple[Scalar, Scalar] = (0.9, 0.999),
          eps: Scalar = 1e-8, weight_decay: Scalar = 1e-2, amsgrad: bool = False, *,
          maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """Adam with decoupled weight decay, with ``torch.optim.AdamW``'s arguments and defaults
    (Loshchilov & Hutter 2019).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adamw(lr=0.1, weight_decay=0.5, mask=lambda name, p: p.ndim >= 2)
    >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
    >>> state = opt.init(params)
    >>> grads = {"w": torch.zeros(1, 1), "b": torch.zeros(1)}
    >>> params, state = opt.update(grads, state, params)
    >>> params["w"].item(), params["b"].item()  # only the matrix decays: 1 - 0.1 * 0.5
    (0.949999988079071, 1.0)
    """
    return adam(lr, betas, eps, weight_decay, amsgrad, maximize=maximize, mask=mask,
                decoupled_weight_decay=True)


def adagrad(lr: ScalarOrSchedule = 1e-2, lr_decay: Scalar = 0.0, weight_decay: Scalar = 0.0,
            initial_accumulator_value: Scalar = 0.0, eps: Scalar = 1e-10, *,
            maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """AdaGrad with ``torch.optim.Adagrad``'s arguments and defaults (Duchi et al. 2011).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adagrad(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([3.0, -0.5])}, state, params)
    >>> params["w"]  # each coordinate moves by lr on the first step
    tensor([0.9000, 1.1000])
    """
    return as_optimizer(torch_order(
        [scale_by_adagrad(lr_decay, initial_accumulator_value, eps)], lr,
        maximize=_checked_maximize(maximize), decay=add_decayed_weights(weight_decay, mask)),
        strict=True)


def rmsprop(lr: ScalarOrSchedule = 1e-2, alpha: Scalar = 0.99, eps: Scalar = 1e-8,
            weight_decay: Scalar = 0.0, momentum: Scalar = 0.0, centered: bool = False, *,
            maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """RMSprop with ``torch.optim.RMSprop``'s arguments and defaults (Hinton's lecture 6e;
    Graves 2013 when centered).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.rmsprop(lr=0.01, alpha=0.0, eps=0.0)
    >>> params = {"w": torch.tensor([1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([4.0])}, state, params)
    >>> params["w"]  # alpha=0: v = g * g, so the step is lr * sign(g)
    tensor([0.9900])
    """
    momentum_part = trace(momentum)
    rule = [scale_by_rms(alpha, eps, centered),
            *([momentum_part] if keeps_momentum_buffer(momentum) else [])]
    return as_optimizer(torch_order(rule, lr, maximize=_checked_maximize(maximize),
                                    decay=add_decayed_weights(weight_decay, mask)), strict=True)
