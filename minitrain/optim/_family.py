"""The torch.optim family beyond Adam, SGD, AdaGrad and RMSprop, and Lion: each a per-leaf rule
made the transformation ``scale_by_<name>`` by :func:`family`, and an alias chaining it in
torch's order. Here the rules scaled by ``-lr``; ``_family_steps`` those that are the step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import (
    Scalar,
    WeightDecayMask,
    check_betas,
    check_maximize,
    check_pair,
    checked,
    float32,
    is_traced,
    is_zero,
    lerp_weight,
)
from minitrain.optim.alias import torch_order
from minitrain.optim.base import GradientTransformation, Optimizer, ScalarOrSchedule, as_optimizer
from minitrain.optim.leafwise import leafwise
from minitrain.optim.transforms import add_decayed_weights, add_scaled, sqrt, zeros
from minitrain.tree import Params

__all__ = [
    "adadelta", "scale_by_adadelta", "ScaleByAdadeltaState",
    "adamax", "scale_by_adamax", "ScaleByAdamaxState",
    "lion", "scale_by_lion", "ScaleByLionState",
    "nadam", "scale_by_nadam", "ScaleByNadamState",
    "radam", "scale_by_radam", "ScaleByRadamState",
]


class Rule(NamedTuple):
    """What the lowering reads of a family transformation (its spec's ``rule``). The
    hyperparameters reaching the update only through ``advance`` or the state (schedule-free's lr,
    NAdam's momentum_decay) keep it off the kernels when traced."""

    name: str
    scalars: dict[str, Callable[[], Tensor]] | None
    advance: Callable[..., Any] | None
    state_hyperparams: tuple[Any, ...]


def family(name: str, state_type: type, update_leaf: Callable[..., Any],
           hyperparams: dict[str, Any], *, init_leaf: Callable[[Tensor], dict] | None = None,
           scalars: dict[str, Callable[[], Tensor]] | None = None,
           advance: Callable[..., Any] | None = None, needs_params: bool = False,
           state_hyperparams: tuple[Any, ...] = ()) -> GradientTransformation:
    """:func:`leafwise` of a rule (its buffers zeros unless ``init_leaf``), its spec carrying
    the :class:`Rule`."""
    buffers = state_type._fields[1 + len(scalars or {}):]
    tx = leafwise(name, init_leaf or (lambda p: {key: zeros(p) for key in buffers}),
                  update_leaf, state_type, hyperparams, needs_params=needs_params,
                  scalars=scalars, advance=advance)
    tx.update.minitrain_spec[1]["rule"] = Rule(name, scalars, advance, state_hyperparams)
    return tx


def family_optimizer(tx: GradientTransformation, lr: Any = None, *, maximize: bool = False,
                     weight_decay: Any = 0.0, mask: WeightDecayMask = None,
                     decoupled: bool = False) -> Optimizer:
    """``tx`` in torch's order (:func:`torch_order`); with ``lr=None`` it is the whole step."""
    check_maximize(maximize)
    weight_decay = checked("weight_decay", weight_decay, 0.0)
    decay = None if is_zero(weight_decay) else add_decayed_weights(weight_decay, mask)
    return as_optimizer(torch_order([tx], lr, maximize=maximize, decay=decay,
                                    decoupled=decoupled), strict=True)


def find_state(state: Any, state_type: type) -> Any:
    """The first ``state_type`` in ``state`` (chains' tuples and ``multi_transform``'s dicts
    included), or None."""
    if isinstance(state, state_type):
        return state
    if isinstance(state, tuple | list | dict):
        for inner in state.values() if isinstance(state, dict) else state:
            found = find_state(inner, state_type)
            if found is not None:
                return found
    return None


def second_moment(exp_avg_sq: Any, g: Any, beta2: Any) -> Any:
    """torch's ``exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)`` (the kernel's order
    for a traced ``beta2`` or one that requires grad)."""
    if is_traced(beta2) or (isinstance(beta2, Tensor) and beta2.requires_grad):
        return beta2 * exp_avg_sq + (1 - beta2) * g * g
    return torch.addcmul(beta2 * exp_avg_sq, g, g, value=1 - beta2)


def first_moment(exp_avg: Any, g: Any, beta1: Any) -> Any:
    """torch's ``exp_avg.lerp_(g, 1 - beta1)``."""
    return torch.lerp(exp_avg, g, lerp_weight(1 - beta1, exp_avg))


def _adam_like(b1: Any, b2: Any, eps: Any) -> dict[str, Any]:
    beta1, beta2 = check_betas((b1, b2))
    return dict(beta1=beta1, beta2=beta2, eps=checked("eps", eps, 0.0))


# -- Adadelta ---------------------------------------------------------------------------------


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

    >>> import torch
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

    >>> import torch
    >>> opt, params = adadelta(lr=1.0, rho=0.0), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9990])
    """
    return family_optimizer(scale_by_adadelta(rho, eps), lr, maximize=maximize,
                            weight_decay=weight_decay, mask=mask)


# -- Adamax -----------------------------------------------------------------------------------


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

    >>> import torch
    >>> tx = scale_by_adamax()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1., -1.])]
    """
    return family("scale_by_adamax", ScaleByAdamaxState, adamax_leaf, _adam_like(b1, b2, eps))


