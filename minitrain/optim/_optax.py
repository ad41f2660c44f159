"""optax's optimizers that torch.optim lacks (optax ``_src/transform.py``, ``alias.py``), with
optax's names, arguments and defaults (``lr`` first, as in every alias here)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import (
    Scalar,
    WeightDecayMask,
    check_hyperparameter,
    check_like,
    check_state_type,
    checked,
    one_lr,
    zero_count,
)
from minitrain.optim._wrappers import masked
from minitrain.optim.base import (
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    as_optimizer,
    chain,
    check_transformation,
    forwards_extra_args,
    tagged,
)
from minitrain.optim.leafwise import leafwise
from minitrain.optim.transforms import (
    _stateless,
    add_decayed_weights,
    filled,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)
from minitrain.tree import Params

__all__ = [
    "scale_by_belief", "ScaleByBeliefState", "adabelief", "scale_by_yogi", "ScaleByYogiState",
    "yogi", "scale_by_trust_ratio", "lamb", "lars", "scale_by_polyak", "polyak_sgd",
    "ema_updates", "EmaUpdatesState", "lookahead", "LookaheadParams", "LookaheadState",
]


def _moment(old: Any, g: Any, decay: Any) -> Any:
    """optax ``tree.update_moment``: ``(1 - decay) g + decay old``."""
    return (1 - decay) * g + decay * old


def _hyper(b1: Any, b2: Any, eps: Any, eps_root: Any) -> dict[str, Any]:
    check_hyperparameter("b1", b1, 0.0, 1.0, high_open=True)
    check_hyperparameter("b2", b2, 0.0, 1.0, high_open=True)
    return dict(beta1=b1, beta2=b2, eps=checked("eps", eps, 0.0),
                eps_root=checked("eps_root", eps_root, 0.0))


# -- AdaBelief (Zhuang et al. 2020) and Yogi (Zaheer et al. 2018) -----------------------------


class ScaleByBeliefState(NamedTuple):
    """``count``, ``mu`` (EMA of the updates), ``nu`` (EMA of their squared surprise)."""

    count: Tensor
    mu: Params
    nu: Params


def belief_leaf(g, buffers, p, step, beta1, beta2, eps, eps_root, nesterov):
    """optax ``scale_by_belief``: ``s = b2 s + (1 - b2) (g - m)² + eps_root``; the update is
    ``m_hat / (sqrt(s_hat) + eps)`` (Nesterov: ``b1 m_hat(t+1) + (1 - b1) g_hat``)."""
    mu = _moment(buffers["mu"], g, beta1)
    error = g - mu
    nu = _moment(buffers["nu"], error * error, beta2) + eps_root
    mu_hat = (mu * beta1 / (1 - beta1 ** (step + 1)) + g * (1 - beta1) / (1 - beta1**step)
              if nesterov else mu / (1 - beta1**step))
    return mu_hat / ((nu / (1 - beta2**step)).sqrt() + eps), {"mu": mu, "nu": nu}


def scale_by_belief(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-16,
                    eps_root: Scalar = 1e-16, *, nesterov: bool = False) -> GradientTransformation:
    """AdaBelief's direction (before ``-lr``).

    >>> tx = scale_by_belief()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1.1111, -1.1111])]
    """
    hyper = dict(_hyper(b1, b2, eps, eps_root), nesterov=bool(nesterov))
    return leafwise("scale_by_belief", None, belief_leaf, ScaleByBeliefState, hyper)


def adabelief(lr: ScalarOrSchedule = 1e-3, b1: Scalar = 0.9, b2: Scalar = 0.999,
              eps: Scalar = 1e-16, eps_root: Scalar = 1e-16, weight_decay: Any = None,
              weight_decay_mask: WeightDecayMask = None, *, nesterov: bool = False) -> Optimizer:
    """optax ``adabelief``: ``scale_by_belief``, decoupled decay when given, ``-lr``.

    >>> opt, params = adabelief(lr=0.1), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.8889])
    """
    decay = [] if weight_decay is None else [add_decayed_weights(weight_decay, weight_decay_mask)]
    return as_optimizer(chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov),
                              *decay, scale_by_learning_rate(one_lr(lr))))


class ScaleByYogiState(NamedTuple):
    """``count``, ``mu`` and ``nu`` (Yogi's additive second moment)."""

    count: Tensor
    mu: Params
    nu: Params


def yogi_leaf(g, buffers, p, step, beta1, beta2, eps, eps_root):
    """optax ``scale_by_yogi``: ``v = v - (1 - b2) sign(v - g²) g²``; the update is
    ``m_hat / (sqrt(v_hat + eps_root) + eps)``."""
    mu = _moment(buffers["mu"], g, beta1)
    square = g * g
    nu = buffers["nu"] - (1 - beta2) * torch.sign(buffers["nu"] - square) * square
    nu_hat = nu / (1 - beta2**step)
    return mu / (1 - beta1**step) / ((nu_hat + eps_root).sqrt() + eps), {"mu": mu, "nu": nu}


def scale_by_yogi(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-3, eps_root: Scalar = 0.0,
                  initial_accumulator_value: Scalar = 1e-6) -> GradientTransformation:
    """Yogi's direction (before ``-lr``); both moments start at ``initial_accumulator_value``.

    >>> tx = scale_by_yogi()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 0.9996, -0.9960])]
    """
    initial = checked("initial_accumulator_value", initial_accumulator_value, 0.0)
    return leafwise("scale_by_yogi", lambda p: {"mu": filled(p, initial), "nu": filled(p, initial)},
                    yogi_leaf, ScaleByYogiState, _hyper(b1, b2, eps, eps_root),
                    also_watch=(initial,) if isinstance(initial, Tensor) else ())


def yogi(lr: ScalarOrSchedule = 1e-2, b1: Scalar = 0.9, b2: Scalar = 0.999,
         eps: Scalar = 1e-3) -> Optimizer:
    """optax ``yogi``: ``scale_by_yogi``, then ``-lr``.

    >>> opt, params = yogi(lr=0.1), {"w": torch.tensor([1.0])}
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init(params), params)[0]["w"]
    tensor([0.9001])
    """
    return as_optimizer(chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(one_lr(lr))))


