"""RMSProp as ``torch.optim.RMSprop`` (Hinton's lecture 6e; Graves 2013 for ``centered``).

The chain (:func:`rmsprop_chain`): ``[scale(-1) if maximize] [add_decayed_weights]
scale_by_rms(alpha, eps, centered) [trace(momentum)] scale_by_learning_rate`` (eps outside the
sqrt, unlike optax). The plain path runs its per-leaf math; the fast path lowers it to the
streaming kernel, else (torch has no fused RMSprop kernel) a sequence of ``torch._foreach_*``
passes over cache-sized batches of leaves (see ``_layout.CACHE_BATCH_BYTES``); without donation
the first pass of each buffer writes a fresh tensor instead of updating in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from minitrain.optim.kernels import streaming
from minitrain.optim._core import (
    GradientTransformation,
    hyperparameter,
    register_lowering,
)
from minitrain.optim._family import torch_order
from minitrain.optim._lowering import chain_lowering, leaf_step, maximized, register_alias
from minitrain.optim._transforms_rules import (
    add_decayed_weights,
    keeps_momentum_buffer,
    rms_leaf,
    scale_by_rms,
    trace,
    trace_leaf,
)
from minitrain.optim.base import (
    Optimizer,
    Rule,
    ScalarOrSchedule,
    WeightDecayMask,
    check_hyperparameter,
    make_optimizer,
    scalar,
)
from minitrain.tree import Params

__all__ = ["RMSpropState", "rmsprop", "rmsprop_chain"]


class RMSpropState(NamedTuple):
    """``count``, last ``lr``, ``square_avg``; ``momentum_buffer`` and ``grad_avg`` or ``()``."""

    count: Tensor
    lr: Tensor
    square_avg: Params
    momentum_buffer: Params
    grad_avg: Params


def rmsprop(
    lr: ScalarOrSchedule = 1e-2,
    alpha: float | Tensor = 0.99,
    eps: float | Tensor = 1e-8,
    weight_decay: float | Tensor = 0.0,
    momentum: float | Tensor = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """RMSProp with ``torch.optim.RMSprop``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.rmsprop(lr=0.01, alpha=0.0, eps=0.0)
    >>> params = {"w": torch.tensor([1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([4.0])}, state, params)
    >>> params["w"]  # alpha=0: v = g * g, so the step is lr * sign(g)
    tensor([0.9900])
    """
    alpha, eps = hyperparameter("alpha", alpha), hyperparameter("eps", eps)
    check_hyperparameter("alpha", alpha, 0.0, 1.0)
    check_hyperparameter("eps", eps, 0.0)
    weight_decay = hyperparameter("weight_decay", weight_decay)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    momentum = hyperparameter("momentum", momentum)
    check_hyperparameter("momentum", momentum, 0.0)
    has_momentum = keeps_momentum_buffer(momentum)
    buffers = ("square_avg",) + (("momentum_buffer",) if has_momentum else ()) + (
        ("grad_avg",) if centered else ()
    )
    rules = [(rms_leaf, dict(alpha=alpha, eps=eps, centered=centered))]
    if has_momentum:
        rules.append((trace_leaf, dict(momentum=momentum, dampening=0.0, nesterov=False)))
    plain_step = leaf_step(rules, maximize=maximize)
    mu, a, e = scalar(momentum), scalar(alpha), scalar(eps)

    def streaming_spec(step, lr, weight_decay):
        hyperparameters = [lr, a, e, weight_decay, mu, centered, has_momentum]
        return "rmsprop", hyperparameters, ("square_avg", "momentum_buffer" if has_momentum
                                            else None, "grad_avg" if centered else None)

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        gs = maximized(gs, maximize)
        state = [buffers.get(name) for name in ("square_avg", "momentum_buffer", "grad_avg")]
        if streaming.usable([*ps, *gs, *sum(filter(None, state), [])]):
            _, hyperparameters, _ = streaming_spec(step, lr, weight_decay)
            new_ps, *new_state = streaming.update(
                "rmsprop", hyperparameters, [ps, gs, *state], outputs
            )
            names = ("square_avg", "momentum_buffer", "grad_avg")
            return new_ps, {n: t for n, t in zip(names, new_state, strict=True) if t is not None}
        if weight_decay != 0:
            gs = torch._foreach_add(gs, ps, alpha=weight_decay)
        square_avg = _apply(torch.mul, buffers["square_avg"], (a,), {}, outputs)
        torch._foreach_addcmul_(square_avg, gs, gs, value=1 - a)
        new = {"square_avg": square_avg}
        if centered:
            grad_avg = _apply(torch.lerp, buffers["grad_avg"], (gs, 1 - a), {}, outputs)
            new["grad_avg"] = grad_avg
            avg = torch._foreach_addcmul(square_avg, grad_avg, grad_avg, value=-1)
            torch._foreach_sqrt_(avg)
        else:
            avg = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(avg, e)
        if has_momentum:
            buf = _apply(torch.mul, buffers["momentum_buffer"], (mu,), {}, outputs)
            torch._foreach_addcdiv_(buf, gs, avg)
            new["momentum_buffer"] = buf
            return _apply(torch.add, ps, (buf,), {"alpha": -lr}, outputs), new
        return _apply(torch.addcdiv, ps, (gs, avg), {"value": -lr}, outputs), new

    rule = Rule(
        buffers=buffers,
        init_buffer=lambda name, p: torch.zeros_like(p, memory_format=torch.preserve_format),
        plain_step=plain_step,
        fast_step=fast_step,
        fused=False,
        streaming=None if maximize else streaming_spec,
    )
    lr = lr if callable(lr) else hyperparameter("lr", lr)
    return make_optimizer(RMSpropState, rule, lr, weight_decay, mask, impl,
                          (alpha, momentum, eps))


def rmsprop_chain(
    lr: ScalarOrSchedule = 1e-2,
    alpha: float | Tensor = 0.99,
    eps: float | Tensor = 1e-8,
    weight_decay: float | Tensor = 0.0,
    momentum: float | Tensor = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
) -> GradientTransformation:
    """The chain of transformations :func:`rmsprop` runs.

    >>> import torch, minitrain as mt
    >>> tx = rmsprop_chain(momentum=0.9)
    >>> [name for name, _ in map(mt.optim.spec, mt.optim.spec(tx)[1]["transforms"])]
    ['add_decayed_weights', 'scale_by_rms', 'trace', 'scale_by_learning_rate']
    """
    has_momentum = keeps_momentum_buffer(momentum)
    rule = [scale_by_rms(alpha, eps, centered), *([trace(momentum)] if has_momentum else [])]
    return torch_order(rule, lr, maximize=maximize, decay=add_decayed_weights(weight_decay, mask))


def _match(tx: GradientTransformation):
    """Lower ``as_optimizer`` of an RMSprop-shaped chain to :func:`rmsprop`'s fast path."""
    found = chain_lowering(tx, "scale_by_rms")
    if found is None:
        return None
    parts, before, clip_norm, decoupled, weight_decay, mask, lr = found
    if decoupled and weight_decay != 0 or parts["rules"] not in (
        ["scale_by_rms"], ["scale_by_rms", "trace"]
    ):
        return None
    momentum = 0.0
    if "trace" in parts:
        t = parts["trace"]
        if t["nesterov"] or t["dampening"] != 0:
            return None
        momentum = t["momentum"]
    rms = parts["scale_by_rms"]
    optimizer = rmsprop(lr, rms["alpha"], rms["eps"], weight_decay, momentum, rms["centered"],
                        mask=mask, impl="fast")
    return register_alias(tx, optimizer, RMSpropState, "scale_by_rms",
                          ("square_avg", "momentum_buffer", "grad_avg"), before, clip_norm)


register_lowering(_match)


def _apply(op, tensors, args, kwargs, outputs):
    """``op(t, *args_i, **kwargs)`` for each tensor: in place when donating (``outputs`` None),
    else written into fresh buffers with ``out=`` (one pass, no copy)."""
    targets = tensors if outputs is None else outputs(tensors)
    for index, (t, target) in enumerate(zip(tensors, targets, strict=True)):
        leaf_args = [a[index] if isinstance(a, list | tuple) else a for a in args]
        op(t, *leaf_args, **kwargs, out=target)
    return targets
