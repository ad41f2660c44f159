"""The torch.optim classics as chains of transformations (optax ``_src/alias.py``), with
``torch.optim``'s arguments and defaults, in torch's order (:func:`torch_order`); ``kernels``
runs these chains as fused kernels, the chain is the definition."""

from __future__ import annotations

from typing import Any

from minitrain.optim._checks import Scalar, WeightDecayMask, check_pair, is_zero, one_lr
from minitrain.optim.base import (
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    as_optimizer,
    chain,
)
from minitrain.optim.transforms import (
    add_decayed_weights,
    scale,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_rms,
    trace,
)

__all__ = ["sgd", "adam", "adamw", "adagrad", "rmsprop"]


def torch_order(rule: list[GradientTransformation], lr: Any, *, maximize: bool = False,
                decay: GradientTransformation | None = None, decoupled: bool = False) -> Optimizer:
    """torch.optim's order as a strict optimizer (:func:`as_optimizer`): ``-g`` when
    maximizing, the L2 ``decay`` before the ``rule`` (``decoupled``: after it), then ``-lr``
    (none for ``lr=None``)."""
    if not isinstance(maximize, bool):
        raise ValueError(f"invalid maximize={maximize!r}: pass True or False")
    return as_optimizer(chain(
        *([scale(-1.0)] if maximize else []),
        *([decay] if decay is not None and not decoupled else []),
        *rule,
        *([decay] if decay is not None and decoupled else []),
        *([scale_by_learning_rate(one_lr(lr))] if lr is not None else []),
    ), strict=True)


def sgd(lr: ScalarOrSchedule = 1e-3, momentum: Scalar = 0.0, dampening: Scalar = 0.0,
        nesterov: bool = False, weight_decay: Scalar = 0.0, *, maximize: bool = False,
        mask: WeightDecayMask = None) -> Optimizer:
    """Stochastic gradient descent, ``torch.optim.SGD``.

    >>> import torch
    >>> opt, params = sgd(lr=0.1, momentum=0.9), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([1.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9000])
    """
    momentum_part = trace(momentum, dampening, nesterov)  # checks all three
    rule = [] if is_zero(momentum) else [momentum_part]
    return torch_order(rule, lr, maximize=maximize, decay=add_decayed_weights(weight_decay, mask))


def adam(lr: ScalarOrSchedule = 1e-3, betas: tuple[Scalar, Scalar] = (0.9, 0.999),
         eps: Scalar = 1e-8, weight_decay: Scalar = 0.0, amsgrad: bool = False, *,
         maximize: bool = False, mask: WeightDecayMask = None,
         decoupled_weight_decay: bool = False) -> Optimizer:
    """Adam (Kingma & Ba 2015; AMSGrad: Reddi et al. 2018) with L2 weight decay,
    ``torch.optim.Adam``; ``decoupled_weight_decay=True`` makes it AdamW, as in torch.

    >>> import torch
    >>> opt, params = adam(lr=0.1), {"w": torch.tensor([1.0, 1.0])}
    >>> opt.update({"w": torch.tensor([5.0, -0.01])}, opt.init(params), params)[0]["w"]
    tensor([0.9000, 1.1000])
    """
    beta1, beta2 = check_pair("betas", betas)
    return torch_order([scale_by_adam(beta1, beta2, eps=eps, amsgrad=amsgrad)], lr,
                       maximize=maximize, decay=add_decayed_weights(weight_decay, mask),
                       decoupled=bool(decoupled_weight_decay))


def adamw(lr: ScalarOrSchedule = 1e-3, betas: tuple[Scalar, Scalar] = (0.9, 0.999),
          eps: Scalar = 1e-8, weight_decay: Scalar = 1e-2, amsgrad: bool = False, *,
          maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), ``torch.optim.AdamW``.

    >>> import torch
    >>> opt = adamw(lr=0.1, weight_decay=0.5, mask=lambda name, p: p.ndim >= 2)
    >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
    >>> opt.update({"w": torch.zeros(1, 1), "b": torch.zeros(1)}, opt.init(params), params)[0]
    {'w': tensor([[0.9500]]), 'b': tensor([1.])}
    """
    return adam(lr, betas, eps, weight_decay, amsgrad, maximize=maximize, mask=mask,
                decoupled_weight_decay=True)


def adagrad(lr: ScalarOrSchedule = 1e-2, lr_decay: Scalar = 0.0, weight_decay: Scalar = 0.0,
            initial_accumulator_value: Scalar = 0.0, eps: Scalar = 1e-10, *,
            maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """AdaGrad (Duchi et al. 2011), ``torch.optim.Adagrad``.

    >>> import torch
    >>> opt, params = adagrad(lr=0.1), {"w": torch.tensor([1.0, 1.0])}
    >>> opt.update({"w": torch.tensor([3.0, -0.5])}, opt.init(params), params)[0]["w"]
    tensor([0.9000, 1.1000])
    """
    return torch_order([scale_by_adagrad(lr_decay, initial_accumulator_value, eps)], lr,
                       maximize=maximize, decay=add_decayed_weights(weight_decay, mask))


def rmsprop(lr: ScalarOrSchedule = 1e-2, alpha: Scalar = 0.99, eps: Scalar = 1e-8,
            weight_decay: Scalar = 0.0, momentum: Scalar = 0.0, centered: bool = False, *,
            maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """RMSprop (Hinton's lecture 6e; Graves 2013 when centered), ``torch.optim.RMSprop``.

    >>> import torch
    >>> opt, params = rmsprop(lr=0.01, alpha=0.0, eps=0.0), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([4.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9900])
    """
    momentum_part = trace(momentum)
    rule = [scale_by_rms(alpha, eps, centered)] + ([] if is_zero(momentum) else [momentum_part])
    return torch_order(rule, lr, maximize=maximize, decay=add_decayed_weights(weight_decay, mask))
