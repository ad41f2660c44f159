"""The torch.optim family beyond Adam, SGD, AdaGrad and RMSprop, Lion and schedule-free AdamW:
each a per-leaf rule made the transformation ``scale_by_<name>`` by :func:`family`, and an alias
chaining it in torch's order (schedule-free AdamW's rule is the whole step, no ``-lr``)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import (
    Scalar,
    WeightDecayMask,
    check_betas,
    check_hyperparameter,
    check_pair,
    checked,
    f32_tensor,
    float32,
    host_tensor,
    is_traced,
    is_zero,
    one_lr,
)
from minitrain.optim.alias import torch_order
from minitrain.optim.base import GradientTransformation, Optimizer, ScalarOrSchedule
from minitrain.optim.leafwise import leafwise
from minitrain.optim.schedules import _clip, _where
from minitrain.optim.transforms import add_decayed_weights, add_scaled, first_moment, sqrt, zeros
from minitrain.tree import Params

__all__ = [
    "adadelta", "scale_by_adadelta", "ScaleByAdadeltaState", "adamax", "scale_by_adamax",
    "ScaleByAdamaxState", "lion", "scale_by_lion", "ScaleByLionState", "nadam", "scale_by_nadam",
    "ScaleByNadamState", "radam", "scale_by_radam", "ScaleByRadamState", "schedule_free_adamw",
    "scale_by_schedule_free_adamw", "ScheduleFreeAdamwState", "schedule_free_eval_params",
]


class Rule(NamedTuple):
    """What the lowering reads of a family transformation (its spec's ``rule``): the state's
    ``scalars``, ``advance`` and the hyperparameters held only there (schedule-free's lr,
    NAdam's momentum_decay), which keep it off the kernels when traced."""

    scalars: dict[str, Any] | None
    advance: Any
    state_hyperparams: tuple[Any, ...]


def family(name: str, state_type: type, update_leaf: Any, hyperparams: dict[str, Any], *,
           state_hyperparams: tuple[Any, ...] = (), **options: Any) -> GradientTransformation:
    """:func:`leafwise` of a rule (``options``: its keyword arguments, ``init_leaf`` among
    them), its spec carrying the :class:`Rule`."""
    tx = leafwise(name, options.pop("init_leaf", None), update_leaf, state_type, hyperparams,
                  **options)
    tx.update.minitrain_spec[1]["rule"] = Rule(options.get("scalars"), options.get("advance"),
                                               state_hyperparams)
    return tx


def family_optimizer(tx: GradientTransformation, lr: Any = None, *, maximize: bool = False,
                     weight_decay: Any = 0.0, mask: WeightDecayMask = None,
                     decoupled: bool = False) -> Optimizer:
    """``tx`` in torch's order (:func:`torch_order`); with ``lr=None`` it is the whole step."""
    weight_decay = checked("weight_decay", weight_decay, 0.0)
    decay = None if is_zero(weight_decay) else add_decayed_weights(weight_decay, mask)
    return torch_order([tx], lr, maximize=maximize, decay=decay, decoupled=decoupled)


def second_moment(exp_avg_sq: Any, g: Any, beta2: Any) -> Any:
    """torch's ``exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)`` (the kernel's order
    for a traced ``beta2`` or one that requires grad)."""
    if is_traced(beta2) or (isinstance(beta2, Tensor) and beta2.requires_grad):
        return beta2 * exp_avg_sq + (1 - beta2) * g * g
    return torch.addcmul(beta2 * exp_avg_sq, g, g, value=1 - beta2)


def _adam_like(b1: Any, b2: Any, eps: Any) -> dict[str, Any]:
    beta1, beta2 = check_betas((b1, b2))
    return dict(beta1=beta1, beta2=beta2, eps=checked("eps", eps, 0.0))


class ScaleByAdadeltaState(NamedTuple):
    """``count``, ``square_avg`` (running E[g²]) and ``acc_delta`` (running E[Δx²])."""

    count: Tensor
    square_avg: Params
    acc_delta: Params


def adadelta_leaf(g, buffers, p, step, rho, eps):
    """Zeiler 2012, Algorithm 1 (torch's ``_single_tensor_adadelta``)."""
    square_avg = second_moment(buffers["square_avg"], g, rho)
    delta = (buffers["acc_delta"] + eps).sqrt() / (square_avg + eps).sqrt() * g
    acc_delta = second_moment(buffers["acc_delta"], delta, rho)
    return delta, {"square_avg": square_avg, "acc_delta": acc_delta}


def scale_by_adadelta(rho: Scalar = 0.9, eps: Scalar = 1e-6) -> GradientTransformation:
    """Adadelta's per-coordinate step (before ``-lr``).

    >>> tx = scale_by_adadelta(rho=0.0, eps=1e-6)
    >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
    [tensor([0.0010])]
    """
    return family("scale_by_adadelta", ScaleByAdadeltaState, adadelta_leaf,
                  dict(rho=checked("rho", rho, 0.0, 1.0), eps=checked("eps", eps, 0.0)))


def adadelta(lr: ScalarOrSchedule = 1.0, rho: Scalar = 0.9, eps: Scalar = 1e-6,
             weight_decay: Any = 0.0, *, maximize: bool = False,
             mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.Adadelta (Zeiler 2012): L2 weight decay, Adadelta's step, times ``-lr``.

    >>> opt, params = adadelta(lr=1.0, rho=0.0), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9990])
    """
    return family_optimizer(scale_by_adadelta(rho, eps), lr, maximize=maximize,
                            weight_decay=weight_decay, mask=mask)


class ScaleByAdamaxState(NamedTuple):
    """``count``, ``exp_avg`` (first moment) and ``exp_inf`` (decayed infinity norm)."""

    count: Tensor
    exp_avg: Params
    exp_inf: Params


def adamax_leaf(g, buffers, p, step, beta1, beta2, eps):
    """Kingma & Ba 2015, Algorithm 2, with torch's eps inside ``max(beta2 u, |g| + eps)``."""
    exp_avg = first_moment(buffers["exp_avg"], g, beta1)
    exp_inf = torch.maximum(beta2 * buffers["exp_inf"], g.abs() + eps)
    return exp_avg / exp_inf / (1 - beta1**step), {"exp_avg": exp_avg, "exp_inf": exp_inf}


def scale_by_adamax(b1: Scalar = 0.9, b2: Scalar = 0.999,
                    eps: Scalar = 1e-8) -> GradientTransformation:
    """Adamax's step (before ``-lr``).

    >>> tx = scale_by_adamax()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1., -1.])]
    """
    return family("scale_by_adamax", ScaleByAdamaxState, adamax_leaf, _adam_like(b1, b2, eps))


def adamax(lr: ScalarOrSchedule = 2e-3, betas: tuple[Any, Any] = (0.9, 0.999),
           eps: Scalar = 1e-8, weight_decay: Any = 0.0, *, maximize: bool = False,
           mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.Adamax: L2 weight decay, then Adamax's step, times ``-lr``.

    >>> opt, params = adamax(lr=0.1), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9000])
    """
    return family_optimizer(scale_by_adamax(*check_pair("betas", betas), eps), lr,
                            maximize=maximize, weight_decay=weight_decay, mask=mask)


class ScaleByLionState(NamedTuple):
    """``count`` and ``exp_avg``, Lion's single momentum buffer (as lion-pytorch names it)."""

    count: Tensor
    exp_avg: Params


