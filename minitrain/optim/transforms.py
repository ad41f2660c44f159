"""Gradient transforms: pure functions from grads to grads."""

from __future__ import annotations

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim.base import check_hyperparameter, is_traced
from minitrain.tree import Grads

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(grads: Grads, max_norm: float) -> tuple[Grads, Tensor]:
    """Scale ``grads`` so that their joint L2 norm is at most ``max_norm``.

    Returns the clipped grads and the norm before clipping. The scale is
    ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``.

    >>> import torch
    >>> grads, norm = clip_by_global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
    >>> norm, grads["a"], grads["b"]
    (tensor(5.), tensor([0.6000]), tensor([0.8000]))
    """
    check_hyperparameter("max_norm", max_norm, 0.0, low_open=True)
    leaves = tree.leaves(grads)
    if not leaves:
        raise ValueError("grads has no leaves; pass a pytree of tensors")
    if any(is_traced(g) for g in leaves) or torch.compiler.is_compiling():
        norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in leaves]))
    else:
        norm = tree.global_norm(grads)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tree.map(lambda g: g * scale.to(g.dtype), grads), norm
