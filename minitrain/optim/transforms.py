"""Gradient transformations, the building blocks of every optimizer (optax
``_src/transform.py``'s names, ``torch.optim``'s math).

Each per-leaf rule is one function made into a transformation by :func:`leafwise`, so its math
lives here once: the aliases are chains of these, and their kernels are lowerings tested equal
to them. Where optax and torch differ (RMSprop's eps outside the sqrt, Adam's eps after the bias
correction, SGD's first momentum step), torch wins. Every transformation takes trees of tensors
(any other leaf is a one-line ``ValueError``); integer and bool updates are promoted to their
param's floating dtype first (torch's ``int_tensor + param``)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import (
    WeightDecayMask,
    check_hyperparameter,
    check_like,
    check_state_type,
    checked,
    decay_flags,
    f32_tensor,
    floating_updates,
    hyperparameter,
    is_traced,
    is_zero,
    one_lr,
    scalar,
    schedule_count,
    tensor_leaves,
    use_plain_path,
    zero_count,
)
from minitrain.optim.base import EmptyState, GradientTransformation, ScalarOrSchedule, spec, tagged
from minitrain.optim.leafwise import leafwise
from minitrain.optim.schedules import _either
from minitrain.tree import Grads, Params

__all__ = [
    "scale", "ScaleState", "scale_by_learning_rate", "ScaleByLearningRateState",
    "scale_by_adam", "ScaleByAdamState", "scale_by_rms", "ScaleByRmsState",
    "scale_by_adagrad", "ScaleByAdagradState", "scale_by_sign", "trace", "TraceState",
    "add_decayed_weights", "AddDecayedWeightsState", "clip", "ClipState",
    "clip_by_global_norm", "ClipByGlobalNormState",
]


def zeros(p: Tensor) -> Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


sqrt = _either(math.sqrt, torch.sqrt)


def add_scaled(x: Any, y: Any, alpha: Any) -> Any:
    """``x + alpha * y`` as torch.optim computes it: one ``torch.add`` where ``alpha`` is a
    number (``grad.add(param, alpha=wd)``)."""
    return x + alpha * y if isinstance(alpha, Tensor) else torch.add(x, y, alpha=alpha)


def first_moment(exp_avg: Any, g: Any, beta1: Any) -> Any:
    """torch's ``exp_avg.lerp_(g, 1 - beta1)``; a traced weight (a vmapped beta) in the leaf's
    dtype, as lerp requires of a batched weight."""
    weight = 1 - beta1
    if is_traced(weight) and isinstance(exp_avg, Tensor) and weight.dtype != exp_avg.dtype:
        weight = weight.to(exp_avg.dtype)
    return torch.lerp(exp_avg, g, weight)


ScaleState = EmptyState
ClipState = EmptyState
AddDecayedWeightsState = EmptyState
ClipByGlobalNormState = EmptyState


def _stateless(name: str, update: Any, **arguments: Any) -> GradientTransformation:
    return tagged(name, GradientTransformation(lambda params: EmptyState(), update), **arguments)


def off_kernels(tx: GradientTransformation, variant: str) -> GradientTransformation:
    """``tx`` under a spec name no lowering knows: the fused kernels have no ``variant``."""
    name, arguments = spec(tx)
    tx.update.minitrain_spec = (f"{name}+{variant}", arguments)
    return tx


def scale(step_size: float | Tensor) -> GradientTransformation:
    """Multiply updates by ``step_size``.

    >>> scale(3.0).update([torch.ones(1)], EmptyState())[0]
    [tensor([3.])]
    """
    step_size = hyperparameter("step_size", step_size)

    def update(updates, state, params=None):
        return _scaled(updates, step_size), state

    return _stateless("scale", update, step_size=step_size)


def _scaled(updates, factor):
    """``factor * updates``: one foreach multiply where the leaves take the batched path
    (:func:`use_plain_path`), else leaf by leaf; a 1-D ``factor`` scales each leaf's leading
    (member) axis, in the leaf's dtype and on its device (as a 0-d factor would)."""
    leaves, structure = _pytree.tree_flatten(updates)
    if isinstance(factor, Tensor) and factor.dim() == 1:
        for i, u in enumerate(leaves):
            if u.dim() == 0 or u.shape[0] != len(factor):
                raise ValueError(f"a learning rate per member (shape {tuple(factor.shape)}) "
                                 f"scales each leaf's leading axis, and leaf {i} has shape "
                                 f"{tuple(u.shape)}; stack the members' params (mt.tree.stack)")
        return tree.unflatten(structure, [factor.to(u.device, u.dtype).view(
            -1, *[1] * (u.dim() - 1)) * u for u in leaves])
    if leaves and not use_plain_path(leaves, [factor]):
        with torch.no_grad():
            return tree.unflatten(structure, list(_torch.foreach["mul"](leaves, scalar(factor))))
    return tree.unflatten(structure, [factor * u for u in leaves])