def lion_leaf(g, buffers, p, step, beta1, beta2):
    """Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2: the step
    is ``sign(beta1 m + (1 - beta1) g)``; then ``m <- beta2 m + (1 - beta2) g``."""
    m = buffers["exp_avg"]
    return torch.sign(first_moment(m, g, beta1)), {"exp_avg": first_moment(m, g, beta2)}


def scale_by_lion(b1: Scalar = 0.9, b2: Scalar = 0.99) -> GradientTransformation:
    """Lion's sign step (before weight decay and ``-lr``).

    >>> tx = scale_by_lion()
    >>> tx.update([torch.tensor([3.0, -0.5, 0.0])], tx.init([torch.zeros(3)]))[0]
    [tensor([ 1., -1.,  0.])]
    """
    beta1, beta2 = check_betas((b1, b2), high_open=False)
    return family("scale_by_lion", ScaleByLionState, lion_leaf, dict(beta1=beta1, beta2=beta2))


def lion(lr: ScalarOrSchedule = 1e-4, betas: tuple[Any, Any] = (0.9, 0.99), weight_decay: Any = 0.0,
         *, maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """Lion with decoupled weight decay, ``p <- p - lr (sign(...) + wd p)`` (lion-pytorch's
    defaults; its ``decoupled_weight_decay=True`` is ``weight_decay=wd / lr``).

    >>> opt, params = lion(lr=0.1), {"w": torch.tensor([1.0, 1.0])}
    >>> opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9000, 1.1000])
    """
    return family_optimizer(scale_by_lion(*check_pair("betas", betas)), lr, maximize=maximize,
                            weight_decay=weight_decay, mask=mask, decoupled=True)


class ScaleByNadamState(NamedTuple):
    """``count``, ``mu_product`` (of the momentum schedule, float32 0-d as torch keeps it),
    ``exp_avg`` and ``exp_avg_sq``."""

    count: Tensor
    mu_product: Tensor
    exp_avg: Params
    exp_avg_sq: Params


def nadam_leaf(g, buffers, p, step, beta1, beta2, eps, grad_coef, avg_coef):
    """torch's ``_single_tensor_nadam`` (Dozat 2016): ``(grad_coef g + avg_coef m) /
    (sqrt(v_hat) + eps)``."""
    exp_avg = first_moment(buffers["exp_avg"], g, beta1)
    exp_avg_sq = second_moment(buffers["exp_avg_sq"], g, beta2)
    # sqrt(v / bc2) + eps = (sqrt(v) + eps sqrt(bc2)) / sqrt(bc2): a pass less over v
    root = sqrt(1 - beta2**step)
    denom = exp_avg_sq.sqrt() + eps * root
    direction = add_scaled(g * (grad_coef * root), exp_avg, avg_coef * root) / denom
    return direction, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def scale_by_nadam(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
                   momentum_decay: Scalar = 4e-3) -> GradientTransformation:
    """NAdam's step (before ``-lr``).

    >>> tx = scale_by_nadam()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1.0565, -1.0565])]
    """
    hyper = _adam_like(b1, b2, eps)
    beta1, momentum_decay = hyper["beta1"], checked("momentum_decay", momentum_decay, 0.0)

    def mu_at(step):  # Dozat 2016: mu_t = beta1 (1 - 0.5 * 0.96^(t * psi))
        return beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))

    def advance(step, mu_product):
        mu, mu_next = mu_at(step), mu_at(step + 1)
        mu_product = float32(mu_product * mu)  # torch keeps a float32 mu_product
        return {"mu_product": mu_product}, {"grad_coef": (1.0 - mu) / (1.0 - mu_product),
                                            "avg_coef": mu_next / (1.0 - mu_product * mu_next)}

    return family("scale_by_nadam", ScaleByNadamState, nadam_leaf, hyper, advance=advance,
                  scalars={"mu_product": lambda: torch.ones((), dtype=torch.float32, device="cpu")},
                  state_hyperparams=(momentum_decay,))


