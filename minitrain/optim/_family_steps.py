"""The family's rules whose output is the whole step (no ``-lr`` after them): ASGD, Rprop and
schedule-free AdamW, each keeping its lr (and more scalars) in its state; see ``_family``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import (
    Scalar,
    WeightDecayMask,
    check_hyperparameter,
    check_pair,
    checked,
    f32_tensor,
    float32,
    host_tensor,
    is_zero,
    scalar,
)
from minitrain.optim._family import family, family_optimizer, find_state, second_moment
from minitrain.optim.base import GradientTransformation, Optimizer
from minitrain.optim.transforms import add_scaled, filled, zeros
from minitrain.tree import Params

__all__ = [
    "asgd", "scale_by_asgd", "ScaleByAsgdState", "asgd_average",
    "rprop", "scale_by_rprop", "ScaleByRpropState",
    "schedule_free_adamw", "scale_by_schedule_free_adamw", "ScheduleFreeAdamwState",
    "schedule_free_eval_params",
]


def _no_schedule(lr: Any, why: str) -> Any:
    if callable(lr) and not isinstance(lr, Tensor):
        raise ValueError(f"invalid lr: {why}")
    return checked("lr", lr, 0.0)


# -- ASGD (Polyak & Juditsky 1992; Bottou 2012's step sizes) ----------------------------------


class ScaleByAsgdState(NamedTuple):
    """``count``, ``lr`` (``eta`` of the last update, float32 as torch keeps it) and ``ax``,
    the running average of the params."""

    count: Tensor
    lr: Tensor
    ax: Params


def asgd_step_sizes(step: Any, lr: Any, lambd: Any, alpha: Any, t0: Any) -> tuple[Any, Any]:
    """``(eta_t, mu_t)`` of update ``t``, as torch sets them after update ``t - 1``:
    ``eta = lr / (1 + lambd lr (t - 1))^alpha``, ``mu = 1 / max(1, t - 1 - t0)`` (both start at
    ``lr`` and 1), each rounded to float32 as torch holds them.

    >>> asgd_step_sizes(2, 0.1, 1.0, 1.0, 1e6)  # 0.1 / 1.1 in float32, and 1
    (0.09090909361839294, 1.0)
    """
    eta = lr / (1 + lambd * lr * (step - 1)) ** alpha
    if isinstance(step, Tensor):
        mu = torch.where(step == 1, 1.0, 1 / torch.clamp(step - 1 - t0, min=1.0))
    else:
        mu = 1.0 if step == 1 else 1 / max(1.0, step - 1 - t0)
    return float32(eta), float32(mu)


def asgd_leaf(g, buffers, p, step, lambd, eta, mu):
    """torch's ``_single_tensor_asgd``: ``p <- p (1 - lambd eta) - eta g``, then
    ``ax <- ax + mu (p - ax)`` (a copy while ``mu == 1``)."""
    update = add_scaled(g, p, lambd) * -eta
    new_p = p + update
    ax = buffers["ax"]
    averaged = ax + (new_p - ax) * mu
    if isinstance(mu, Tensor):
        averaged = torch.where(mu == 1, new_p, averaged)
    elif mu == 1:
        averaged = new_p
    return update, {"ax": averaged}


def scale_by_asgd(lr: Any = 1e-2, lambd: Scalar = 1e-4, alpha: Scalar = 0.75,
                  t0: Scalar = 1e6) -> GradientTransformation:
    """ASGD's whole step ``-eta_t (g + lambd p)``, keeping the average of the params in
    ``ax`` (read it with :func:`asgd_average`).

    >>> import torch
    >>> tx = scale_by_asgd(lr=0.5, lambd=0.0)
    >>> params = [torch.ones(1)]
    >>> updates, state = tx.update([torch.ones(1)], tx.init(params), params)
    >>> updates, state.ax
    ([tensor([-0.5000])], [tensor([0.5000])])
    """
    if callable(lr) and not isinstance(lr, Tensor):  # done -> lr, checked as torch's group lr
        lr_after = lambda done: checked("lr (from the schedule)", lr(done), 0.0)  # noqa: E731
    else:
        constant = checked("lr", lr, 0.0)
        lr_after = lambda done: constant  # noqa: E731
    lambd, alpha = checked("lambd", lambd, 0.0), checked("alpha", alpha, 0.0)
    t0 = checked("t0", t0, -float("inf"))

    def advance(step, lr):  # lr: eta of the last update (kept for learning_rate(state))
        # eta_t is set at the end of update t - 1 from the lr of that update, as torch's ASGD
        # does under an LRScheduler (its group lr then is the schedule's value after t - 2).
        done = torch.clamp(step - 2, min=0).to(torch.int64) if isinstance(step, Tensor) \
            else max(step - 2, 0)  # a traced step is a float64 tensor; counts are ints
        eta, mu = asgd_step_sizes(step, lr_after(done), lambd, alpha, t0)
        return {"lr": eta}, {"eta": eta, "mu": mu}

    return family("scale_by_asgd", ScaleByAsgdState, asgd_leaf, dict(lambd=lambd),
                  advance=advance, needs_params=True, state_hyperparams=(lr, alpha, t0),
                  scalars={"lr": lambda: host_tensor(lr_after(0), torch.float32).clone()})


def asgd(lr: Any = 1e-2, lambd: Scalar = 1e-4, alpha: Scalar = 0.75, t0: Scalar = 1e6,
         weight_decay: Any = 0.0, *, maximize: bool = False,
         mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.ASGD: L2 decay, then ASGD's step; the averaged params are
    ``asgd_average(state)``.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.asgd(lr=0.5, lambd=0.0)
    >>> params = {"w": torch.tensor([1.0])}
    >>> params, state = opt.update({"w": torch.tensor([1.0])}, opt.init(params), params)
    >>> params["w"], mt.optim.asgd_average(state)["w"]
    (tensor([0.5000]), tensor([0.5000]))
    """
    return family_optimizer(scale_by_asgd(lr, lambd, alpha, t0), maximize=maximize,
                            weight_decay=weight_decay, mask=mask)


