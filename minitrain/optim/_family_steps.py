"""Schedule-free AdamW, the family's rule whose output is the whole step (no ``-lr`` after it),
keeping its lr (and more scalars) in its state; see ``_family``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import (
    Scalar,
    check_hyperparameter,
    check_pair,
    checked,
    f32_tensor,
    host_tensor,
    is_zero,
)
from minitrain.optim._family import family, family_optimizer, find_state, second_moment
from minitrain.optim.base import GradientTransformation, Optimizer
from minitrain.optim.transforms import add_scaled, zeros
from minitrain.tree import Params

__all__ = [
    "schedule_free_adamw", "scale_by_schedule_free_adamw", "ScheduleFreeAdamwState",
    "schedule_free_eval_params",
]


def _no_schedule(lr: Any, why: str) -> Any:
    if callable(lr) and not isinstance(lr, Tensor):
        raise ValueError(f"invalid lr: {why}")
    return checked("lr", lr, 0.0)


# -- schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled") ---------------------
#
# Training runs at y, an interpolation between the Adam-preconditioned SGD iterate z and their
# weighted average x; the params the optimizer updates are y. Evaluate at
# x = schedule_free_eval_params(state, params), the reference's params after optimizer.eval().


class ScheduleFreeAdamwState(NamedTuple):
    """``count``; ``b1``, ``weight_sum`` and ``lr_max`` (float64, the reference's group
    entries); ``lr``, the last warmed-up lr (float32); per leaf ``z`` and ``exp_avg_sq``."""

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
    ``y <- lerp(y, z, c) + lr (beta1 (1 - c) - 1) g'``; ``z <- z - lr g'``."""
    z = buffers["z"]
    exp_avg_sq = second_moment(buffers["exp_avg_sq"], g, beta2)
    normalized = g / ((exp_avg_sq / bias_correction2).sqrt() + eps)
    if not is_zero(weight_decay):
        normalized = add_scaled(normalized, y, weight_decay)
    # lerp(y, z, c) + k g' - y = k g' + c (z - y)
    change = add_scaled(normalized * (lr_t * (beta1 * (1 - ckp1) - 1)), z - y, ckp1)
    return change, {"z": add_scaled(z, normalized, -lr_t), "exp_avg_sq": exp_avg_sq}


def scale_by_schedule_free_adamw(
    lr: Any = 0.0025, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0, warmup_steps: int = 0, r: Scalar = 0.0,
    weight_lr_power: Scalar = 2.0,
) -> GradientTransformation:
    """Schedule-free AdamW's whole step of ``y`` (needs params).

    >>> import torch
    >>> tx = scale_by_schedule_free_adamw(lr=0.1)
    >>> params = [torch.ones(2)]
    >>> updates, state = tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)
    >>> updates, state.z
    ([tensor([-0.1000,  0.1000])], [tensor([0.9000, 1.1000])])
    """
    base_lr = _no_schedule(lr, "schedule-free AdamW needs no schedule; pass a number (and "
                               "warmup_steps for a warmup)")
    beta1, beta2 = check_pair("betas", betas)
    check_hyperparameter("betas[0]", beta1, 0.0, 1.0, low_open=True, high_open=True)
    check_hyperparameter("betas[1]", beta2, 0.0, 1.0, high_open=True)
    eps, weight_decay = checked("eps", eps, 0.0), checked("weight_decay", weight_decay, 0.0)
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"invalid warmup_steps={warmup_steps!r}: pass an int >= 0")
    r, weight_lr_power = checked("r", r, 0.0), checked("weight_lr_power", weight_lr_power, 0.0)

    def advance(step, b1, weight_sum, lr_max, lr):
        """The reference's per-step scalars: the warmed-up lr, the bias correction and
        ``ckp1``, this iterate's weight in the average ``x``."""
        warmup = step / max(warmup_steps, 1)
        lr_t = base_lr * (warmup.clamp(max=1.0) if isinstance(warmup, Tensor)
                           else min(warmup, 1.0))
        if isinstance(lr_t, Tensor) or isinstance(lr_max, Tensor):
            device = (lr_t if isinstance(lr_t, Tensor) else lr_max).device
            lr_max = torch.maximum(torch.as_tensor(lr_t, dtype=torch.float64, device=device),
                                   torch.as_tensor(lr_max, dtype=torch.float64, device=device))
        else:
            lr_max = max(lr_t, lr_max)
        weight = step**r * lr_max**weight_lr_power
        weight_sum = weight_sum + weight
        if isinstance(weight_sum, Tensor):
            ckp1 = torch.where(weight_sum == 0, 0.0,
                               weight / torch.where(weight_sum == 0, 1.0, weight_sum))
        else:
            ckp1 = weight / weight_sum if weight_sum != 0 else 0.0
        return {"b1": b1, "weight_sum": weight_sum, "lr_max": lr_max, "lr": lr_t}, {
            "lr_t": lr_t, "bias_correction2": 1 - beta2**step, "ckp1": ckp1}

    def f64(value: Any) -> Any:
        return lambda: host_tensor(value, torch.float64).clone()

    return family(
        "scale_by_schedule_free_adamw", ScheduleFreeAdamwState, schedule_free_leaf,
        dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay),
        # a clone, not a detached one: z keeps the gradient with respect to the initial params
        init_leaf=lambda p: {"z": p.clone(memory_format=torch.preserve_format),
                             "exp_avg_sq": zeros(p)},
        scalars={"b1": f64(beta1), "weight_sum": f64(0.0), "lr_max": f64(-1.0),
                 "lr": lambda: f32_tensor(base_lr / warmup_steps if warmup_steps else base_lr)},
        advance=advance, needs_params=True, state_hyperparams=(base_lr, r, weight_lr_power))


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
    return family_optimizer(scale_by_schedule_free_adamw(
        lr, betas, eps, weight_decay, warmup_steps, r, weight_lr_power), maximize=maximize)


def schedule_free_eval_params(state: Any, params: Params) -> Params:
    """The averaged point ``x = y + (1 - 1/b1) (z - y)`` to evaluate at (pure), from the state
    of :func:`schedule_free_adamw` or of a chain holding its rule.

    >>> import torch, minitrain as mt
    >>> opt, params = mt.optim.schedule_free_adamw(lr=0.1), {"w": torch.ones(2)}
    >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> schedule_free_eval_params(state, params)
    {'w': tensor([0.9000, 0.9000])}
    """
    inner = find_state(state, ScheduleFreeAdamwState)
    if inner is None:
        raise ValueError(
            "schedule_free_eval_params expects the state of mt.optim.schedule_free_adamw "
            f"(or a chain with scale_by_schedule_free_adamw), got {type(state).__name__}")
    weight = 1 - 1 / float(inner.b1)
    return tree.map(lambda y, z: torch.lerp(y, z.to(y.dtype), weight), params, inner.z)