def nadam(lr: ScalarOrSchedule = 2e-3, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
          weight_decay: Any = 0.0, momentum_decay: Scalar = 4e-3,
          decoupled_weight_decay: bool = False, *, maximize: bool = False,
          mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.NAdam: L2 decay before the step, or decoupled decay (``p -= lr * wd * p``).

    >>> opt = nadam(lr=0.1, weight_decay=0.1, decoupled_weight_decay=True)
    >>> params = {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.8844])
    """
    return family_optimizer(scale_by_nadam(*check_pair("betas", betas), eps, momentum_decay),
                            lr, maximize=maximize, weight_decay=weight_decay, mask=mask,
                            decoupled=bool(decoupled_weight_decay))


class ScaleByRadamState(NamedTuple):
    """``count``, ``exp_avg`` and ``exp_avg_sq``, like torch.optim.RAdam's state."""

    count: Tensor
    exp_avg: Params
    exp_avg_sq: Params


def radam_leaf(g, buffers, p, step, beta1, beta2, eps):
    """Liu et al. 2020, Algorithm 2 (torch's ``_single_tensor_radam``): bias-corrected
    momentum while the approximated SMA ``rho_t <= 5``, then rectified by ``r_t``."""
    exp_avg = first_moment(buffers["exp_avg"], g, beta1)
    exp_avg_sq = second_moment(buffers["exp_avg_sq"], g, beta2)
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2**step / bias_correction2
    if not isinstance(rho_t, Tensor) and rho_t <= 5.0:
        return exp_avg / bias_correction1, new
    # The clip only keeps the (unused) early branch of torch.where finite under tracing.
    safe_rho = _clip(rho_t, 5.0, math.inf)
    rect = sqrt((safe_rho - 4) * (safe_rho - 2) * rho_inf
                / ((rho_inf - 4) * (rho_inf - 2) * safe_rho))
    # m_t / (1 - b1^t) * r_t * sqrt(1 - b2^t) / (sqrt(v_t) + eps), the scalars in one factor
    factor = rect * sqrt(bias_correction2) / bias_correction1
    rectified = exp_avg * factor / (exp_avg_sq.sqrt() + eps)
    return _where(rho_t > 5.0, rectified, exp_avg / bias_correction1), new


