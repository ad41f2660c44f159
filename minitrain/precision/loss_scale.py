"""Dynamic loss scaling, functional: ``torch.amp.GradScaler`` rewritten as pure functions.

The state, 0-d tensors, equals GradScaler's step for step and is vmappable (each member of a
sweep carries its own scale); a non-finite step is skipped with :func:`select_tree`.

>>> import torch
>>> ls = dynamic_loss_scale(init_scale=4.0)
>>> f = scaled_value_and_grad(lambda p, x: (p["w"] * x).sum(), ls)
>>> loss, grads, finite, state = f({"w": torch.ones(2)}, ls.init(), torch.tensor([1.0, 2.0]))
>>> loss, grads, finite, state.scale
(tensor(3.), {'w': tensor([1., 2.])}, tensor(True), tensor(4.))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from minitrain.tree import Grads, Params, PyTree
from minitrain.tree import leaves as tree_leaves
from minitrain.tree import map as tree_map

__all__ = ["DynamicLossScale", "LossScaleState", "all_finite", "dynamic_loss_scale",
           "scaled_value_and_grad", "select_tree"]


class LossScaleState(NamedTuple):
    """GradScaler's two counters as 0-d tensors: the scale (fp32) and the number of finite steps
    since the last change (int32)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor


class DynamicLossScale(NamedTuple):
    """``init() -> state``; ``scale_loss(loss, state)``; ``unscale_and_check(grads, state) ->
    (grads, finite, new_state)``."""

    init: Callable[[], LossScaleState]
    scale_loss: Callable[[torch.Tensor, LossScaleState], torch.Tensor]
    unscale_and_check: Callable[[Grads, LossScaleState], tuple[Grads, torch.Tensor, LossScaleState]]


def all_finite(tree: PyTree) -> torch.Tensor:
    """0-d bool: whether every element of every tensor leaf is finite.

    >>> all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])})
    tensor(False)
    """
    leaves = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    if not leaves:
        return torch.tensor(True)
    return torch.stack([torch.isfinite(t).all() for t in leaves]).all()


def select_tree(pred: torch.Tensor, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leaf by leaf ``torch.where(pred, on_true, on_false)``: a branch that works under vmap.

    >>> select_tree(torch.tensor(False), {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    {'w': tensor([0., 0.])}
    """
    return tree_map(lambda a, b: torch.where(pred, a, b) if isinstance(a, torch.Tensor) else a,
                    on_true, on_false)


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> DynamicLossScale:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s defaults and arithmetic: grads times
    ``1 / scale`` (float64, then fp32); a non-finite step is skipped and the scale backs off;
    ``growth_interval`` finite steps grow it, if it stays finite (``_amp_update_scale_``).

    >>> ls = dynamic_loss_scale(init_scale=8.0, growth_interval=2)
    >>> state = ls.init()
    >>> grads, finite, state = ls.unscale_and_check({"w": torch.tensor([16.0])}, state)
    >>> grads, finite, state.scale
    ({'w': tensor([2.])}, tensor(True), tensor(8.))
    >>> _, finite, state = ls.unscale_and_check({"w": torch.tensor([float("inf")])}, state)
    >>> finite, state.scale, state.growth_tracker
    (tensor(False), tensor(4.), tensor(0, dtype=torch.int32))
    """
    if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
        raise ValueError(
            f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor} and "
            f"{backoff_factor}"
        )
    if growth_interval < 1 or init_scale <= 0:
        raise ValueError("growth_interval must be >= 1 and init_scale > 0")

    def init() -> LossScaleState:
        return LossScaleState(
            torch.tensor(init_scale, dtype=torch.float32), torch.tensor(0, dtype=torch.int32)
        )

    def scale_loss(loss: torch.Tensor, state: LossScaleState) -> torch.Tensor:
        return loss * state.scale.to(loss.device)  # GradScaler.scale: outputs * self._scale

    def unscale_and_check(
        grads: Grads, state: LossScaleState
    ) -> tuple[Grads, torch.Tensor, LossScaleState]:
        finite = all_finite(grads)  # _amp_foreach_non_finite_check_and_unscale_
        inv_scale = state.scale.double().reciprocal().float()  # GradScaler.unscale_
        grads = tree_map(lambda g: g * inv_scale, grads)
        # _amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp)
        successful = state.growth_tracker + 1
        grown = (state.scale.double() * growth_factor).float()
        grow = successful == growth_interval
        scale = torch.where(
            finite,
            torch.where(grow & torch.isfinite(grown), grown, state.scale),
            (state.scale.double() * backoff_factor).float(),
        )
        tracker = torch.where(finite & ~grow, successful, torch.zeros_like(successful))
        return grads, finite, LossScaleState(scale, tracker)

    return DynamicLossScale(init, scale_loss, unscale_and_check)


def scaled_value_and_grad(
    loss_fn: Callable[..., Any], loss_scale: DynamicLossScale, has_aux: bool = False
) -> Callable[..., tuple[Any, Grads, torch.Tensor, LossScaleState]]:
    """``f(params, scale_state, *args) -> (value, grads, finite, new_scale_state)``, value and
    grads unscaled; the caller updates only where ``finite`` (:func:`select_tree`), as
    ``GradScaler.step`` skips ``optimizer.step()``. Example: the module docstring."""

    def scaled(params: Params, state: LossScaleState, *args: Any, **kwargs: Any):
        out = loss_fn(params, *args, **kwargs)
        loss, aux = out if has_aux else (out, {})
        return loss_scale.scale_loss(loss, state), (loss.detach(), aux)

    grad_and_value = torch.func.grad_and_value(scaled, has_aux=True)

    def wrapped(params: Params, state: LossScaleState, *args: Any, **kwargs: Any):
        grads, (_, (loss, aux)) = grad_and_value(params, state, *args, **kwargs)
        grads, finite, state = loss_scale.unscale_and_check(grads, state)
        return ((loss, aux) if has_aux else loss), grads, finite, state

    return wrapped
