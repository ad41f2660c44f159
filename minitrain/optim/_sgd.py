"""SGD with momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

The chain (:func:`sgd_chain`): ``[scale(-1) if maximize] [add_decayed_weights]
[trace(momentum, dampening, nesterov)] scale_by_learning_rate`` (torch.optim.SGD docs,
``_single_tensor_sgd``). The plain path runs its per-leaf math; the fast path lowers it to
``torch._fused_sgd_`` or the streaming kernel.
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
    trace,
    trace_leaf,
)
from minitrain.optim.base import (
    Optimizer,
    Rule,
    ScalarOrSchedule,
    WeightDecayMask,
    check_hyperparameter,
    is_traced,
    make_optimizer,
    owned,
    scalar,
)
from minitrain.tree import Params

__all__ = ["SGDState", "sgd", "sgd_chain"]

_HALVES = (torch.bfloat16, torch.float16)


class SGDState(NamedTuple):
    """``count`` updates done, the last ``lr``, ``momentum_buffer`` (``()`` without momentum)."""

    count: Tensor
    lr: Tensor
    momentum_buffer: Params


def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float | Tensor = 0.0,
    dampening: float | Tensor = 0.0,
    nesterov: bool = False,
    weight_decay: float | Tensor = 0.0,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """Stochastic gradient descent with ``torch.optim.SGD``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.sgd(lr=0.1, momentum=0.9)
    >>> params = {"w": torch.tensor([1.0])}
    >>> state = opt.init(params)
    >>> for _ in range(2):
    ...     params, state = opt.update({"w": torch.tensor([1.0])}, state, params)
    >>> params["w"]  # 1 - 0.1 * 1 - 0.1 * 1.9
    tensor([0.7100])
    """
    momentum = hyperparameter("momentum", momentum)
    check_hyperparameter("momentum", momentum, 0.0)
    dampening = hyperparameter("dampening", dampening)
    check_hyperparameter("dampening", dampening, 0.0)
    weight_decay = hyperparameter("weight_decay", weight_decay)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    mu, damp = scalar(momentum), scalar(dampening)  # traced ones (vmap) are checked per use
    if nesterov and (not is_traced(mu) and mu == 0 or not is_traced(damp) and damp != 0):
        raise ValueError(
            "invalid nesterov=True: it requires momentum > 0 and dampening = 0; "
            "set momentum or turn nesterov off"
        )
    has_momentum = keeps_momentum_buffer(momentum)
    rules = [(trace_leaf, dict(momentum=momentum, dampening=dampening, nesterov=nesterov))]
    plain_step = leaf_step(rules if has_momentum else [], maximize=maximize)
    # A tensor momentum holding 0 keeps its buffer, as the chain's trace does, unused: the
    # step is g whatever the dampening, as torch's, and the buffer is passed on as it was.
    # A traced one (vmap) runs the plain path, whose trace_leaf takes each member's 0 there.
    momentum_on = has_momentum and (is_traced(mu) or mu != 0)

    def streaming_spec(step, lr, weight_decay):
        hyperparameters = [lr, mu, damp, weight_decay, nesterov, step == 1, momentum_on]
        return "sgd", hyperparameters, ("momentum_buffer" if momentum_on else None,)

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        gs = maximized(gs, maximize)
        old = buffers.get("momentum_buffer")
        if streaming.usable([*ps, *gs, *(old or [])]):
            name, hyperparameters, _ = streaming_spec(step, lr, weight_decay)
            new_ps, bufs = streaming.update(name, hyperparameters,
                                            [ps, gs, old if momentum_on else None], outputs)
            return new_ps, kept(bufs, old)
        if ps[0].dtype in _HALVES:
            return loop_step(ps, gs, old, step, lr, weight_decay, outputs)
        ps = owned(ps, outputs)
        bufs = []
        if momentum_on:
            # The kernel overwrites the buffers on the first step, so they need no copy.
            fresh = step == 1 and outputs is not None
            bufs = outputs(old) if fresh else owned(old, outputs)
        torch._fused_sgd_(
            ps, gs, bufs, weight_decay=weight_decay, momentum=float(mu), lr=lr,
            dampening=float(damp), nesterov=nesterov, maximize=False,
            is_first_step=step == 1,
        )
        return ps, kept(bufs, old)

    def loop_step(ps, gs, old, step, lr, weight_decay, outputs):
        # torch.optim.SGD's default path on CPU (``_single_tensor_sgd``), op for op: on CPU
        # ``_fused_sgd_`` skips bf16/fp16 elements in whole SIMD blocks, and torch's foreach
        # ops round a bf16/fp16 ``mul_`` by a number otherwise than ``Tensor.mul_``.
        ps = owned(ps, outputs)
        bufs = []
        if momentum_on:  # written whole on the first step: no copy of the old ones
            bufs = (old if outputs is None else outputs(old)) if step == 1 else \
                owned(old, outputs)
        for i, (p, g) in enumerate(zip(ps, gs, strict=True)):
            if weight_decay != 0:
                g = g.add(p, alpha=weight_decay)
            if momentum_on:
                if step == 1:  # torch's buffer starts as a copy of the grad
                    bufs[i].copy_(g)
                else:
                    bufs[i].mul_(float(mu)).add_(g, alpha=1 - damp)
                g = g.add(bufs[i], alpha=float(mu)) if nesterov else bufs[i]
            p.add_(g, alpha=-lr)
        return ps, kept(bufs, old)

    def kept(bufs, old):
        if momentum_on:
            return {"momentum_buffer": bufs}
        return {"momentum_buffer": old} if has_momentum else {}

    rule = Rule(
        buffers=("momentum_buffer",) if has_momentum else (),
        init_buffer=lambda name, p: torch.zeros_like(p, memory_format=torch.preserve_format),
        plain_step=plain_step,
        fast_step=fast_step,
        streaming=None if maximize or momentum_on != has_momentum else streaming_spec,
    )
    lr = lr if callable(lr) else hyperparameter("lr", lr)
    return make_optimizer(SGDState, rule, lr, weight_decay, mask, impl, (momentum, dampening))


def sgd_chain(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float | Tensor = 0.0,
    dampening: float | Tensor = 0.0,
    nesterov: bool = False,
    weight_decay: float | Tensor = 0.0,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
) -> GradientTransformation:
    """The chain of transformations :func:`sgd` runs.

    >>> import torch, minitrain as mt
    >>> tx = sgd_chain(lr=0.1, momentum=0.9)
    >>> [name for name, _ in map(mt.optim.spec, mt.optim.spec(tx)[1]["transforms"])]
    ['add_decayed_weights', 'trace', 'scale_by_learning_rate']
    """
    keeps = keeps_momentum_buffer(momentum)
    momentum_part = [trace(momentum, dampening, nesterov)] if keeps else []
    return torch_order(momentum_part, lr, maximize=maximize,
                       decay=add_decayed_weights(weight_decay, mask))


def _match(tx: GradientTransformation):
    """Lower ``as_optimizer`` of an SGD-shaped chain to :func:`sgd`'s fast path."""
    for core in ("trace", None):
        found = chain_lowering(tx, core)
        if found is None:
            continue
        parts, before, clip_norm, decoupled, weight_decay, mask, lr = found
        if parts["rules"] not in (["trace"], []) or decoupled and parts["rules"] and not (
            isinstance(weight_decay, int | float) and weight_decay == 0
        ):
            return None
        t = parts.get("trace", dict(momentum=0.0, dampening=0.0, nesterov=False))
        optimizer = sgd(lr, t["momentum"], t["dampening"], t["nesterov"], weight_decay,
                        mask=mask, impl="fast")
        return register_alias(tx, optimizer, SGDState, "trace", ("momentum_buffer",), before,
                              clip_norm)
    return None


register_lowering(_match)
