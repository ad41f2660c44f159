"""AdaGrad as ``torch.optim.Adagrad`` (Duchi et al. 2011; torch docs' algorithm box).

The chain (:func:`adagrad_chain`): ``[scale(-1) if maximize] [add_decayed_weights]
scale_by_adagrad(lr_decay, initial_accumulator_value, eps) scale_by_learning_rate``. The plain
path runs its per-leaf math; the fast path lowers it to ``torch._fused_adagrad_`` or the
streaming kernel.
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
    adagrad_leaf,
    add_decayed_weights,
    filled,
    scale_by_adagrad,
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

__all__ = ["AdagradState", "adagrad", "adagrad_chain"]


class AdagradState(NamedTuple):
    """``count`` updates done, the last ``lr``, and ``sum`` of squared gradients per leaf."""

    count: Tensor
    lr: Tensor
    sum: Params


def adagrad(
    lr: ScalarOrSchedule = 1e-2,
    lr_decay: float | Tensor = 0.0,
    weight_decay: float | Tensor = 0.0,
    initial_accumulator_value: float | Tensor = 0.0,
    eps: float | Tensor = 1e-10,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
    impl: str = "auto",
) -> Optimizer:
    """AdaGrad with ``torch.optim.Adagrad``'s arguments and defaults.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adagrad(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([3.0, -0.5])}, state, params)
    >>> params["w"]  # each coordinate moves by lr on the first step
    tensor([0.9000, 1.1000])
    """
    lr_decay, eps = hyperparameter("lr_decay", lr_decay), hyperparameter("eps", eps)
    check_hyperparameter("lr_decay", lr_decay, 0.0)
    weight_decay = hyperparameter("weight_decay", weight_decay)
    check_hyperparameter("weight_decay", weight_decay, 0.0)
    initial = hyperparameter("initial_accumulator_value", initial_accumulator_value)
    check_hyperparameter("initial_accumulator_value", initial, 0.0)
    check_hyperparameter("eps", eps, 0.0)
    plain_step = leaf_step(adagrad_leaf, dict(lr_decay=lr_decay, eps=eps), maximize=maximize)
    decay, e = scalar(lr_decay), scalar(eps)

    def streaming_spec(step, lr, weight_decay):
        return "adagrad", [lr / (1 + (step - 1) * decay), weight_decay, e], ("sum",)

    def fast_step(ps, gs, buffers, step, lr, weight_decay, outputs):
        gs = maximized(gs, maximize)
        if streaming.usable([*ps, *gs, *buffers["sum"]]):
            _, hyperparameters, _ = streaming_spec(step, lr, weight_decay)
            slots = [ps, gs, buffers["sum"]]
            new_ps, sums = streaming.update("adagrad", hyperparameters, slots, outputs)
            return new_ps, {"sum": sums}
        ps, sums = owned(ps, outputs), owned(buffers["sum"], outputs)
        torch._fused_adagrad_(
            ps, gs, sums, step_tensors(step, ps), lr=lr, lr_decay=float(decay),
            weight_decay=weight_decay, eps=float(e), maximize=False,
        )
        return ps, {"sum": sums}

    rule = Rule(("sum",), lambda name, p: filled(p, initial), plain_step, fast_step,
                streaming=None if maximize else streaming_spec)
    lr = lr if callable(lr) else hyperparameter("lr", lr)
    # The initial value reaches the update through the state only: watched all the same.
    return make_optimizer(AdagradState, rule, lr, weight_decay, mask, impl,
                          (lr_decay, eps, initial))


def adagrad_chain(
    lr: ScalarOrSchedule = 1e-2,
    lr_decay: float | Tensor = 0.0,
    weight_decay: float | Tensor = 0.0,
    initial_accumulator_value: float | Tensor = 0.0,
    eps: float | Tensor = 1e-10,
    *,
    maximize: bool = False,
    mask: WeightDecayMask = None,
) -> GradientTransformation:
    """The chain of transformations :func:`adagrad` runs.

    >>> import torch, minitrain as mt
    >>> [name for name, _ in map(mt.optim.spec, mt.optim.spec(adagrad_chain())[1]["transforms"])]
    ['add_decayed_weights', 'scale_by_adagrad', 'scale_by_learning_rate']
    """
    return torch_order([scale_by_adagrad(lr_decay, initial_accumulator_value, eps)], lr,
                       maximize=maximize, decay=add_decayed_weights(weight_decay, mask))


def _match(tx: GradientTransformation):
    """Lower ``as_optimizer`` of an AdaGrad-shaped chain to :func:`adagrad`'s fast path."""
    found = chain_lowering(tx, "scale_by_adagrad")
    if found is None:
        return None
    parts, before, clip_norm, decoupled, weight_decay, mask, lr = found
    if parts["rules"] != ["scale_by_adagrad"] or decoupled and weight_decay != 0:
        return None
    rule = parts["scale_by_adagrad"]
    optimizer = adagrad(lr, rule["lr_decay"], weight_decay, 0.0, rule["eps"], mask=mask,
                        impl="fast")
    return register_alias(tx, optimizer, AdagradState, "scale_by_adagrad", ("sum",), before,
                          clip_norm)


register_lowering(_match)
