"""Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"), as the reference
``schedulefree.AdamWScheduleFree`` computes it, with its linear warmup and weighted average.

Training runs at ``y``, an interpolation between the Adam-preconditioned SGD iterate ``z``
and their weighted average ``x``; the params an optimizer of this family updates are ``y``.
Evaluate (and checkpoint for inference) at ``x = schedule_free_eval_params(state, params)``,
which equals the reference's params after ``optimizer.eval()``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import check_hyperparameter, check_pair
from minitrain.optim._family import (
    Rule,
    Scalar,
    add_scaled,
    check_range,
    family_optimizer,
    find_state,
    rule_transform,
    second_moment,
    zeros,
)
from minitrain.optim._host import host_tensor
from minitrain.optim.base import Optimizer
from minitrain.tree import Params

__all__ = [
    "schedule_free_adamw",
    "scale_by_schedule_free_adamw",
    "ScheduleFreeAdamwState",
    "schedule_free_eval_params",
]


class ScheduleFreeAdamwState(NamedTuple):
    """``count``; ``b1`` (kept for :func:`schedule_free_eval_params`), ``weight_sum`` and
    ``lr_max`` (float64 0-d, the reference's group entries); per leaf ``z`` and
    ``exp_avg_sq``; ``lr`` is the warmed-up lr of the last update (float32)."""

    count: Tensor
    b1: Tensor
    weight_sum: Tensor
    lr_max: Tensor
    lr: Tensor
    z: Params
    exp_avg_sq: Params


def schedule_free_leaf(g, buffers, y, step, beta1, beta2, eps, weight_decay, lr_t,
                       bias_correction2, ckp1):
    """The reference's per-param step: ``g' = g / (sqrt(v / bc2) + eps) + wd y``;
    ``y <- lerp(y, z, c) + lr (beta1 (1 - c) - 1) g'``; ``z <- z - lr g'``. The update is the
    change of ``y``."""
    z = buffers["z"]
    exp_avg_sq = second_moment(buffers["exp_avg_sq"], g, beta2)
    normalized = g / ((exp_avg_sq / bias_correction2).sqrt() + eps)
    if not (isinstance(weight_decay, int | float) and weight_decay == 0):
        normalized = add_scaled(normalized, y, weight_decay)
    # lerp(y, z, c) + k g' - y = k g' + c (z - y)
    change = add_scaled(normalized * (lr_t * (beta1 * (1 - ckp1) - 1)), z - y, ckp1)
    return change, {"z": add_scaled(z, normalized, -lr_t), "exp_avg_sq": exp_avg_sq}


def _weights(step, lr, warmup_steps, r, weight_lr_power, beta2, weight_sum, lr_max):
    """The reference's per-step scalars: warmed-up lr, bias correction, and ``ckp1``, the
    weight of this iterate in the average ``x``."""
    traced = isinstance(step, Tensor)
    k = step - 1
    if traced:
        sched = torch.where(k < warmup_steps, (k + 1) / max(warmup_steps, 1), 1.0)
    else:
        sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
    lr_t = lr * sched
    if isinstance(lr_t, Tensor) or isinstance(lr_max, Tensor):
        # either may be a number (a float lr; a state scalar read as a float)
        device = (lr_t if isinstance(lr_t, Tensor) else lr_max).device
        lr_max = torch.maximum(torch.as_tensor(lr_t, dtype=torch.float64, device=device),
                               torch.as_tensor(lr_max, dtype=torch.float64, device=device))
    else:
        lr_max = max(lr_t, lr_max)
    weight = (k + 1) ** r * lr_max**weight_lr_power
    weight_sum = weight_sum + weight
    if isinstance(weight_sum, Tensor):
        ckp1 = torch.where(weight_sum == 0, 0.0, weight / torch.where(weight_sum == 0, 1.0,
                                                                      weight_sum))
    else:
        ckp1 = weight / weight_sum if weight_sum != 0 else 0.0
    return lr_t, 1 - beta2 ** (k + 1), ckp1, weight_sum, lr_max


def _rule(lr, betas, eps, weight_decay, warmup_steps, r, weight_lr_power) -> Rule:
    if callable(lr) and not isinstance(lr, Tensor):
        raise ValueError("invalid lr: schedule-free AdamW needs no schedule; pass a number "
                         "(and warmup_steps for a warmup)")
    lr = check_range("lr", lr, 0.0)
    beta1, beta2 = check_pair("betas", betas)
    check_hyperparameter("betas[0]", beta1, 0.0, 1.0, low_open=True, high_open=True)
    check_hyperparameter("betas[1]", beta2, 0.0, 1.0, high_open=True)
    eps = check_range("eps", eps, 0.0)
    weight_decay = check_range("weight_decay", weight_decay, 0.0)
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"invalid warmup_steps={warmup_steps!r}: pass an int >= 0")
    r = check_range("r", r, 0.0)
    weight_lr_power = check_range("weight_lr_power", weight_lr_power, 0.0)

    def advance(step, b1, weight_sum, lr_max, lr):
        lr_t, bias_correction2, ckp1, weight_sum, lr_max = _weights(
            step, lr_value, warmup_steps, r, weight_lr_power, beta2, weight_sum, lr_max)
        return {"b1": b1, "weight_sum": weight_sum, "lr_max": lr_max, "lr": lr_t}, {
            "lr_t": lr_t, "bias_correction2": bias_correction2, "ckp1": ckp1}

    lr_value = lr
    first_lr = lr / warmup_steps if warmup_steps else lr

    def f64(value: Any):
        return lambda: torch.tensor(float(value), dtype=torch.float64, device="cpu")

    return Rule(
        "scale_by_schedule_free_adamw", ScheduleFreeAdamwState,
        # a clone, not a detached one: z keeps the gradient with respect to the initial
        # params (differentiating through unrolled updates, MAML)
        lambda p: {"z": p.clone(memory_format=torch.preserve_format),
                   "exp_avg_sq": zeros(p)},
        schedule_free_leaf,
        dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay),
        scalars={"b1": lambda: host_tensor(beta1, torch.float64).clone(),
                 "weight_sum": f64(0.0), "lr_max": f64(-1.0),
                 "lr": lambda: host_tensor(first_lr, torch.float32).clone()},
        advance=advance, needs_params=True,
        state_hyperparams=(lr, r, weight_lr_power),
    )




def scale_by_schedule_free_adamw(
    lr: Any = 0.0025, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0, warmup_steps: int = 0, r: Scalar = 0.0,
    weight_lr_power: Scalar = 2.0,
):
    """Schedule-free AdamW's whole step of ``y`` (needs params).

    >>> import torch
    >>> tx = scale_by_schedule_free_adamw(lr=0.1)
    >>> params = [torch.ones(2)]
    >>> updates, state = tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)
    >>> updates, state.z
    ([tensor([-0.1000,  0.1000])], [tensor([0.9000, 1.1000])])
    """
    return rule_transform(_rule(lr, betas, eps, weight_decay, warmup_steps, r, weight_lr_power))


def schedule_free_adamw(lr: Any = 0.0025, betas: tuple[Any, Any] = (0.9, 0.999),
                        eps: Scalar = 1e-8, weight_decay: Scalar = 0.0,
                        warmup_steps: int = 0, r: Scalar = 0.0, weight_lr_power: Scalar = 2.0,
                        *, maximize: bool = False) -> Optimizer:
    """``schedulefree.AdamWScheduleFree`` (its names and defaults): the params it updates are
    the training point ``y``; evaluate at ``schedule_free_eval_params(state, params)``.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.schedule_free_adamw(lr=0.1)
    >>> params = {"w": torch.ones(2)}
    >>> state = opt.init(params)
    >>> for _ in range(3):
    ...     params, state = opt.update({"w": torch.tensor([1.0, -1.0])}, state, params)
    >>> params["w"], mt.optim.schedule_free_eval_params(state, params)["w"]
    (tensor([0.7900, 1.2100]), tensor([0.8000, 1.2000]))
    """
    return family_optimizer(
        _rule(lr, betas, eps, weight_decay, warmup_steps, r, weight_lr_power), maximize=maximize)


def schedule_free_eval_params(state: Any, params: Params) -> Params:
    """The averaged point ``x = y + (1 - 1/b1) (z - y)`` to evaluate at (pure; the reference's
    ``optimizer.eval()`` sets its params to the same values).

    ``state`` is the state of :func:`schedule_free_adamw` or of a chain holding
    :func:`scale_by_schedule_free_adamw`.
    """
    inner = find_state(state, ScheduleFreeAdamwState)
    if inner is None:
        raise ValueError(
            "schedule_free_eval_params expects the state of mt.optim.schedule_free_adamw "
            f"(or a chain with scale_by_schedule_free_adamw), got {type(state).__name__}"
        )
    weight = 1 - 1 / float(inner.b1)
    return tree.map(lambda y, z: torch.lerp(y, z.to(y.dtype), weight), params, inner.z)