def asgd_average(state: Any) -> Params:
    """The averaged params ``ax`` held in an ASGD state (also inside a chain's state).

    >>> import torch, minitrain as mt
    >>> opt, params = mt.optim.asgd(lr=0.1), {"w": torch.ones(2)}
    >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> asgd_average(state)
    {'w': tensor([0.9000, 0.9000])}
    """
    found = find_state(state, ScaleByAsgdState)
    if found is None:
        raise ValueError("asgd_average expects the state of mt.optim.asgd or scale_by_asgd")
    return found.ax


# -- Rprop (Riedmiller & Braun 1993) ----------------------------------------------------------


class ScaleByRpropState(NamedTuple):
    """``count``, ``lr`` (the initial step size, torch's group ``lr``), ``prev`` (last
    gradient, zero where it changed sign) and ``step_size``."""

    count: Tensor
    lr: Tensor
    prev: Params
    step_size: Params


def rprop_leaf(g, buffers, p, step, etaminus, etaplus, step_size_min, step_size_max):
    """torch's ``_single_tensor_rprop``: each step size grows by ``etaplus`` where the
    gradient kept its sign, shrinks by ``etaminus`` (no step) where it flipped."""
    sign = torch.sign(g * buffers["prev"])
    # The factors in the leaf's dtype, as torch writes them into its ``sign`` tensor.
    factor = torch.where(sign > 0, etaplus, torch.where(sign < 0, etaminus, torch.ones_like(sign)))
    step_size = torch.clamp(buffers["step_size"] * factor, step_size_min, step_size_max)
    kept = torch.where(sign < 0, 0.0, g)
    return -torch.sign(kept) * step_size, {"prev": kept, "step_size": step_size}


def scale_by_rprop(lr: Any = 1e-2, etas: tuple[Any, Any] = (0.5, 1.2),
                   step_sizes: tuple[Any, Any] = (1e-6, 50)) -> GradientTransformation:
    """Rprop's whole step; ``lr`` is the initial step size of every coordinate.

    >>> import torch
    >>> tx = scale_by_rprop(lr=0.1)
    >>> state = tx.init([torch.zeros(2)])
    >>> for g in ([1.0, 1.0], [1.0, -1.0]):
    ...     updates, state = tx.update([torch.tensor(g)], state)
    >>> updates
    [tensor([-0.1200, -0.0000])]
    """
    lr = _no_schedule(lr, "Rprop's lr is its initial step size; pass a number")
    etaminus, etaplus = check_pair("etas", etas)
    check_hyperparameter("etas[0]", etaminus, 0.0, 1.0, low_open=True, high_open=True)
    check_hyperparameter("etas[1]", etaplus, 1.0, low_open=True)
    smallest, largest = check_pair("step_sizes", step_sizes)
    check_hyperparameter("step_sizes[0]", smallest, 0.0)
    floor = scalar(smallest)  # a traced one (torch.func) bounds step_sizes[1] by 0 alone
    check_hyperparameter("step_sizes[1]", largest, floor if isinstance(floor, int | float)
                         else 0.0)
    return family("scale_by_rprop", ScaleByRpropState, rprop_leaf,
                  dict(etaminus=etaminus, etaplus=etaplus, step_size_min=smallest,
                       step_size_max=largest),
                  init_leaf=lambda p: {"prev": zeros(p), "step_size": filled(p, lr)},
                  scalars={"lr": lambda: f32_tensor(lr)}, advance=lambda step, lr: ({"lr": lr}, {}))


def rprop(lr: Any = 1e-2, etas: tuple[Any, Any] = (0.5, 1.2),
          step_sizes: tuple[Any, Any] = (1e-6, 50), *, maximize: bool = False) -> Optimizer:
    """torch.optim.Rprop.

    >>> import torch
    >>> opt, params = rprop(lr=0.1), {"w": torch.tensor([1.0, 1.0])}
    >>> opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9000, 1.1000])
    """
    return family_optimizer(scale_by_rprop(lr, etas, step_sizes), maximize=maximize)


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
