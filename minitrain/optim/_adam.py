"""Adam and AdamW as ``torch.optim.Adam`` / ``torch.optim.AdamW`` (Kingma & Ba 2015,
Algorithm 1; Loshchilov & Hutter 2019 for decoupled weight decay; Reddi et al. 2018 for AMSGrad).

Each is a chain of transformations (:func:`adam_chain`): ``[scale(-1) if maximize]``, L2 decay
``add_decayed_weights`` (Adam) before ``scale_by_adam`` or after it (AdamW, decoupled), then
``scale_by_learning_rate``. The plain path runs exactly that chain's per-leaf math; the fast
path lowers it to ``torch._fused_adam(w)_`` or the streaming kernel, and ``as_optimizer`` of
the same chain built by hand takes that lowering too.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from minitrain.optim.kernels import streaming
from minitrain.optim._core import (
    GradientTransformation,
    check_pair,
    hyperparameter,
    register_lowering,
)
from minitrain.optim._family import torch_order
from minitrain.optim._lowering import (
    GradScale,
    chain_lowering,
    leaf_step,
    maximized,
    register_alias,
)
from minitrain.optim._transforms_rules import (
    adam_leaf,
    add_decayed_weights,
    scale_by_adam,
)
from minitrain.optim.base import (
    Optimizer,
    Rule,
    ScalarOrSchedule,
    WeightDecayMask,
    check_hyperparameter,
    make_optimizer,
    owned,
    scalar,
    step_tensors,
)
from minitrain.tree import Params

__all__ = ["AdamState", "adam", "adamw", "adam_chain"]


class AdamState(NamedTuple):
    """``count``, last ``lr``, ``exp_avg``, ``exp_avg_sq``; ``max_exp_avg_sq`` or ``()``."""

    count: Tensor
    lr: Tensor
    exp_avg: Params
    exp_avg_sq: Params
    max_exp_avg_sq: Params


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float | Tensor = 1e-8,
    weight_decay: float | int | Tensor = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
    impl: str = "auto",
    decoupled_weight_decay: bool = False,
) -> Optimizer:
    """Adam with L2 weight decay, with ``torch.optim.Adam``'s arguments and defaults;
    ``decoupled_weight_decay=True`` makes it AdamW (as torch's Adam then is).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adam(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([5.0, -0.01])}, state, params)
    >>> params["w"]  # the first step moves each coordinate by about lr
    tensor([0.9000, 1.1000])
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, mask, impl,
                 decoupled=bool(decoupled_weight_decay))


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float | Tensor = 1e-8,
    weight_decay: float | int | Tensor = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """Adam with decoupled weight decay, with ``torch.optim.AdamW``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adamw(lr=0.1, weight_decay=0.5, mask=lambda name, p: p.ndim >= 2)
    >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
    >>> state = opt.init(params)
    >>> grads = {"w": torch.zeros(1, 1), "b": torch.zeros(1)}
    >>> params, state = opt.update(grads, state, params)
    >>> params["w"].item(), params["b"].item()  # only the matrix decays: 1 - 0.1 * 0.5
    (0.949999988079071, 1.0)
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, mask, impl, decoupled=True)


def adam_chain(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float | Tensor = 1e-8,
    weight_decay: float | int | Tensor = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
    decoupled: bool = False,
) -> GradientTransformation:
    """The chain of transformations :func:`adam` (``decoupled=False``) or :func:`adamw` runs.

    >>> import torch, minitrain as mt
    >>> tx = adam_chain(lr=0.1, weight_decay=0.5, decoupled=True)
    >>> [name for name, _ in map(mt.optim.spec, mt.optim.spec(tx)[1]["transforms"])]
    ['scale_by_adam', 'add_decayed_weights', 'scale_by_learning_rate']
    """
    return torch_order([scale_by_adam(*betas, eps=eps, amsgrad=amsgrad)], lr, maximize=maximize,
                       decay=add_decayed_weights(weight_decay, mask), decoupled=decoupled)


def _adam(lr, betas, eps, weight_decay, amsgrad, maximize, mask, impl, *, decoupled,
          grad_scale=None):
    """``grad_scale``: a :class:`GradScale` a lowered chain sets to fold a global-norm clip into
    the update (the grads are multiplied by it first)."""
    beta1, beta2 = check_pair("betas", betas)
    check_hyperparameter("betas[0]", beta1, 0.0, 1.0, high_open=True)
    check_hyperparameter("betas[1]", beta2, 0.0, 1.0, high_open=True)
    eps = hyperparameter("eps", eps)
    check_hyperparameter("eps", eps, 0.0)
    weight_decay = hyperparameter("weight_decay", weight_decay)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    buffers = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    hyper = dict(beta1=beta1, beta2=beta2, eps=eps, amsgrad=amsgrad)
    plain_step = leaf_step(adam_leaf, hyper, decoupled=decoupled, maximize=maximize,
                           unused=() if amsgrad else ("max_exp_avg_sq",))
    b1, b2, e = scalar(beta1), scalar(beta2), scalar(eps)

    def streaming_spec(step, lr, weight_decay):
        factor = 1.0 if grad_scale is None else grad_scale  # read by the kernel call, last
        hyperparameters = [
            b1, b2, e, weight_decay, lr, lr / (1 - b1**step), math.sqrt(1 - b2**step),
            decoupled, amsgrad, factor,
        ]
        return "adam", hyperparameters, ("exp_avg", "exp_avg_sq",
                                         "max_exp_avg_sq" if amsgrad else None)

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        gs = maximized(gs, maximize)
        if streaming.usable([*ps, *gs, *sum(buffers.values(), [])]):
            _, hyperparameters, _ = streaming_spec(step, lr, weight_decay)
            slots = [ps, gs, buffers["exp_avg"], buffers["exp_avg_sq"],
                     buffers.get("max_exp_avg_sq")]
            new_ps, *new_buffers = streaming.update("adam", hyperparameters, slots, outputs)
            return new_ps, dict(zip(buffers, new_buffers, strict=False))
        factor = 1.0 if grad_scale is None else grad_scale.value
        if factor != 1.0:
            gs = torch._foreach_mul(gs, factor)
        ps = owned(ps, outputs)
        new = {name: owned(buffers[name], outputs) for name in buffers}
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(
            ps, gs, new["exp_avg"], new["exp_avg_sq"], new.get("max_exp_avg_sq", []),
            step_tensors(step, ps), lr=lr, beta1=float(b1), beta2=float(b2),
            weight_decay=weight_decay, eps=float(e), amsgrad=amsgrad, maximize=False,
        )
        return ps, new

    rule = Rule(
        buffers=buffers,
        init_buffer=lambda name, p: torch.zeros_like(p, memory_format=torch.preserve_format),
        plain_step=plain_step,
        fast_step=fast_step,
        streaming=None if maximize else streaming_spec,
    )
    return make_optimizer(AdamState, rule, hyperparameter("lr", lr) if not callable(lr) else lr,
                          weight_decay, mask, impl, (beta1, beta2, eps))


def _match(tx: GradientTransformation):
    """Lower ``as_optimizer(adam_chain(...))`` (built by hand, optionally after
    ``clip_by_global_norm``) to :func:`adam` / :func:`adamw`'s fast path."""
    found = chain_lowering(tx, "scale_by_adam")
    if found is None:
        return None
    parts, before, clip_norm, decoupled, weight_decay, mask, lr = found
    if parts["rules"] != ["scale_by_adam"]:
        return None
    adam_spec = parts["scale_by_adam"]
    scale = GradScale()
    optimizer = _adam(lr, (adam_spec["beta1"], adam_spec["beta2"]), adam_spec["eps"],
                      weight_decay, adam_spec["amsgrad"], False, mask, "fast",
                      decoupled=decoupled, grad_scale=scale)
    return register_alias(tx, optimizer, AdamState, "scale_by_adam",
                          ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), before, clip_norm,
                          fold_clip=scale)


register_lowering(_match)