def lr_function(learning_rate: ScalarOrSchedule, members: bool = False) -> tuple[Any, Any]:
    """``learning_rate`` checked (a number, a 0-d tensor, with ``members`` a 1-D tensor of one
    lr per member of stacked params: leaf slice ``m`` at ``lr[m]``) or the schedule, and
    ``lr_at(count)``, the lr after ``count`` updates (an int or a count tensor), a schedule's
    value checked too."""
    if members and isinstance(learning_rate, Tensor) and learning_rate.dim() == 1 and \
            len(learning_rate) > 1:  # (a traced one's values are not read)
        if not learning_rate.is_floating_point() or not is_traced(learning_rate) and not bool(
                (learning_rate >= 0).all()):
            raise ValueError(f"invalid lr={learning_rate!r}: a learning rate per member must be "
                             f"a floating-point tensor of non-negative values")
        return learning_rate, lambda count: learning_rate
    if not callable(learning_rate) or isinstance(learning_rate, Tensor):
        lr = checked("lr", one_lr(learning_rate), 0.0)
        return lr, lambda count: lr
    return learning_rate, lambda count: checked(  # a (1,) tensor as 0-d
        "lr (from the schedule)",
        learning_rate(count if isinstance(count, int) else schedule_count(count)), 0.0)


class ScaleByLearningRateState(NamedTuple):
    """``count`` updates done and ``lr``, the learning rate of the last one."""

    count: Tensor
    lr: Tensor


