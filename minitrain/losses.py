"""Losses: pure functions returning a 0-d tensor.

>>> import torch
>>> mse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
tensor(2.)
"""

from __future__ import annotations

import torch.nn.functional as F

from minitrain.typecheck import Float, Int, Tensor, typechecked

__all__ = ["mse", "cross_entropy"]


@typechecked
def mse(pred: Float[Tensor, "*batch"], target: Float[Tensor, "*batch"]) -> Float[Tensor, ""]:
    """Mean squared error, as ``F.mse_loss`` (the chapter's regression loss).

    Shapes must match exactly: a ``(B,)`` prediction against a ``(B, 1)`` target is an error,
    never a silent ``(B, B)`` broadcast.
    """
    return F.mse_loss(pred, target.to(pred.dtype))


@typechecked
def cross_entropy(
    logits: Float[Tensor, "*batch vocab"], targets: Int[Tensor, "*batch"]
) -> Float[Tensor, ""]:
    """Mean cross-entropy in nats over all positions, as ``F.cross_entropy``.

    >>> import torch
    >>> cross_entropy(torch.zeros(2, 4), torch.tensor([0, 3]))  # uniform over 4: ln 4
    tensor(1.3863)
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