# -- the trust ratio: LAMB (You et al. 2020) and LARS (You et al. 2017) -----------------------


def scale_by_trust_ratio(min_norm: Scalar = 0.0, trust_coefficient: Scalar = 1.0,
                         eps: Scalar = 0.0) -> GradientTransformation:
    """Scale each leaf's update by ``trust_coefficient ||p|| / (||u|| + eps)`` (1 where either
    norm is 0), optax's ``scale_by_trust_ratio``.

    >>> tx, params = scale_by_trust_ratio(), [torch.tensor([3.0, 4.0])]
    >>> tx.update([torch.tensor([0.0, 0.5])], tx.init(params), params)[0]
    [tensor([0., 5.])]
    """
    min_norm, eps = checked("min_norm", min_norm, 0.0), checked("eps", eps, 0.0)
    trust_coefficient = checked("trust_coefficient", trust_coefficient, 0.0)

    def scaled(u: Tensor, p: Tensor) -> Tensor:
        # optax numerics.safe_norm: ||x||, or min_norm where that is not above it
        p_norm, u_norm = (torch.linalg.vector_norm(x).clamp(min=min_norm) for x in (p, u))
        ratio = trust_coefficient * p_norm / (u_norm + eps)
        return u * torch.where((p_norm == 0) | (u_norm == 0), 1.0, ratio).to(u.dtype)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_trust_ratio needs params: call update(updates, state, "
                             "params)")
        check_like(params, updates, ("params", "updates"))
        return tree.map(scaled, updates, params), state

    return _stateless("scale_by_trust_ratio", update, min_norm=min_norm,
                      trust_coefficient=trust_coefficient, eps=eps)


def lamb(lr: ScalarOrSchedule = 1e-3, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-6,
         eps_root: Scalar = 0.0, weight_decay: Any = 0.0,
         mask: WeightDecayMask = None) -> Optimizer:
    """optax ``lamb``: Adam's direction plus decoupled decay, scaled by the trust ratio.

    >>> opt, params = lamb(lr=0.1), {"w": torch.tensor([3.0, 4.0])}
    >>> opt.update({"w": torch.tensor([1.0, 1.0])}, opt.init(params), params)[0]["w"]
    tensor([2.6464, 3.6464])
    """
    return as_optimizer(chain(scale_by_adam(b1, b2, eps, eps_root=eps_root),
                              add_decayed_weights(weight_decay, mask), scale_by_trust_ratio(),
                              scale_by_learning_rate(one_lr(lr))))


