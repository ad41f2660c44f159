"""Plumbing shared by the torch.optim family beyond Adam: the descent prefix, step numbers,
and per-leaf rules whose state also holds a few scalars (NAdam's ``mu_product``, schedule-free
AdamW's ``weight_sum``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as _pytree
from torch import Tensor

from minitrain.optim.kernels import streaming
from minitrain.optim._compiled_rule import CompiledChain
from minitrain.optim._core import (
    GradientTransformation,
    as_optimizer,
    chain,
    check_pair,
    hyperparameter,
    leafwise,
    tagged,
)
from minitrain.optim._host import next_step, schedule_count
from minitrain.optim._pooled import PooledLeaves, _run
from minitrain.optim.kernels.checks import donatable, naming_bad_grads
from minitrain.optim._transforms_rules import add_decayed_weights, scale, scale_by_learning_rate
from minitrain.optim.base import (
    BufferPool,
    Optimizer,
    WeightDecayMask,
    check_grads,
    check_hyperparameter,
    check_params,
    decay_flags,
    is_traced,
    scalar,
    use_plain_path,
)
from minitrain.tree import Params

__all__ = [
    "Scalar",
    "add_scaled",
    "descent_prefix",
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


def descent_prefix(maximize: bool, weight_decay: Any = 0.0,
                   mask: WeightDecayMask = None) -> list[GradientTransformation]:
    """What torch.optim does to a gradient before its rule: negate it when maximizing, then add
    the L2 term ``weight_decay * p`` (``grad = grad.add(param, alpha=weight_decay)``)."""
    if not isinstance(maximize, bool):
        raise ValueError(f"invalid maximize={maximize!r}: pass True or False")
    prefix = [scale(-1.0)] if maximize else []
    weight_decay = check_range("weight_decay", weight_decay, 0.0)
    if not (isinstance(weight_decay, int | float) and weight_decay == 0):
        prefix.append(add_decayed_weights(weight_decay, mask))
    return prefix


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
    # ``kernel(step, hyper, per_step) -> (rule, hyperparameters, buffers)``: the streaming
    # kernel (``_streaming.c``) that computes the same step in one pass over float32 CPU
    # leaves, the rule's part of its hyperparameters (after the family's frame), and the
    # state fields it reads and writes in its slot order. Numbers in, numbers out.
    kernel: Callable[..., tuple[str, list[float], tuple[str, ...]]] | None = None
    # The hyperparameters that reach the rule only through ``advance`` or its initial state
    # (ASGD's lr and alpha, NAdam's momentum_decay): a traced one, or one that requires grad,
    # keeps the update off the fast path, as one of ``hyperparams`` does.
    state_hyperparams: tuple[Any, ...] = ()


def moments_rule(name: str, state_type: type, update_leaf: Callable[..., Any], b1: Any, b2: Any,
                 eps: Any, kernel: Callable[..., Any] | None = None) -> Rule:
    """A rule with Adam's hyperparameters (``betas`` in [0, 1), ``eps`` >= 0) whose buffers,
    the fields of ``state_type`` after ``count``, start at zero (Adamax, RAdam)."""
    beta1, beta2 = check_betas((b1, b2))
    eps = check_range("eps", eps, 0.0)
    buffers = state_type._fields[1:]
    return Rule(name, state_type, lambda p: {b: zeros(p) for b in buffers}, update_leaf,
                dict(beta1=beta1, beta2=beta2, eps=eps), kernel=kernel)


def rule_transform(rule: Rule) -> GradientTransformation:
    """``rule`` as a transformation."""
    if rule.scalars:
        return leafwise_with_scalars(rule.name, rule.state_type, rule.scalars, rule.advance,
                                     rule.init_leaf, rule.update_leaf, rule.hyperparams,
                                     needs_params=rule.needs_params)
    return leafwise(rule.name, rule.init_leaf, rule.update_leaf, rule.state_type,
                    rule.hyperparams, needs_params=rule.needs_params)


def family_optimizer(rule: Rule, lr: Any = None, *, maximize: bool = False,
                     weight_decay: Any = 0.0, mask: WeightDecayMask = None,
                     decoupled: bool = False, impl: str = "auto") -> Optimizer:
    """``as_optimizer(chain(-g if maximize, L2 decay, rule, decoupled decay, -lr))``, whose
    update on plain CPU tensors runs the same ops into recycled buffers (``_pooled``), or with
    ``impl="compiled"`` as one inductor graph (``_compiled_rule``).

    ``lr=None``: the rule's output is the whole step (Rprop, ASGD, schedule-free AdamW).
    """
    if impl not in ("auto", "compiled"):
        raise ValueError(f"invalid impl={impl!r}: choose 'auto' or 'compiled'")
    if not isinstance(maximize, bool):
        raise ValueError(f"invalid maximize={maximize!r}: pass True or False")
    weight_decay = check_range("weight_decay", weight_decay, 0.0)
    decays = not (isinstance(weight_decay, int | float) and weight_decay == 0)
    tx = torch_order([rule_transform(rule)], lr, maximize=maximize, decoupled=decoupled,
                     decay=add_decayed_weights(weight_decay, mask) if decays else None)
    slow = as_optimizer(tx)
    plan = _Plan(rule, maximize, weight_decay if decays else None, mask, decoupled, lr)
    pool = BufferPool()
    compiled = CompiledChain(rule.update_leaf, maximize, decays and not decoupled,
                             decays and decoupled, lr is not None) if impl == "compiled" else None

    def update(grads, state, params, *, donate: bool = False):
        # Donation is checked where it is used: the kernel path's donatable() (params, grads
        # and state), the chain's for the rest.
        if plan.takes(grads, state, params):
            with pool.lock:  # two concurrent updates must not share an output buffer
                if compiled is None and plan.kernel_takes(grads, state, params):
                    return plan.run_kernel(grads, state, params, pool, donate)
                return plan.run(grads, state, params, pool, compiled)
        check_params(params)  # complex params, say: the rules are written for real ones
        check_grads(grads, params)  # a grad of another dtype or shape, named
        return slow.update(grads, state, params, donate=donate)

    def init(params):
        check_params(params)
        return tx.init(params)

    update = naming_bad_grads(update)
    update.transformation = tx  # type: ignore[attr-defined]
    return Optimizer(init, update)


class _Plan:
    """The pooled run of one ``family_optimizer`` chain (same ops, same order)."""

    def __init__(self, rule, maximize, weight_decay, mask, decoupled, lr):
        self.rule, self.maximize, self.weight_decay = rule, maximize, weight_decay
        self.mask, self.decoupled, self.lr = mask, decoupled, lr
        self.hyper = {k: hyperparameter(k, v) for k, v in rule.hyperparams.items()}
        # every tensor hyperparameter the chain was built with, for takes()
        self.tensors = [v for v in (*self.hyper.values(), *rule.state_hyperparams, lr,
                                    weight_decay) if isinstance(v, Tensor)]
        self.scalar_names = tuple(rule.scalars or ())
        self.schedule = callable(lr) and not isinstance(lr, Tensor)
        self.rule_index = int(maximize) + int(weight_decay is not None and not decoupled)
        self.flags: dict[Any, list[bool]] = {}

    def takes(self, grads, state, params) -> bool:
        """Whether the pooled path applies: plain CPU tensors, no tracing, no autograd, and
        inputs whose layout matches (anything else takes the chain, which explains errors)."""
        p_leaves, spec = _pytree.tree_flatten(params)
        g_leaves, g_spec = _pytree.tree_flatten(grads)
        if g_spec != spec or not p_leaves or not isinstance(state, tuple):
            return False
        inner = state[self.rule_index] if len(state) > self.rule_index else None
        if not isinstance(inner, self.rule.state_type) or is_traced(inner.count):
            return False
        # The hyperparameters and the rule's state scalars (which carry those it was built
        # with through its updates, e.g. a traced or differentiable lr): a traced one, or one
        # that requires grad, takes the chain (the pooled ops would raise or detach it).
        hyper = [*self.tensors, *(getattr(inner, k) for k in self.scalar_names)]
        if self.schedule and torch.is_grad_enabled():  # its value may need its grad
            hyper.append(self.lr(schedule_count(state[-1].count)))
        if not all(isinstance(t, Tensor) and t.device.type == "cpu" and t.is_contiguous()
                   and t.is_floating_point() for t in (*p_leaves, *g_leaves)):
            return False
        if use_plain_path("auto", [*p_leaves, *g_leaves], hyper):
            return False
        if any(g.shape != p.shape or g.dtype != p.dtype
               for g, p in zip(g_leaves, p_leaves, strict=True)):
            return False
        for field in self.buffers():
            leaves, buffer_spec = _pytree.tree_flatten(getattr(inner, field))
            if getattr(inner, field) == ():
                continue
            if buffer_spec != spec or any(
                not isinstance(b, Tensor) or b.shape != p.shape or b.dtype != p.dtype
                or b.device.type != "cpu" for b, p in zip(leaves, p_leaves, strict=True)
            ):
                return False
        return True

    def kernel_takes(self, grads, state, params) -> bool:
        """Whether the rule's streaming kernel can run (after :meth:`takes`): it has one, the
        kernels are built, and every param, grad and buffer leaf is a float32 CPU contiguous
        tensor whose storage holds it (anything else runs the rule op by op)."""
        if self.rule.kernel is None or (self.lr is None and self.weight_decay is not None
                                        and self.decoupled):
            return False
        inner = state[self.rule_index]
        tensors = [*_pytree.tree_leaves(params), *_pytree.tree_leaves(grads)]
        for field in self.buffers():
            if getattr(inner, field) == ():
                return False
            tensors.extend(_pytree.tree_leaves(getattr(inner, field)))
        return streaming.usable(tensors) and all(streaming._storage_holds(t) for t in tensors)

    def run_kernel(self, grads, state, params, pool, donate: bool = False):
        """The update as one streaming-kernel pass per decay group: the frame of the chain
        (``-g`` for maximize, L2 decay, ``-lr`` and decoupled decay) and the rule's step in
        the same loop, into recycled buffers, or in place when ``donate``."""
        p_leaves, spec = _pytree.tree_flatten(params)
        g_leaves = _pytree.tree_leaves(grads)
        new_state = list(state)
        inner = state[self.rule_index]
        donate = donate and donatable(p_leaves, g_leaves, [
            _pytree.tree_leaves(getattr(inner, f)) for f in self.buffers()])
        if not donate:
            pool.begin_update()
        step = next_step(inner.count)
        per_step, kept = self.advance(inner, step)
        lr = self.step_lr(state, new_state) if self.lr is not None else None
        name, rule_hp, fields = self.rule.kernel(
            step, {k: scalar(v) for k, v in self.hyper.items()},
            {k: scalar(v) for k, v in per_step.items()})
        buffers = {f: _pytree.tree_leaves(getattr(inner, f)) for f in fields}
        flags = self.decay_flags(params) if self.weight_decay is not None else \
            [False] * len(p_leaves)
        new_params = list(p_leaves)
        new_buffers = {f: list(leaves) for f, leaves in buffers.items()}
        wd = scalar(self.weight_decay) if self.weight_decay is not None else 0.0
        for flag in (True, False):
            group = [i for i, decays in enumerate(flags) if decays is flag]
            if not group:
                continue
            l2 = wd if flag and not self.decoupled else 0.0
            decay = 1 - lr * wd if flag and self.decoupled and lr is not None else 1.0
            frame = [-1.0 if self.maximize else 1.0, l2, 0.0 if lr is None else float(lr),
                     decay, float(lr is not None)]
            slots = [[p_leaves[i] for i in group], [g_leaves[i] for i in group],
                     *([buffers[f][i] for i in group] for f in fields)]
            out = streaming.update(name, frame + [float(v) for v in rule_hp], slots,
                                   None if donate else pool)
            for position, i in enumerate(group):
                new_params[i] = out[0][position]
                for f, leaves in zip(fields, out[1:], strict=True):
                    new_buffers[f][i] = leaves[position]
        new_fields = {f: _pytree.tree_unflatten(new_buffers[f], spec) if f in new_buffers
                      else getattr(inner, f) for f in self.buffers()}
        new_state[self.rule_index] = self.rule.state_type(
            torch.tensor(step, dtype=torch.int64, device="cpu"), **kept, **new_fields)
        return _pytree.tree_unflatten(new_params, spec), tuple(new_state)

    def buffers(self) -> tuple[str, ...]:
        skip = 1 + len(self.rule.scalars or {})
        return self.rule.state_type._fields[skip:]

    def decay_flags(self, params) -> list[bool]:
        """Per leaf of ``params``: whether weight decay applies (cached per structure)."""
        key = _pytree.tree_structure(params)
        flags = self.flags.get(key)
        if flags is None:
            flags = self.flags[key] = decay_flags(self.mask, params)
        return flags

    def decay(self, u, p, params, pool):
        flags = self.decay_flags(params)
        wd = scalar(self.weight_decay)
        return PooledLeaves([_run(torch.add, (ui, pi), {"alpha": wd}, pool) if flag else ui
                             for ui, pi, flag in zip(u, p, flags, strict=True)], pool)

    def shrunk(self, p, params, lr, pool):
        """``p (1 - lr wd)`` on the decayed leaves (torch's decoupled weight decay)."""
        flags = self.decay_flags(params)
        factor = 1 - lr * scalar(self.weight_decay)
        return [_run(torch.mul, (pi, factor), {}, pool) if flag else pi
                for pi, flag in zip(p, flags, strict=True)]

    def run(self, grads, state, params, pool, compiled=None):
        if compiled is not None and len({p.dtype for p in _pytree.tree_leaves(params)}) == 1:
            return self.run_compiled(grads, state, params, pool, compiled)
        pool.begin_update()
        p_leaves, spec = _pytree.tree_flatten(params)
        new_state = list(state)
        with torch.no_grad():
            p = PooledLeaves(p_leaves, pool)
            u = PooledLeaves(_pytree.tree_leaves(grads), pool)
            if self.maximize:
                u = u * -1.0
            if self.weight_decay is not None and not self.decoupled:
                u = self.decay(u, p, params, pool)
            u, new_state[self.rule_index] = self.run_rule(u, p, state[self.rule_index], spec,
                                                           pool)
            decoupled = self.weight_decay is not None and self.decoupled
            if self.lr is None:
                if decoupled:
                    u = self.decay(u, p, params, pool)
                new_params = [_run(torch.add, (pi, ui), {}, pool).to(pi.dtype)
                              for pi, ui in zip(p, u, strict=True)]
            else:
                lr = self.step_lr(state, new_state)
                # p - lr (u + wd p) as torch.optim computes it: p (1 - lr wd) - lr u, one pass
                # over p for the decay and one for the step (the chain makes three).
                base = self.shrunk(p, params, lr, pool) if decoupled else p
                new_params = [_run(torch.add, (bi, ui), {"alpha": -lr}, pool).to(pi.dtype)
                              for pi, bi, ui in zip(p, base, u, strict=True)]
        return _pytree.tree_unflatten(new_params, spec), tuple(new_state)

    def run_rule(self, u, p, inner, spec, pool):
        rule = self.rule
        step = next_step(inner.count)
        per_step, kept = self.advance(inner, step)
        # numbers, as the chain's batched path passes them (takes() saw nothing traced and
        # nothing that requires grad): a tensor lr gives the chain's ops, bit for bit
        per_step = {k: scalar(hyperparameter(k, v)) for k, v in per_step.items()}
        buffers = {
            field: () if getattr(inner, field) == () else
            PooledLeaves(_pytree.tree_leaves(getattr(inner, field)), pool)
            for field in self.buffers()
        }
        out, new_buffers = rule.update_leaf(u, buffers, p, step, **self.hyper, **per_step)
        fields = {
            field: () if getattr(inner, field) == () else
            _pytree.tree_unflatten(list(new_buffers[field]), spec)
            for field in self.buffers()
        }
        count = torch.tensor(step, dtype=torch.int64, device="cpu")
        return out, rule.state_type(count, **kept, **fields)

    def advance(self, inner, step: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """``(per_step, kept)``: the rule's extra arguments for update ``step`` and its next
        scalars, from the scalars in ``inner`` (none for rules without scalars)."""
        if not self.rule.scalars:
            return {}, {}
        old = {key: getattr(inner, key) for key in self.rule.scalars}
        new_scalars, per_step = self.rule.advance(step, **{k: scalar(v) for k, v in old.items()})
        return per_step, {key: _like(new_scalars[key], old[key]) for key in self.rule.scalars}

    def step_lr(self, state, new_state):
        """The lr of this update, recorded in the chain's last state."""
        lr_state = state[-1]
        lr = self.lr(schedule_count(lr_state.count)) if self.schedule else self.lr
        if self.schedule:
            check_hyperparameter("lr (from the schedule)", lr, 0.0)
        lr_tensor = lr.to(torch.float32) if isinstance(lr, Tensor) else torch.tensor(
            float(lr), dtype=torch.float32, device="cpu")
        new_state[-1] = type(lr_state)(lr_state.count + 1, lr_tensor)
        return scalar(lr)

    def run_compiled(self, grads, state, params, pool, compiled):
        pool.begin_update()
        rule = self.rule
        p_leaves, spec = _pytree.tree_flatten(params)
        new_state = list(state)
        inner = state[self.rule_index]
        step = next_step(inner.count)
        per_step, kept = self.advance(inner, step)
        lr = self.step_lr(state, new_state) if self.lr is not None else 0.0
        flags = self.decay_flags(params)
        used = [f for f in self.buffers() if getattr(inner, f) != ()]
        buffers = {f: _pytree.tree_leaves(getattr(inner, f)) for f in used}
        ps_out = [pool.empty_like(p) for p in p_leaves]
        buffers_out = {f: [pool.empty_like(b) for b in leaves] for f, leaves in buffers.items()}
        with torch.no_grad():
            compiled(p_leaves, _pytree.tree_leaves(grads), buffers, step,
                     {k: scalar(v) for k, v in self.hyper.items()},
                     {k: scalar(v) for k, v in per_step.items()}, lr,
                     scalar(self.weight_decay) if self.weight_decay is not None else 0.0,
                     flags, ps_out, buffers_out)
        fields = {f: () if f not in buffers_out else _pytree.tree_unflatten(buffers_out[f], spec)
                  for f in self.buffers()}
        new_state[self.rule_index] = rule.state_type(
            torch.tensor(step, dtype=torch.int64, device="cpu"), **kept, **fields)
        return _pytree.tree_unflatten(ps_out, spec), tuple(new_state)
