"""Gradient transformations, the building blocks of every optimizer (optax names, torch math).

The rules live in ``_transforms_rules`` (per-leaf math) and ``_transforms_wrappers`` (routing,
accumulation, skipping, averaging, injected hyperparameters); this module adds global-norm
clipping and is the public index of them all.

Leaves. Every transformation (and wrapper) takes trees of tensors: a leaf that is no tensor, in
the updates or the params (a Python or numpy number, None, a string), is a one-line
``ValueError`` naming the leaf and how to pass it (``torch.tensor(2.0)``), at init and at update
alike (``_core.tagged`` checks it once for all, before the transformation runs). An integer or
bool update is promoted to a floating dtype before any transformation sees it: its param's
dtype where params are given and that param is floating-point or complex (torch's promotion of
``int_tensor + param``; optax's JAX promotion with the state in the params' dtype), else the
default float dtype (torch's ``int_tensor * 0.5``, as :func:`reduce_on_plateau` does). So
``scale_by_adam``, ``trace``, ``scale_by_sign`` or ``clip`` of an integer update equal their
result on the promoted float update, and the updates that come out are floating-point.
A transformation that keeps a state like each param (the per-leaf rules with buffers,
``MultiSteps``' sum, ``ema``'s average) refuses integer and bool params at init in one line,
as the optimizers do: such a state would truncate, and ``torch.lerp`` has no integer kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import (
    check_hyperparameter,
    floating_updates,
    hyperparameter,
    tensor_leaves,
    use_plain_path,
)
from minitrain.optim._transforms_rules import *  # noqa: F403  (listed in __all__)
from minitrain.optim._transforms_rules import __all__ as _rules
from minitrain.optim._transforms_wrappers import *  # noqa: F403  (listed in __all__)
from minitrain.optim._transforms_wrappers import __all__ as _wrappers
from minitrain.optim.base import EmptyState, GradientTransformation, tagged
from minitrain.tree import Grads

__all__ = ["clip_by_global_norm", "ClipByGlobalNormState", *_rules, *_wrappers]

ClipByGlobalNormState = EmptyState


_NOT_GIVEN = object()


def clip_by_global_norm(grads_or_max_norm: Any = _NOT_GIVEN, max_norm: Any = None) -> Any:
    """Scale updates so that their joint L2 norm is at most ``max_norm``.

    Two forms (optax's and minitrain's earlier function): ``clip_by_global_norm(max_norm)``
    returns the transformation; ``clip_by_global_norm(grads, max_norm)`` returns the clipped
    grads and the norm before clipping (``clip_by_global_norm(max_norm=1.0)`` is the first).
    The scale is ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``;
    empty grads pass through with a norm of 0, as there. A tensor ``max_norm`` that requires
    grad, or is traced (``vmap`` over it), takes tensor ops, so the update stays differentiable
    in it.

    >>> import torch
    >>> grads, norm = clip_by_global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
    >>> norm, grads["a"], grads["b"]
    (tensor(5.), tensor([0.6000]), tensor([0.8000]))
    >>> tx = clip_by_global_norm(1.0)
    >>> tx.update([torch.tensor([3.0, 4.0])], tx.init([torch.zeros(2)]))[0]
    [tensor([0.6000, 0.8000])]
    """
    if grads_or_max_norm is _NOT_GIVEN:
        if max_norm is None:
            raise ValueError("clip_by_global_norm needs max_norm: clip_by_global_norm(1.0)")
        return _clip_transform(max_norm)
    if max_norm is None:
        return _clip_transform(grads_or_max_norm)
    tensor_leaves("clip_by_global_norm", grads_or_max_norm, "grads leaf")
    return _clip(floating_updates("clip_by_global_norm", grads_or_max_norm), max_norm)


def _clip_transform(max_norm: Any) -> GradientTransformation:
    max_norm = hyperparameter("max_norm", max_norm)
    check_hyperparameter("max_norm", max_norm, 0.0, low_open=True)

    def update(updates, state, params=None):
        return _clip(updates, max_norm)[0], state

    return tagged("clip_by_global_norm", GradientTransformation(lambda p: EmptyState(), update),
                  max_norm=max_norm)


def _clip(grads: Grads, max_norm: float | int | Tensor) -> tuple[Grads, Tensor]:
    check_hyperparameter("max_norm", max_norm, 0.0, low_open=True)
    leaves = tree.leaves(grads)
    norm = tree.global_norm(grads)  # 0, float32 on the CPU, for a group that holds no leaf
    if not leaves:
        return grads, norm
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if use_plain_path(leaves, [max_norm]):  # traced, or differentiable in grads or max_norm
        return tree.map(lambda g: g * factor.to(g.dtype), grads), norm
    if factor.is_cpu and float(factor) == 1.0:  # within the bound: multiplying by 1 is exact
        return grads, norm
    with torch.no_grad():
        out = [torch.mul(g, factor.to(g.dtype) if g.device != factor.device or
                         g.dtype != factor.dtype else factor) for g in leaves]
    return tree.unflatten(tree.structure(grads), out), norm
