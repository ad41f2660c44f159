"""How the aliases (``sgd``, ``adam``, ...) are their chains of transformations, lowered.

An alias's plain path is :func:`leaf_step`: the per-leaf functions of its chain's rules (from
``_transforms_rules``) composed in the chain's order, so it computes the chain's result bit for
bit. Its fast path runs torch's fused kernels or the streaming kernels over the same state.
:func:`register_alias` makes ``as_optimizer(chain)`` take that fast path when a chain built by
hand has an alias's shape: ``[clip_by_global_norm] [add_decayed_weights] RULE...
[add_decayed_weights] scale_by_learning_rate``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain.optim import _flat
from minitrain.optim._core import GradientTransformation, spec
from minitrain.optim._host import schedule_count
from minitrain.optim._transforms_rules import decayed
from minitrain.optim.base import LateScalar, use_plain_path

__all__ = ["leaf_step", "maximized", "chain_lowering", "register_alias", "GradScale"]

Leaf = Callable[..., tuple[Tensor, dict[str, Any]]]


def _off(weight_decay: Any) -> bool:
    return isinstance(weight_decay, int | float) and weight_decay == 0


def leaf_step(rules: Leaf | Sequence[tuple[Leaf, dict[str, Any]]], hyper: dict[str, Any] | None
              = None, *, decoupled: bool = False, maximize: bool = False,
              unused: Sequence[str] = ()) -> Callable[..., Any]:
    """``plain_step(p, g, buffers, step, lr, weight_decay) -> (p, buffers)`` of the chain
    ``[scale(-1)] [add_decayed_weights] *rules [add_decayed_weights] scale_by_learning_rate``
    followed by ``apply_updates``, per leaf, with the same ops as the chain's plain path."""
    if callable(rules):
        rules = [(rules, hyper or {})]

    def plain_step(p, g, buffers, step, lr, weight_decay):
        if maximize:
            g = -1.0 * g  # scale(-1.0)
        if not decoupled and not _off(weight_decay):
            g = decayed(g, p, weight_decay)
        state = dict(buffers, **{name: () for name in unused})
        new: dict[str, Any] = {}
        for rule, rule_hyper in rules:
            g, out = rule(g, state, p, step, **rule_hyper)
            new.update(out)
        if decoupled and not _off(weight_decay):
            g = decayed(g, p, weight_decay)
        return p + (-lr) * g, {name: value for name, value in new.items() if name in buffers}

    return plain_step


def maximized(gs: list[Tensor], maximize: bool) -> list[Tensor]:
    """The grads to descend along: negated for ``maximize=True`` (torch.optim's ``maximize``)."""
    return list(torch._foreach_neg(gs)) if maximize else gs


def chain_lowering(tx: GradientTransformation, core: str | None):
    """Parse a chain shaped like an alias around the rule named ``core`` (None: no rule, plain
    SGD); None when ``tx`` has another shape.

    Returns ``(parts, before, clip_norm, decoupled, weight_decay, mask, lr)``: ``parts`` maps
    each rule's name to the arguments it was built with.
    """
    found = spec(tx)
    if found is None or found[0] != "chain":
        return None
    specs = [spec(inner) for inner in found[1]["transforms"]]
    if any(s is None for s in specs):
        return None
    names = [s[0] for s in specs]
    clip_norm = None
    before = 0
    if names[:1] == ["clip_by_global_norm"]:
        clip_norm, before = specs[0][1]["max_norm"], 1
    if names[-1:] != ["scale_by_learning_rate"] or specs[-1][1]["sign"] != -1:
        return None
    middle = names[before:-1]
    decays = [i for i, name in enumerate(middle) if name == "add_decayed_weights"]
    if len(decays) > 1 or (core is not None and core not in middle):
        return None
    weight_decay, mask, decoupled = 0.0, None, False
    if decays:
        decay = specs[before + decays[0]][1]
        weight_decay, mask = decay["weight_decay"], decay["mask"]
        if decays[0] == len(middle) - 1:
            decoupled = True
        elif decays[0] != 0:
            return None
    rules = [name for name in middle if name != "add_decayed_weights"]
    parts = {name: s[1] for name, s in zip(names, specs, strict=True)}
    if len(set(rules)) != len(rules) or (rules[:1] != [core] if core else rules):
        return None
    parts["rules"] = rules
    return parts, before, clip_norm, decoupled, weight_decay, mask, \
        specs[-1][1]["learning_rate"]


def spec_tensors(tx: GradientTransformation) -> list[Tensor]:
    """The tensor hyperparameters ``tx`` (and every transformation inside it) was built with.

    >>> import torch, minitrain as mt
    >>> spec_tensors(mt.optim.chain(mt.optim.scale(2.0), mt.optim.scale(torch.tensor(3.0))))
    [tensor(3.)]
    """
    found: list[Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, GradientTransformation):
            found.extend(spec_tensors(value))
        elif isinstance(value, tuple | list):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    described = spec(tx)
    if described is not None:
        walk(described[1])
    return found


