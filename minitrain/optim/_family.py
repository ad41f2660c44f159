"""Plumbing shared by the torch.optim family beyond Adam: the descent prefix, step numbers,
and per-leaf rules whose state also holds a few scalars (NAdam's ``mu_product``, schedule-free
AdamW's ``weight_sum``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import (
    WeightDecayMask,
    check_hyperparameter,
    check_pair,
    hyperparameter,
    scalar,
)
from minitrain.optim._host import is_traced, next_step
from minitrain.optim._transforms_rules import add_decayed_weights, scale, scale_by_learning_rate
from minitrain.optim.base import GradientTransformation, Optimizer, as_optimizer, chain, tagged
from minitrain.optim.leafwise import leafwise
from minitrain.tree import Params

__all__ = [
    "Scalar",
    "add_scaled",
    "leafwise_with_scalars",
    "zeros",
    "second_moment",
    "check_range",
    "check_betas",
    "find_state",
    "torch_order",
    "Rule",
    "moments_rule",
    "rule_transform",
    "family_optimizer",
]


Scalar = int | float | Tensor
"""A hyperparameter: a number or a one-element tensor (squeezed to 0-d like torch.optim)."""


def add_scaled(x: Any, y: Any, alpha: Any) -> Any:
    """``x + alpha * y`` in one pass (``torch.add(x, y, alpha=alpha)``) when ``alpha`` is a
    number; with a tensor ``alpha`` (traced, or a tensor hyperparameter) as two ops."""
    if isinstance(alpha, Tensor):
        return x + alpha * y
    return torch.add(x, y, alpha=alpha)


def zeros(p: Tensor) -> Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def second_moment(exp_avg_sq: Any, g: Any, beta2: Any) -> Any:
    """torch's ``exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)``; with a traced
    ``beta2`` (``vmap`` over betas) or one that requires grad, whose ``1 - beta2`` cannot be
    ``addcmul``'s number, the same products in the kernel's order, ``beta2 v + ((1 - beta2) g)
    g`` (differentiable in ``beta2``)."""
    if is_traced(beta2) or (isinstance(beta2, Tensor) and beta2.requires_grad):
        return beta2 * exp_avg_sq + (1 - beta2) * g * g
    return torch.addcmul(beta2 * exp_avg_sq, g, g, value=1 - beta2)


def check_range(name: str, value: Any, low: float, high: float = float("inf"), **open_ends):
    """``value`` as torch.optim takes it (see ``hyperparameter``), checked to lie in range."""
    value = hyperparameter(name, value)
    check_hyperparameter(name, value, low, high, **open_ends)
    return value


def check_betas(betas: Any, high: float = 1.0, high_open: bool = True) -> tuple[Any, Any]:
    """torch.optim's ``betas``: two numbers or two tensors, each in ``[0, high)`` (``[0, high]``
    with ``high_open=False``, as Lion allows).

    >>> check_betas((0.9, 1.0))
    Traceback (most recent call last):
    ...
    ValueError: invalid betas[1]=1.0: it must lie in [0.0, 1.0); pass a value in that range
    """
    beta1, beta2 = check_pair("betas", betas)
    check_hyperparameter("betas[0]", beta1, 0.0, high, high_open=high_open)
    check_hyperparameter("betas[1]", beta2, 0.0, high, high_open=high_open)
    return beta1, beta2


def torch_order(rule: list[GradientTransformation], lr: Any, *, maximize: bool = False,
                decay: GradientTransformation | None = None,
                decoupled: bool = False) -> GradientTransformation:
    """torch.optim's order as a chain: ``-g`` when maximizing, the L2 ``decay`` (``g + wd p``)
    before the ``rule``'s transformations or, ``decoupled``, after them, then ``-lr`` (none for
    ``lr=None``: the rule's output is the whole step).

    >>> import minitrain as mt
    >>> tx = torch_order([mt.optim.scale_by_adam()], 1e-3, maximize=True)
    >>> [mt.optim.spec(t)[0] for t in mt.optim.spec(tx)[1]["transforms"]]
    ['scale', 'scale_by_adam', 'scale_by_learning_rate']
    """
    return chain(
        *([scale(-1.0)] if maximize else []),
        *([decay] if decay is not None and not decoupled else []),
        *rule,
        *([decay] if decay is not None and decoupled else []),
        *([scale_by_learning_rate(lr)] if lr is not None else []),
    )


def find_state(state: Any, state_type: type) -> Any:
    """The first ``state_type`` in ``state``, looking inside chains' tuples and
    ``multi_transform``'s dicts of states in order; None when there is none.

    >>> import torch, minitrain as mt
    >>> tx = mt.optim.chain(mt.optim.clip(1.0), mt.optim.scale_by_lion())
    >>> type(find_state(tx.init([torch.zeros(2)]), mt.optim.ScaleByLionState)).__name__
    'ScaleByLionState'
    """
    if isinstance(state, state_type):
        return state
    if isinstance(state, tuple | list | dict):
        for inner in state.values() if isinstance(state, dict) else state:
            found = find_state(inner, state_type)
            if found is not None:
                return found
    return None


def leafwise_with_scalars(
    name: str,
    state_type: type,
    scalars: dict[str, Callable[[], Tensor]],
    advance: Callable[..., tuple[dict[str, Any], dict[str, Any]]],
    init_leaf: Callable[[Tensor], dict[str, Tensor]],
    update_leaf: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    hyperparams: dict[str, Any],
    *,
    needs_params: bool = False,
) -> GradientTransformation:
    """A per-leaf rule (:func:`~minitrain.optim.leafwise`) whose state also keeps 0-d scalars.

    ``state_type`` has fields ``count``, then the names in ``scalars`` (each made by its
    function at init), then the buffers of ``init_leaf``. Per update,
    ``advance(step, **scalars) -> (new_scalars, per_step)`` gives the next scalars and extra
    keyword arguments for ``update_leaf``; the scalars come as plain numbers, or as 0-d
    tensors when traced or when they require grad.
    """
    fields = state_type._fields
    names = tuple(scalars)
    if fields[: 1 + len(names)] != ("count", *names):
        raise ValueError(f"{name}: state_type fields must be count, then {names}")
    buffers = fields[1 + len(names):]
    leaf_state = NamedTuple(f"{state_type.__name__}Buffers",  # type: ignore[misc]
                            [("count", Tensor), *((b, Any) for b in buffers)])
    hyper = {key: hyperparameter(key, value) for key, value in hyperparams.items()}
    template = leafwise(name, init_leaf, update_leaf, leaf_state, hyper,
                        needs_params=needs_params)

    def init(params: Params):
        inner = template.init(params)
        return state_type(inner.count, *(make() for make in scalars.values()), *inner[1:])

    def update(updates, state, params=None):
        if not isinstance(state, state_type):
            raise ValueError(
                f"{name} expected a {state_type.__name__}, got {type(state).__name__}; "
                f"pass the state returned by its init(params)"
            )
        old = {key: getattr(state, key) for key in names}
        traced = is_traced(state.count) or any(is_traced(v) for v in old.values())
        step = next_step(state.count)
        # A scalar that requires grad stays a tensor: its history (NAdam's mu_product as a
        # function of beta1) is part of the hypergradient.
        values = old if traced else {key: v if _requires_grad(v) else scalar(v)
                                     for key, v in old.items()}
        new_scalars, per_step = advance(step, **values)
        # A traced scalar, or one that requires grad, may carry into the buffers a
        # hyperparameter that update_leaf never sees (Rprop's lr, its initial step sizes):
        # leafwise watches them too, so that the plain path runs.
        rule = leafwise(name, init_leaf, update_leaf, leaf_state, {**hyper, **per_step},
                        needs_params=needs_params, also_watch=tuple(old.values()))
        inner = leaf_state(state.count, *(getattr(state, b) for b in buffers))
        updates, inner = rule.update(updates, inner, params)
        kept = {key: _like(new_scalars[key], old[key]) for key in names}
        return updates, state_type(inner.count, **kept,
                                   **{b: getattr(inner, b) for b in buffers})

    return tagged(name, GradientTransformation(init, update), update_leaf=update_leaf, **hyper)


def _requires_grad(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


def _like(value: Any, old: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(old.dtype)
    return torch.tensor(value, dtype=old.dtype, device=old.device)


# --------------------------------------------------------------------------------------------
# A rule, its chain, and the chain's fast path


class Rule(NamedTuple):
    """What a family member contributes: a per-leaf rule (:func:`leafwise`'s contract), and
    for rules that keep scalars, their initial values and ``advance`` (see
    :func:`leafwise_with_scalars`)."""

    name: str
    state_type: type
    init_leaf: Callable[[Tensor], dict[str, Tensor]]
    update_leaf: Callable[..., Any]
    hyperparams: dict[str, Any]
    scalars: dict[str, Callable[[], Tensor]] | None = None
    advance: Callable[..., Any] | None = None
    needs_params: bool = False
    # The hyperparameters that reach the rule only through ``advance`` or its initial state
    # (ASGD's lr and alpha, NAdam's momentum_decay): a traced one, or one that requires grad,
    # keeps the update off the fast path, as one of ``hyperparams`` does.
    state_hyperparams: tuple[Any, ...] = ()


def moments_rule(name: str, state_type: type, update_leaf: Callable[..., Any], b1: Any, b2: Any,
                 eps: Any) -> Rule:
    """A rule with Adam's hyperparameters (``betas`` in [0, 1), ``eps`` >= 0) whose buffers,
    the fields of ``state_type`` after ``count``, start at zero (Adamax, RAdam)."""
    beta1, beta2 = check_betas((b1, b2))
    eps = check_range("eps", eps, 0.0)
    buffers = state_type._fields[1:]
    return Rule(name, state_type, lambda p: {b: zeros(p) for b in buffers}, update_leaf,
                dict(beta1=beta1, beta2=beta2, eps=eps))


def rule_transform(rule: Rule) -> GradientTransformation:
    """``rule`` as a transformation (its spec carries the rule: its scalars and ``advance``)."""
    if rule.scalars:
        tx = leafwise_with_scalars(rule.name, rule.state_type, rule.scalars, rule.advance,
                                   rule.init_leaf, rule.update_leaf, rule.hyperparams,
                                   needs_params=rule.needs_params)
    else:
        tx = leafwise(rule.name, rule.init_leaf, rule.update_leaf, rule.state_type,
                      rule.hyperparams, needs_params=rule.needs_params)
    tx.update.minitrain_spec[1]["rule"] = rule
    return tx


def family_optimizer(rule: Rule, lr: Any = None, *, maximize: bool = False,
                     weight_decay: Any = 0.0, mask: WeightDecayMask = None,
                     decoupled: bool = False) -> Optimizer:
    """``as_optimizer(chain(-g if maximize, L2 decay, rule, decoupled decay, -lr))``.

    ``lr=None``: the rule's output is the whole step (Rprop, ASGD, schedule-free AdamW).
    """
    if not isinstance(maximize, bool):
        raise ValueError(f"invalid maximize={maximize!r}: pass True or False")
    weight_decay = check_range("weight_decay", weight_decay, 0.0)
    decays = not (isinstance(weight_decay, int | float) and weight_decay == 0)
    return as_optimizer(torch_order(
        [rule_transform(rule)], lr, maximize=maximize, decoupled=decoupled,
        decay=add_decayed_weights(weight_decay, mask) if decays else None), strict=True)