def scale_by_learning_rate(learning_rate: ScalarOrSchedule,
                           *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply updates by ``-lr`` (``lr`` without ``flip_sign``); ``lr`` may be a schedule
    ``step -> lr`` of the updates done, or a 1-D tensor of one lr per member of stacked params
    (an ensemble's, :func:`mt.tree.stack`): leaf slice ``m`` at ``lr[m]``.

    >>> tx = scale_by_learning_rate(lambda count: 1.0 if count < 1 else 0.5)
    >>> state = tx.init([torch.zeros(1)])
    >>> for _ in range(2):
    ...     updates, state = tx.update([torch.ones(1)], state)
    >>> updates, float(state.lr)
    ([tensor([-0.5000])], 0.5)
    """
    learning_rate, lr_at = lr_function(learning_rate, members=True)
    sign = -1 if flip_sign else 1

    def init(params):
        return ScaleByLearningRateState(zero_count(), f32_tensor(lr_at(0)))

    def update(updates, state, params=None):
        check_state_type("scale_by_learning_rate", ScaleByLearningRateState, state)
        lr = lr_at(state.count)
        factor = -lr if flip_sign else lr
        return _scaled(updates, factor), ScaleByLearningRateState(state.count + 1, f32_tensor(lr))

    return tagged("scale_by_learning_rate", GradientTransformation(init, update),
                  learning_rate=learning_rate, sign=sign)


class ScaleByAdamState(NamedTuple):
    """``count``, ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq`` (``()`` leaves unless
    amsgrad), like torch.optim.Adam's state."""

    count: Tensor
    exp_avg: Params
    exp_avg_sq: Params
    max_exp_avg_sq: Params


def adam_leaf(g, buffers, p, step, beta1, beta2, eps, amsgrad, eps_root):
    """torch.optim.Adam's direction for one leaf, before ``-lr`` (Kingma & Ba 2015, Alg. 1;
    torch's ``_single_tensor_adam``: eps after dividing sqrt(v) by sqrt(bias_correction2));
    optax's ``eps_root`` inside the root: ``m_hat / (sqrt(v_hat + eps_root) + eps)``."""
    exp_avg = first_moment(buffers["exp_avg"], g, beta1)
    exp_avg_sq = beta2 * buffers["exp_avg_sq"] + (1 - beta2) * (g * g) if isinstance(
        beta2, Tensor) else torch.addcmul(buffers["exp_avg_sq"] * beta2, g, g, value=1 - beta2)
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": ()}
    second = exp_avg_sq
    if amsgrad:
        second = new["max_exp_avg_sq"] = torch.maximum(buffers["max_exp_avg_sq"], exp_avg_sq)
    bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
    denom = second.sqrt() / sqrt(bias_correction2) + eps if is_zero(eps_root) else \
        (second / bias_correction2 + eps_root).sqrt() + eps
    return (exp_avg / denom) / bias_correction1, new


def scale_by_adam(b1: float | Tensor = 0.9, b2: float | Tensor = 0.999, eps: float | Tensor = 1e-8,
                  amsgrad: bool = False, eps_root: float | Tensor = 0.0) -> GradientTransformation:
    """Adam's update direction with torch.optim.Adam's eps placement and AMSGrad, and optax's
    ``eps_root`` (added to ``v_hat`` inside the root; 0 in torch).

    >>> tx = scale_by_adam()
    >>> tx.update([torch.tensor([5.0, -0.01])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1.0000, -1.0000])]
    """
    # A float and a tensor may mix here (inject_hyperparams makes one a tensor); the aliases
    # refuse the mix as torch.optim.Adam does.
    beta1 = checked("betas[0]", b1, 0.0, 1.0, high_open=True)
    beta2 = checked("betas[1]", b2, 0.0, 1.0, high_open=True)
    check_hyperparameter("eps", eps, 0.0)
    check_hyperparameter("eps_root", eps_root, 0.0)

    def init_leaf(p):
        return {"exp_avg": zeros(p), "exp_avg_sq": zeros(p),
                "max_exp_avg_sq": zeros(p) if amsgrad else ()}

    tx = leafwise("scale_by_adam", init_leaf, adam_leaf, ScaleByAdamState,
                  dict(beta1=beta1, beta2=beta2, eps=eps, amsgrad=amsgrad, eps_root=eps_root))
    return tx if is_zero(eps_root) else off_kernels(tx, "eps_root")


class ScaleByRmsState(NamedTuple):
    """``count``, ``square_avg`` and ``grad_avg`` (``()`` leaves unless centered)."""

    count: Tensor
    square_avg: Params
    grad_avg: Params


def rms_leaf(g, buffers, p, step, alpha, eps, centered, bias_correction):
    """torch.optim.RMSprop's scaling (eps outside the sqrt; Graves 2013 when centered); with
    ``bias_correction`` both averages are divided by ``1 - alpha^t`` first (optax
    ``scale_by_rms`` / ``scale_by_stddev(bias_correction=True, eps_in_sqrt=False)``)."""
    square_avg = alpha * buffers["square_avg"] + (1 - alpha) * (g * g)
    new = {"square_avg": square_avg, "grad_avg": ()}
    correction = 1 - alpha**step if bias_correction else 1
    if centered:
        grad_avg = new["grad_avg"] = first_moment(buffers["grad_avg"], g, alpha)
        if bias_correction:
            square_avg, grad_avg = square_avg / correction, grad_avg / correction
        avg = (square_avg - grad_avg * grad_avg).sqrt() + eps
    else:
        avg = (square_avg / correction if bias_correction else square_avg).sqrt() + eps
    return g / avg, new


def scale_by_rms(alpha: float | Tensor = 0.99, eps: float | Tensor = 1e-8,
                 centered: bool = False, bias_correction: bool = False) -> GradientTransformation:
    """Divide by the root of a running mean of squares, as torch.optim.RMSprop; optax's
    ``bias_correction`` divides the means by ``1 - alpha^t``.

    >>> tx = scale_by_rms(alpha=0.0, eps=0.0)
    >>> tx.update([torch.tensor([4.0, -2.0])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1., -1.])]
    """
    check_hyperparameter("alpha", alpha, 0.0, 1.0)
    check_hyperparameter("eps", eps, 0.0)

    def init_leaf(p):
        return {"square_avg": zeros(p), "grad_avg": zeros(p) if centered else ()}

    tx = leafwise("scale_by_rms", init_leaf, rms_leaf, ScaleByRmsState,
                  dict(alpha=alpha, eps=eps, centered=centered,
                       bias_correction=bool(bias_correction)))
    return off_kernels(tx, "bias_correction") if bias_correction else tx


class ScaleByAdagradState(NamedTuple):
    """``count`` and ``sum`` of squared updates per leaf."""

    count: Tensor
    sum: Params


def adagrad_leaf(g, buffers, p, step, lr_decay, eps):
    """torch.optim.Adagrad's scaling, with its lr decay ``1 / (1 + (t - 1) * lr_decay)``."""
    total = buffers["sum"] + g * g
    std = total.sqrt() + eps
    return (g / std) / (1 + (step - 1) * lr_decay), {"sum": total}


def scale_by_adagrad(lr_decay: float | Tensor = 0.0,
                     initial_accumulator_value: float | Tensor = 0.0,
                     eps: float | Tensor = 1e-10) -> GradientTransformation:
    """Divide by the root of the sum of squares so far, as torch.optim.Adagrad.

    >>> tx = scale_by_adagrad()
    >>> tx.update([torch.tensor([3.0, -0.5])], tx.init([torch.zeros(2)]))[0]
    [tensor([ 1., -1.])]
    """
    check_hyperparameter("lr_decay", lr_decay, 0.0)
    check_hyperparameter("eps", eps, 0.0)
    initial = checked("initial_accumulator_value", initial_accumulator_value, 0.0)
    return leafwise("scale_by_adagrad", lambda p: {"sum": filled(p, initial)}, adagrad_leaf,
                    ScaleByAdagradState, dict(lr_decay=lr_decay, eps=eps),
                    also_watch=(initial,) if isinstance(initial, Tensor) else ())


def filled(p: Tensor, value: Any) -> Tensor:
    """A tensor like ``p`` holding ``value`` (``zeros + value`` where it is traced or requires
    grad)."""
    number = scalar(value)
    if isinstance(number, Tensor) or isinstance(value, Tensor) and value.requires_grad:
        return zeros(p) + value.to(p.dtype)
    return torch.full_like(p, number, memory_format=torch.preserve_format)


def sign_leaf(g, buffers, p, step):
    """``sign(g)`` (signSGD, Bernstein et al. 2018)."""
    return torch.sign(g), buffers


def scale_by_sign() -> GradientTransformation:
    """Replace each update by its sign.

    >>> tx = scale_by_sign()
    >>> tx.update([torch.tensor([3.0, -0.5, 0.0])], tx.init([torch.zeros(3)]))[0]
    [tensor([ 1., -1.,  0.])]
    """
    return leafwise("scale_by_sign", lambda p: {}, sign_leaf)


class TraceState(NamedTuple):
    """``count`` and ``momentum_buffer`` per leaf, like torch.optim.SGD's state."""

    count: Tensor
    momentum_buffer: Params


def trace_leaf(g, buffers, p, step, momentum, dampening, nesterov):
    """torch.optim.SGD's momentum: ``b = g`` on the first step (a copy, as torch's
    ``clone(grad)``), then ``b = momentum * b + (1 - dampening) * g``; the update is ``g +
    momentum * b`` (Nesterov) or ``b``; with ``momentum == 0``, ``g``."""
    if _concrete(momentum) == 0:
        return g, {"momentum_buffer": buffers["momentum_buffer"]}
    later = momentum * buffers["momentum_buffer"] + (1 - dampening) * g
    buf = (g.clone() if step == 1 else later) if isinstance(step, int) else (
        torch.where(step == 1, g, later))
    out = g + momentum * buf if nesterov else buf
    if isinstance(momentum, Tensor) and _concrete(momentum) is None:  # traced: per member
        out = torch.where(momentum == 0, g, out)
    return out, {"momentum_buffer": buf}


def trace(momentum: float | Tensor = 0.9, dampening: float | Tensor = 0.0,
          nesterov: bool = False) -> GradientTransformation:
    """Momentum as torch.optim.SGD has it (first step ``b = g``, dampening, Nesterov).

    >>> tx = trace(momentum=0.9)
    >>> state = tx.init([torch.zeros(1)])
    >>> for _ in range(2):
    ...     updates, state = tx.update([torch.ones(1)], state)
    >>> updates
    [tensor([1.9000])]
    """
    check_hyperparameter("momentum", momentum, 0.0)
    check_hyperparameter("dampening", dampening, 0.0)
    # As sgd: a traced momentum or dampening (vmap, torch.func.grad) is not checked here.
    if nesterov and (_concrete(momentum) == 0 or _concrete(dampening) not in (None, 0)):
        raise ValueError("invalid nesterov=True: it requires momentum > 0 and dampening = 0; "
                         "set momentum or turn nesterov off")
    return leafwise("trace", None, trace_leaf, TraceState,
                    dict(momentum=momentum, dampening=dampening, nesterov=nesterov))


def _concrete(value: Any) -> Any:
    value = scalar(value)
    return value if isinstance(value, int | float) else None


def add_decayed_weights(weight_decay: float | int | Tensor = 0.0,
                        mask: WeightDecayMask = None) -> GradientTransformation:
    """Add ``weight_decay * p`` to the updates of the leaves ``mask`` selects: torch's L2 decay
    before a scaling rule, decoupled decay (AdamW) after it.

    >>> tx = add_decayed_weights(0.5, mask={"w": True, "b": False})
    >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
    >>> tx.update({"w": torch.zeros(1), "b": torch.zeros(1)}, tx.init(params), params)[0]
    {'w': tensor([0.5000]), 'b': tensor([0.])}
    """
    weight_decay = checked("weight_decay", weight_decay, 0.0)

    def update(updates, state, params=None):
        # Read per call, not kept at build: a sweep's members build alike whatever their value.
        if is_zero(weight_decay):
            return updates, state
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, "
                             "params)")
        check_like(params, updates, ("params", "updates"))
        u_leaves, structure = _pytree.tree_flatten(updates)
        p_leaves = _pytree.tree_leaves(params)
        # off the plain path a concrete tensor decays by its number, as torch.add's alpha
        wd = weight_decay if use_plain_path([*u_leaves, *p_leaves], [weight_decay]) else \
            scalar(weight_decay)
        out = [add_scaled(u, p, wd) if flag else u
               for u, p, flag in zip(u_leaves, p_leaves, decay_flags(mask, params), strict=True)]
        return tree.unflatten(structure, out), state

    return _stateless("add_decayed_weights", update, weight_decay=weight_decay, mask=mask)


def clip(max_delta: float | Tensor) -> GradientTransformation:
    """Clamp each element of the updates to ``[-max_delta, max_delta]``.

    >>> clip(1.0).update([torch.tensor([3.0, -0.5, -2.0])], EmptyState())[0]
    [tensor([ 1.0000, -0.5000, -1.0000])]
    """
    max_delta = checked("max_delta", max_delta, 0.0)

    def update(updates, state, params=None):
        return tree.map(lambda u: torch.clamp(u, -max_delta, max_delta), updates), state

    return _stateless("clip", update, max_delta=max_delta)


_NOT_GIVEN = object()


def clip_by_global_norm(grads_or_max_norm: Any = _NOT_GIVEN, max_norm: Any = None) -> Any:
    """Scale updates so that their joint L2 norm is at most ``max_norm``, by
    ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``.

    ``clip_by_global_norm(max_norm)`` is the transformation (optax's form);
    ``clip_by_global_norm(grads, max_norm)`` returns the clipped grads and the norm before.

    >>> grads, norm = clip_by_global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
    >>> norm, grads["a"], grads["b"]
    (tensor(5.), tensor([0.6000]), tensor([0.8000]))
    >>> tx = clip_by_global_norm(1.0)
    >>> tx.update([torch.tensor([3.0, 4.0])], tx.init([torch.zeros(2)]))[0]
    [tensor([0.6000, 0.8000])]
    """
    if grads_or_max_norm is not _NOT_GIVEN and max_norm is not None:  # the function form
        tensor_leaves("clip_by_global_norm", grads_or_max_norm, "grads leaf")
        return _clip(floating_updates("clip_by_global_norm", grads_or_max_norm), max_norm)
    max_norm = max_norm if grads_or_max_norm is _NOT_GIVEN else grads_or_max_norm
    if max_norm is None:
        raise ValueError("clip_by_global_norm needs max_norm: clip_by_global_norm(1.0)")
    max_norm = checked("max_norm", max_norm, 0.0, low_open=True)

    def update(updates, state, params=None):
        return _clip(updates, max_norm)[0], state

    return _stateless("clip_by_global_norm", update, max_norm=max_norm)


def _clip(grads: Grads, max_norm: float | int | Tensor) -> tuple[Grads, Tensor]:
    check_hyperparameter("max_norm", max_norm, 0.0, low_open=True)
    norm = tree.global_norm(grads)  # 0, float32 on the CPU, for a group that holds no leaf
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tree.map(lambda g: g * factor.to(g.dtype), grads), norm