def scale_by_radam(b1: Scalar = 0.9, b2: Scalar = 0.999,
                   eps: Scalar = 1e-8) -> GradientTransformation:
    """RAdam's step (before ``-lr``): the first steps are plain momentum (SGD-like).

    >>> tx = scale_by_radam()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 3.0000, -0.5000])]
    """
    return family("scale_by_radam", ScaleByRadamState, radam_leaf, _adam_like(b1, b2, eps))


def radam(lr: ScalarOrSchedule = 1e-3, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
          weight_decay: Any = 0.0, decoupled_weight_decay: bool = False, *,
          maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.RAdam: L2 decay before the step, or decoupled decay (``p -= lr * wd * p``).

    >>> opt, params = radam(lr=0.1), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.8000])
    """
    return family_optimizer(scale_by_radam(*check_pair("betas", betas), eps), lr,
                            maximize=maximize, weight_decay=weight_decay, mask=mask,
                            decoupled=bool(decoupled_weight_decay))


# -- schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled") ---------------------
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

    >>> tx = scale_by_schedule_free_adamw(lr=0.1)
    >>> params = [torch.ones(2)]
    >>> updates, state = tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)
    >>> updates, state.z
    ([tensor([-0.1000,  0.1000])], [tensor([0.9000, 1.1000])])
    """
    if callable(lr) and not isinstance(lr, Tensor):
        raise ValueError("invalid lr: schedule-free AdamW needs no schedule; pass a number (and "
                         "warmup_steps for a warmup)")
    base_lr = checked("lr", one_lr(lr), 0.0)
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
        lr_t = base_lr * _clip(step / max(warmup_steps, 1), 0.0, 1.0)
        if isinstance(lr_t, Tensor) or isinstance(lr_max, Tensor):
            device = (lr_t if isinstance(lr_t, Tensor) else lr_max).device
            lr_max = torch.maximum(torch.as_tensor(lr_t, dtype=torch.float64, device=device),
                                   torch.as_tensor(lr_max, dtype=torch.float64, device=device))
        else:
            lr_max = max(lr_t, lr_max)
        weight = step**r * lr_max**weight_lr_power
        weight_sum = weight_sum + weight
        zero = weight_sum == 0
        ckp1 = _where(zero, 0.0, weight / _where(zero, 1.0, weight_sum))
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


def schedule_free_adamw(lr: Any = 0.0025, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
                        weight_decay: Scalar = 0.0, warmup_steps: int = 0, r: Scalar = 0.0,
                        weight_lr_power: Scalar = 2.0, *, maximize: bool = False) -> Optimizer:
    """``schedulefree.AdamWScheduleFree`` (its names and defaults): the params it updates are
    the training point ``y``; evaluate at ``schedule_free_eval_params(state, params)``.

    >>> opt, params = schedule_free_adamw(lr=0.1), {"w": torch.ones(2)}
    >>> state = opt.init(params)
    >>> for _ in range(3):
    ...     params, state = opt.update({"w": torch.tensor([1.0, -1.0])}, state, params)
    >>> params["w"], schedule_free_eval_params(state, params)["w"]
    (tensor([0.7900, 1.2100]), tensor([0.8000, 1.2000]))
    """
    return family_optimizer(scale_by_schedule_free_adamw(
        lr, betas, eps, weight_decay, warmup_steps, r, weight_lr_power), maximize=maximize)


def schedule_free_eval_params(state: Any, params: Params) -> Params:
    """The averaged point ``x = y + (1 - 1/b1) (z - y)`` to evaluate at (pure), from the state
    of :func:`schedule_free_adamw` or of a chain holding its rule.

    >>> opt, params = schedule_free_adamw(lr=0.1), {"w": torch.ones(2)}
    >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> schedule_free_eval_params(state, params)
    {'w': tensor([0.9000, 0.9000])}
    """
    found = _pytree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ScheduleFreeAdamwState))
    inner = next((x for x in found if isinstance(x, ScheduleFreeAdamwState)), None)
    if inner is None:  # it may sit in a chain's tuple or multi_transform's dict
        raise ValueError(
            "schedule_free_eval_params expects the state of mt.optim.schedule_free_adamw "
            f"(or a chain with scale_by_schedule_free_adamw), got {type(state).__name__}")
    weight = 1 - 1 / float(inner.b1)
    return tree.map(lambda y, z: torch.lerp(y, z.to(y.dtype), weight), params, inner.z)