def lars(lr: ScalarOrSchedule = 1.0, weight_decay: Any = 0.0,
         weight_decay_mask: WeightDecayMask = None, trust_coefficient: Scalar = 0.001,
         eps: Scalar = 0.0, trust_ratio_mask: Any = None, momentum: Scalar = 0.9,
         nesterov: bool = False) -> Optimizer:
    """optax ``lars``: decay, the trust ratio (on the leaves ``trust_ratio_mask`` selects; None:
    all), ``-lr``, then momentum (optax's ``trace``, which is torch.optim.SGD's).

    >>> opt, params = lars(lr=1.0), {"w": torch.tensor([3.0, 4.0])}
    >>> opt.update({"w": torch.tensor([1.0, 1.0])}, opt.init(params), params)[0]["w"]
    tensor([2.9965, 3.9965])
    """
    trust = scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)
    return as_optimizer(chain(
        add_decayed_weights(weight_decay, weight_decay_mask),
        trust if trust_ratio_mask is None else masked(trust, trust_ratio_mask),
        scale_by_learning_rate(one_lr(lr)), trace(momentum, nesterov=nesterov)))


# -- Polyak's step size (Loizou et al. 2021, "stochastic Polyak step-size") -------------------


def scale_by_polyak(f_min: Scalar = 0.0, max_learning_rate: Scalar = 1.0, eps: Scalar = 0.0,
                    variant: str = "sps") -> GradientTransformation:
    """Scale by ``min((f - f_min) / (||g||² + eps), max_learning_rate)`` (0 where ``||g||² +
    eps`` is within the dtype's eps of 0), ``f`` the loss passed as ``update(..., value=f)``;
    ``"sps+"`` clips the gap at 0 (optax ``scale_by_polyak``).

    >>> tx = scale_by_polyak()
    >>> tx.update([torch.tensor([3.0, 4.0])], tx.init([torch.zeros(2)]), value=5.0)[0]
    [tensor([0.6000, 0.8000])]
    """
    if variant not in ("sps", "sps+"):
        raise ValueError(f"invalid variant={variant!r}: choose 'sps' or 'sps+'")
    f_min, eps = checked("f_min", f_min, -float("inf")), checked("eps", eps, 0.0)
    max_learning_rate = checked("max_learning_rate", max_learning_rate, 0.0)

    def update(updates, state, params=None, *, value=None):
        if value is None:
            raise ValueError("scale_by_polyak needs the loss: call update(updates, state, "
                             "params, value=loss)")
        leaves = tree.leaves(updates)
        if not leaves:
            return updates, state
        squared = torch.stack([(u * u).sum() for u in leaves]).sum()  # optax tree.norm(squared)
        gap = torch.as_tensor(value).to(squared) - f_min
        if variant == "sps+":
            gap = gap.clamp(min=0)
        denom = squared + eps
        step = torch.where(denom <= torch.finfo(denom.dtype).eps, 0.0,
                           torch.clamp(gap / denom, max=max_learning_rate))
        return tree.map(lambda u: u * step.to(u.dtype), updates), state

    return _stateless("scale_by_polyak", update, f_min=f_min,
                      max_learning_rate=max_learning_rate, eps=eps, variant=variant)


def polyak_sgd(max_learning_rate: Scalar = 1.0, scaling: ScalarOrSchedule = 1.0,
               f_min: Scalar = 0.0, eps: Scalar = 0.0, variant: str = "sps") -> Optimizer:
    """optax ``polyak_sgd``: ``-scaling * g``, then Polyak's step size; pass the loss as
    ``opt.update(grads, state, params, value=loss)``.

    >>> opt, params = polyak_sgd(), {"w": torch.tensor([3.0, 4.0])}
    >>> opt.update({"w": params["w"]}, opt.init(params), params, value=12.5)[0]["w"]
    tensor([1.5000, 2.0000])
    """
    return as_optimizer(chain(scale_by_learning_rate(one_lr(scaling, "scaling")),
                              scale_by_polyak(f_min, max_learning_rate, eps, variant)))


# -- an EMA of the updates (optax ``ema``; ``mt.optim.ema`` averages the params) --------------


class EmaUpdatesState(NamedTuple):
    """``count`` and ``ema``, the average of the updates."""

    count: Tensor
    ema: Params


