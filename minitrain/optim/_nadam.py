"""NAdam (Dozat 2016), as torch.optim.NAdam computes it: momentum decay and both weight-decay
modes (L2 in the gradient, or decoupled as in AdamW)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import WeightDecayMask, check_pair
from minitrain.optim._family import (
    Rule,
    Scalar,
    add_scaled,
    check_betas,
    check_range,
    family_optimizer,
    rule_transform,
    second_moment,
    zeros,
)
from minitrain.optim._host import lerp_weight
from minitrain.optim.base import Optimizer, ScalarOrSchedule
from minitrain.tree import Params

__all__ = ["nadam", "scale_by_nadam", "ScaleByNadamState"]


class ScaleByNadamState(NamedTuple):
    """``count``, ``mu_product`` (the product of the momentum schedule so far, a float32 0-d
    tensor as torch keeps it), ``exp_avg`` and ``exp_avg_sq``."""

    count: Tensor
    mu_product: Tensor
    exp_avg: Params
    exp_avg_sq: Params


def _sqrt(value: Any) -> Any:
    return value.sqrt() if isinstance(value, Tensor) else math.sqrt(value)


def momentum_cache(beta1: Any, momentum_decay: Any, step: Any) -> Any:
    """Dozat 2016's momentum schedule ``mu_t = beta1 (1 - 0.5 * 0.96^(t * psi))``."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))


def nadam_leaf(g, buffers, p, step, beta1, beta2, eps, grad_coef, avg_coef):
    """torch's ``_single_tensor_nadam``: ``(grad_coef * g + avg_coef * m) / (sqrt(v_hat) + eps)``
    with ``grad_coef = (1 - mu_t) / (1 - prod mu)`` and ``avg_coef = mu_{t+1} / (1 - prod
    mu * mu_{t+1})`` (before ``-lr``)."""
    exp_avg = torch.lerp(buffers["exp_avg"], g, lerp_weight(1 - beta1, buffers["exp_avg"]))
    exp_avg_sq = second_moment(buffers["exp_avg_sq"], g, beta2)
    # sqrt(v / bc2) + eps = (sqrt(v) + eps sqrt(bc2)) / sqrt(bc2): the 1 / sqrt(bc2) moves
    # into the two coefficients, a pass less over v.
    root = _sqrt(1 - beta2**step)
    denom = exp_avg_sq.sqrt() + eps * root
    direction = add_scaled(g * (grad_coef * root), exp_avg, avg_coef * root) / denom
    return direction, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _rule(b1: Any, b2: Any, eps: Any, momentum_decay: Any) -> Rule:
    beta1, beta2 = check_betas((b1, b2))
    eps = check_range("eps", eps, 0.0)
    momentum_decay = check_range("momentum_decay", momentum_decay, 0.0)

    def advance(step, mu_product):
        mu = momentum_cache(beta1, momentum_decay, step)
        mu_next = momentum_cache(beta1, momentum_decay, step + 1)
        # torch multiplies a float32 mu_product by the (double) mu and reads it back.
        mu_product = _float32(mu_product * mu)
        return {"mu_product": mu_product}, {
            "grad_coef": (1.0 - mu) / (1.0 - mu_product),
            "avg_coef": mu_next / (1.0 - mu_product * mu_next),
        }

    return Rule("scale_by_nadam", ScaleByNadamState,
                lambda p: {"exp_avg": zeros(p), "exp_avg_sq": zeros(p)}, nadam_leaf,
                dict(beta1=beta1, beta2=beta2, eps=eps),
                scalars={"mu_product": lambda: torch.ones((), dtype=torch.float32, device="cpu")},
                advance=advance, state_hyperparams=(momentum_decay,))




def scale_by_nadam(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
                   momentum_decay: Scalar = 4e-3):
    """NAdam's step (before ``-lr``).

    >>> import torch
    >>> tx = scale_by_nadam()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1.0565, -1.0565])]
    """
    return rule_transform(_rule(b1, b2, eps, momentum_decay))


def _float32(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.to(torch.float32).to(value.dtype)
    return float(torch.tensor(value, dtype=torch.float32, device="cpu"))


def nadam(lr: ScalarOrSchedule = 2e-3, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
          weight_decay: Any = 0.0, momentum_decay: Scalar = 4e-3,
          decoupled_weight_decay: bool = False, *, maximize: bool = False,
          mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.NAdam: L2 decay before the step, or decoupled decay (``p -= lr * wd * p``).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.nadam(lr=0.1, weight_decay=0.1, decoupled_weight_decay=True)
    >>> params = {"w": torch.tensor([1.0])}
    >>> params, state = opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.8844])
    """
    b1, b2 = check_pair("betas", betas)
    return family_optimizer(_rule(b1, b2, eps, momentum_decay), lr, maximize=maximize,
                            weight_decay=weight_decay, mask=mask,
                            decoupled=bool(decoupled_weight_decay))