class GradScale(threading.local, LateScalar):
    """A factor a lowered chain hands to an alias's fast step for this call only (per thread):
    a global-norm clip's scale, multiplied into the grads inside the update's one pass.

    The chain sets it with :meth:`defer`: a float, or a function computing it that runs none
    of the caller's code (:func:`~minitrain.optim.transforms.clip_scale_later`), which the update
    calls when it first reads the scale (as the kernel's last hyperparameter, after its checks,
    layout, buffers and pointer table): the pass over the grads then runs right before the
    kernel that reads them again. :meth:`restore` puts back what an enclosing call had set (an
    update of the same chain inside a schedule has its own).

    >>> scale = GradScale()
    >>> before = scale.defer(lambda: 0.5)
    >>> scale.value, scale.value, scale.pending
    (0.5, 0.5, False)
    >>> scale.restore(before); scale.value
    1.0
    """

    def __init__(self) -> None:
        self._value = 1.0
        self._compute: Callable[[], float] | None = None

    def defer(self, scale: float | Callable[[], float]) -> tuple[float, Any]:
        previous = (self._value, self._compute)
        if callable(scale):
            self._value, self._compute = 1.0, scale
        else:
            self._value, self._compute = scale, None
        return previous

    def restore(self, previous: tuple[float, Any]) -> None:
        self._value, self._compute = previous

    @property
    def pending(self) -> bool:
        """Whether the deferred scale was never read (so never applied)."""
        return self._compute is not None

    @property
    def value(self) -> float:
        if self._compute is not None:
            compute, self._compute = self._compute, None
            self._value = compute()
        return self._value

    def __float__(self) -> float:
        return self.value


def differentiable(value: Any) -> bool:
    """Whether ``value`` is a tensor that carries a gradient here (grad mode on): an lr the
    fast paths would detach."""
    return isinstance(value, Tensor) and value.requires_grad and torch.is_grad_enabled()


def schedule_needs_grad(lr: Any, state: Any) -> bool:
    """Whether a chain's ``lr`` (its last transformation's learning_rate), if a schedule, gives
    this update a :func:`differentiable` lr (read at the count in the chain's last state; a
    state without one is left to the chain to name)."""
    if not callable(lr) or isinstance(lr, Tensor) or not torch.is_grad_enabled():
        return False
    count = getattr(state[-1], "count", None) if isinstance(state, tuple) and state else None
    return isinstance(count, Tensor) and differentiable(lr(schedule_count(count)))


def _float_tensor(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())


def register_alias(tx: GradientTransformation, optimizer: Any, state_type: type, core: str,
                   buffers: Sequence[str], before: int, clip_norm: Any,
                   fold_clip: GradScale | None = None) -> Callable[..., Any]:
    """A lowered update of chain ``tx`` through ``optimizer``'s fast path: the chain's state is
    read into ``state_type`` (fields ``count``, ``lr`` and buffers) and written back. With
    ``fold_clip``, a leading ``clip_by_global_norm`` computes only its scale and ``optimizer``
    multiplies the grads by it (the same float32 products as clipping first)."""
    from minitrain.optim.kernels.checks import _dense
    from minitrain.optim.transforms import clip_by_global_norm, clip_scale_later

    hyperparameters = spec_tensors(tx)
    lr = spec(spec(tx)[1]["transforms"][-1])[1]["learning_rate"]

    def lowered(grads, state, params, donate):
        leaves = _flat.flatten(params)[0]
        grad_leaves = _flat.flatten(grads)[0]
        if not all(_float_tensor(t) for t in (*leaves, *grad_leaves)):
            return None  # the chain itself names a number leaf, promotes an integer grad
        if use_plain_path("auto", [*leaves, *grad_leaves], hyperparameters) \
                or schedule_needs_grad(lr, state):
            return None
        if clip_norm is not None and fold_clip is not None:
            if not all(_dense(p) for p in leaves):
                return None  # the alias would take its plain path, which has no fold
            previous = fold_clip.defer(clip_scale_later(grads, grad_leaves, clip_norm))
            try:
                result = _update(grads, state, params, donate)
                if fold_clip.pending:  # every fast path of the alias reads it
                    raise RuntimeError("the lowered update never applied the clip's scale")
                return result
            finally:
                fold_clip.restore(previous)
        if clip_norm is not None:
            grads, _ = clip_by_global_norm(grads, clip_norm)
        return _update(grads, state, params, donate)

    def _update(grads, state, params, donate):
        fields: dict[str, Any] = {}
        for inner in state[before:]:
            for name in getattr(inner, "_fields", ()):
                fields.setdefault(name, getattr(inner, name))
        alias_state = state_type(**{name: fields.get(name, ()) for name in state_type._fields})
        new_params, new = optimizer.update(grads, alias_state, params, donate=donate)
        new_state = list(state)
        for index, inner in enumerate(state[before:], start=before):
            if getattr(inner, "_fields", ()):
                new_state[index] = inner._replace(**{
                    name: getattr(new, name) for name in inner._fields if name in new._fields
                })
        return new_params, tuple(new_state)

    return lowered