def ema_updates_leaf(g, buffers, p, step, decay, debias):
    """``ema = (1 - decay) g + decay ema``, divided by ``1 - decay^t`` when ``debias``."""
    ema = _moment(buffers["ema"], g, decay)
    return (ema / (1 - decay**step) if debias else ema), {"ema": ema}


def ema_updates(decay: Scalar, debias: bool = True) -> GradientTransformation:
    """Replace the updates by their exponential moving average: optax's ``ema`` (named apart
    from :func:`~minitrain.optim.ema`, which averages the params).

    >>> tx = ema_updates(0.5, debias=False)
    >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
    [tensor([1.])]
    """
    decay = checked("decay", decay, 0.0, 1.0)
    return leafwise("ema_updates", None, ema_updates_leaf, EmaUpdatesState,
                    dict(decay=decay, debias=bool(debias)))


# -- Lookahead (Zhang et al. 2019, "Lookahead Optimizer: k steps forward, 1 step back") --------


class LookaheadParams(NamedTuple):
    """The fast params (take grads here) and the slow ones (evaluate here)."""

    fast: Params
    slow: Params

    @classmethod
    def init_synced(cls, params: Params) -> LookaheadParams:
        """Both halves at ``params``."""
        return cls(fast=params, slow=params)


class LookaheadState(NamedTuple):
    """The fast optimizer's state and the updates since the last sync."""

    fast_state: Any
    steps_since_sync: Tensor


def lookahead(fast_optimizer: GradientTransformation, sync_period: int,
              slow_step_size: float | Tensor, reset_state: bool = False) -> GradientTransformation:
    """optax ``lookahead``: ``fast_optimizer`` steps the fast params; every ``sync_period``
    steps the slow ones move ``slow_step_size`` of the way to them and the fast ones jump there
    (``reset_state``: re-init its state then). Params and updates are :class:`LookaheadParams`.

    >>> opt = as_optimizer(lookahead(scale_by_learning_rate(1.0), 2, 0.5))
    >>> params = LookaheadParams.init_synced([torch.zeros(1)])
    >>> state = opt.init(params)
    >>> for _ in range(2):
    ...     params, state = opt.update([torch.ones(1)], state, params)
    >>> params  # fast: -1, then -2 and synced to slow = 0 + 0.5 (-2 - 0)
    LookaheadParams(fast=[tensor([-1.])], slow=[tensor([-1.])])
    """
    check_transformation(fast_optimizer, "lookahead's fast_optimizer")
    if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period < 1:
        raise ValueError(f"invalid sync_period={sync_period!r}: pass an int >= 1")
    slow_step_size = checked("slow_step_size", slow_step_size, 0.0, 1.0)

    def init(params):
        fast = params.fast if isinstance(params, LookaheadParams) else params
        return LookaheadState(fast_optimizer.init(fast), zero_count())

    def update(updates, state, params=None, **extra):
        check_state_type("lookahead", LookaheadState, state)
        if not isinstance(params, LookaheadParams):
            raise ValueError("lookahead needs params=LookaheadParams(fast, slow) (see "
                             "LookaheadParams.init_synced), with grads taken at params.fast")
        updates, fast_state = fast_optimizer.update(updates, state.fast_state, params.fast, **extra)
        sync = state.steps_since_sync == sync_period - 1
        # optax _lookahead_update: d = fast + u - slow; slow += a d; fast += u - (1 - a) d
        diff = tree.map(lambda f, u, s: f + u - s, params.fast, updates, params.slow)
        slow = tree.map(lambda d: d * (sync.to(d.dtype) * slow_step_size), diff)
        fast = tree.map(lambda u, d: u - d * (sync.to(d.dtype) * (1 - slow_step_size)),
                        updates, diff)
        if reset_state:
            fresh = fast_optimizer.init(params.fast)
            fast_state = tree.map(lambda now, new: torch.where(sync, new, now), fast_state, fresh)
        return LookaheadParams(fast, slow), LookaheadState(
            fast_state, (state.steps_since_sync + 1) % sync_period)

    forwards_extra_args(update, [fast_optimizer])
    return tagged("lookahead", GradientTransformation(init, update), inner=fast_optimizer,
                  sync_period=sync_period, slow_step_size=slow_step_size)