def adamax(lr: ScalarOrSchedule = 2e-3, betas: tuple[Any, Any] = (0.9, 0.999),
           eps: Scalar = 1e-8, weight_decay: Any = 0.0, *, maximize: bool = False,
           mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.Adamax: L2 weight decay, then Adamax's step, times ``-lr``.

    >>> import torch
    >>> opt, params = adamax(lr=0.1), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9000])
    """
    return family_optimizer(scale_by_adamax(*check_pair("betas", betas), eps), lr,
                            maximize=maximize, weight_decay=weight_decay, mask=mask)


# -- Lion -------------------------------------------------------------------------------------


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

    >>> import torch
    >>> tx = scale_by_lion()
    >>> tx.update([torch.tensor([3.0, -0.5, 0.0])], tx.init([torch.zeros(3)]))[0]
    [tensor([ 1., -1.,  0.])]
    """
    beta1, beta2 = check_betas((b1, b2), high_open=False)
    return family("scale_by_lion", ScaleByLionState, lion_leaf, dict(beta1=beta1, beta2=beta2))


def lion(lr: ScalarOrSchedule = 1e-4, betas: tuple[Any, Any] = (0.9, 0.99),
         weight_decay: Any = 0.0, *, maximize: bool = False,
         mask: WeightDecayMask = None) -> Optimizer:
    """Lion with decoupled weight decay, ``p <- p - lr (sign(...) + wd p)`` (lion-pytorch's
    defaults; its ``decoupled_weight_decay=True`` is ``weight_decay=wd / lr``).

    >>> import torch
    >>> opt, params = lion(lr=0.1), {"w": torch.tensor([1.0, 1.0])}
    >>> opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9000, 1.1000])
    """
    return family_optimizer(scale_by_lion(*check_pair("betas", betas)), lr, maximize=maximize,
                            weight_decay=weight_decay, mask=mask, decoupled=True)


# -- NAdam ------------------------------------------------------------------------------------


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

    >>> import torch
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

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.nadam(lr=0.1, weight_decay=0.1, decoupled_weight_decay=True)
    >>> params = {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.8844])
    """
    return family_optimizer(scale_by_nadam(*check_pair("betas", betas), eps, momentum_decay),
                            lr, maximize=maximize, weight_decay=weight_decay, mask=mask,
                            decoupled=bool(decoupled_weight_decay))


# -- RAdam ------------------------------------------------------------------------------------


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
    traced = isinstance(rho_t, Tensor)
    if not traced and rho_t <= 5.0:
        return exp_avg / bias_correction1, new
    # The clamp only keeps the (unused) early branch of torch.where finite under tracing.
    safe_rho = rho_t.clamp(min=5.0) if traced else rho_t
    rect = sqrt((safe_rho - 4) * (safe_rho - 2) * rho_inf
                / ((rho_inf - 4) * (rho_inf - 2) * safe_rho))
    # m_t / (1 - b1^t) * r_t * sqrt(1 - b2^t) / (sqrt(v_t) + eps), the scalars in one factor
    factor = rect * sqrt(bias_correction2) / bias_correction1
    rectified = exp_avg * factor / (exp_avg_sq.sqrt() + eps)
    if traced:
        return torch.where(rho_t > 5.0, rectified, exp_avg / bias_correction1), new
    return rectified, new


def scale_by_radam(b1: Scalar = 0.9, b2: Scalar = 0.999,
                   eps: Scalar = 1e-8) -> GradientTransformation:
    """RAdam's step (before ``-lr``): the first steps are plain momentum (SGD-like).

    >>> import torch
    >>> tx = scale_by_radam()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 3.0000, -0.5000])]
    """
    return family("scale_by_radam", ScaleByRadamState, radam_leaf, _adam_like(b1, b2, eps))


def radam(lr: ScalarOrSchedule = 1e-3, betas: tuple[Any, Any] = (0.9, 0.999), eps: Scalar = 1e-8,
          weight_decay: Any = 0.0, decoupled_weight_decay: bool = False, *,
          maximize: bool = False, mask: WeightDecayMask = None) -> Optimizer:
    """torch.optim.RAdam: L2 decay before the step, or decoupled decay (``p -= lr * wd * p``).

    >>> import torch
    >>> opt, params = radam(lr=0.1), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.8000])
    """
    return family_optimizer(scale_by_radam(*check_pair("betas", betas), eps), lr,
                            maximize=maximize, weight_decay=weight_decay, mask=mask,
                            decoupled=bool(decoupled_weight_decay))
