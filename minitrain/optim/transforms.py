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

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim import _flat
from minitrain.optim.kernels import streaming
from minitrain.optim._core import (
    EmptyState,
    GradientTransformation,
    floating_updates,
    hyperparameter,
    tagged,
    tensor_leaves,
)
from minitrain.optim._transforms_rules import *  # noqa: F403  (listed in __all__)
from minitrain.optim._transforms_rules import __all__ as _rules
from minitrain.optim._transforms_wrappers import *  # noqa: F403  (listed in __all__)
from minitrain.optim._transforms_wrappers import __all__ as _wrappers
from minitrain.optim.base import BufferPool, check_hyperparameter, is_traced
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


def clip_scale(grads: Grads, max_norm: float | int | Tensor) -> float:
    """The factor :func:`clip_by_global_norm` multiplies plain CPU or GPU grads by, as a Python
    float (``min(1, max_norm / (norm + 1e-6))`` in float32, float64 when a grad is fp64).

    >>> clip_scale([torch.tensor([3.0, 4.0])], 1.0)
    0.19999995827674866
    """
    check_hyperparameter("max_norm", max_norm, 0.0, low_open=True)
    return _scale_of(grads, _flat.flatten(grads)[0], max_norm)


def _scale_of(grads: Grads, leaves: list, max_norm: Any) -> float:
    scale_ = _norm_and_scale(grads, leaves, max_norm)[1]
    return scale_ if isinstance(scale_, float) else float(scale_)


def clip_scale_later(grads: Grads, leaves: list, max_norm: float | int | Tensor
                     ) -> float | Callable[[], float]:
    """:func:`clip_scale` of ``grads`` (flattened: ``leaves``), or a function that computes it
    when called, where that runs none of the caller's code: a Python-number ``max_norm``, and
    plain float32 CPU leaves that the kernels' pass takes, with no torch mode active. A lowered
    chain calls it after the update's checks, as the kernel is about to run (the pass re-checks
    the leaves' storage; a torch mode entered meanwhile is refused).

    >>> later = clip_scale_later(None, [torch.tensor([3.0, 4.0])], 1.0)
    >>> later() if callable(later) else later
    0.19999995827674866
    """
    check_hyperparameter("max_norm", max_norm, 0.0, low_open=True)
    if not (_exact_number(max_norm) and _kernel_norm(leaves)):
        return _scale_of(grads, leaves, max_norm)

    def later() -> float:
        if not streaming.usable(()):
            raise RuntimeError("a torch mode was entered during an update with a clip; enter it "
                               "before the update instead")
        return clip_factor(float(streaming.global_norm(leaves)), max_norm)

    return later


def clip_factor(norm: float, max_norm: float | int) -> float:
    """``torch.clamp(max_norm / (norm + 1e-6), max=1.0)`` for a float32 ``norm`` (a 0-d float32
    tensor) and a Python number ``max_norm``, in plain Python: torch's float32 ops (``t +
    1e-6``; ``max_norm / t``, which torch runs as ``t.reciprocal() * max_norm``; the clamp, NaN
    passing through), each done in float64 and rounded to float32 once, which gives float32's
    own results (:func:`~minitrain.optim.kernels.streaming.float32`).

    >>> clip_factor(5.0, 1.0), clip_factor(0.5, 1.0)
    (0.19999995827674866, 1.0)
    """
    f32 = streaming.float32
    shifted = f32(norm + f32(1e-6))
    reciprocal = f32(1.0 / shifted) if shifted != 0 else math.copysign(math.inf, shifted)
    return min(f32(reciprocal * f32(float(max_norm))), 1.0)  # min(nan, 1.0): nan, as clamp


def _kernel_norm(leaves: list) -> bool:
    """Whether the streaming kernels' one pass can take the global norm of these leaves."""
    return bool(leaves) and all(isinstance(g, Tensor) for g in leaves) and \
        streaming.usable(leaves) and all(streaming._storage_holds(g) for g in leaves)


def _exact_number(max_norm: Any) -> bool:
    """Whether ``max_norm`` is a Python number :func:`clip_factor` takes exactly: a float, or an
    int up to 2**53 (which converts to float64 exactly: one rounding to float32, as torch's)."""
    return type(max_norm) is float or type(max_norm) is int and abs(max_norm) <= 2**53


def _norm_and_scale(grads: Grads, leaves: list, max_norm: Any) -> tuple[Tensor, Tensor | float]:
    """The global norm of ``grads`` and the clip's factor: a Python float on the kernels' path
    with a number ``max_norm`` (no torch op after the pass), else a 0-d tensor."""
    # ``tree.global_norm(grads)``; for float32 CPU leaves, one pass of the streaming kernels'
    # sum of squares over all of them (torch's ``_foreach_norm`` then the norm of the norms, as
    # in ``clip_grad_norm_``, otherwise).
    kernel = _kernel_norm(leaves)
    norm = streaming.global_norm(leaves) if kernel else tree.global_norm(grads)
    if kernel and _exact_number(max_norm):
        return norm, clip_factor(float(norm), max_norm)
    return norm, torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _clip(grads: Grads, max_norm: float | int | Tensor) -> tuple[Grads, Tensor]:
    check_hyperparameter("max_norm", max_norm, 0.0, low_open=True)
    leaves = tree.leaves(grads)
    if not leaves:  # a group of multi_transform or masked that holds no leaf
        return grads, tree.global_norm(grads)  # 0, float32 on the CPU
    if any(is_traced(g) for g in leaves) or is_traced(max_norm) or \
            torch.compiler.is_compiling():
        norm = torch.linalg.vector_norm(torch.stack([
            (g if g.dtype == torch.float64 else g.float()).norm() for g in leaves]))
        scale_ = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return tree.map(lambda g: g * scale_.to(g.dtype), grads), norm
    norm, scale_ = _norm_and_scale(grads, leaves, max_norm)
    if isinstance(scale_, Tensor) and torch.is_grad_enabled() and (
            any(g.requires_grad for g in leaves)
            or isinstance(max_norm, Tensor) and max_norm.requires_grad):
        return tree.map(lambda g: g * scale_.to(g.dtype), grads), norm
    on_cpu = not isinstance(scale_, Tensor) or scale_.is_cpu
    if on_cpu and float(scale_) == 1.0:  # within the bound: multiplying by 1 is exact
        return grads, norm
    groups: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(leaves):
        groups.setdefault(g.dtype, []).append(i)
    out = list(leaves)
    # A Python number on CPU: aten's scalar overload (a float32 factor either way, so the same
    # products as multiplying by the 0-d tensor).
    factors = {dtype: float(scale_) if on_cpu else scale_.to(dtype) for dtype in groups}
    # Recycled output buffers: fresh memory for every step's clipped grads costs page faults
    # (see base.BufferPool), more than the multiplication itself.
    with torch.no_grad(), _POOL.lock:
        _POOL.begin_update()
        for i, g in enumerate(leaves):
            out[i] = torch.mul(g, factors[g.dtype], out=_POOL.empty_like(g))
    return tree.unflatten(tree.structure(grads), out), norm


_POOL = BufferPool()
