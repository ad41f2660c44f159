"""Losses: pure functions with torch's ``reduction`` argument.

``reduction="mean"`` (the default) and ``"sum"`` return a 0-d tensor; ``"none"`` returns one loss
per element (per position for :func:`cross_entropy`), the per-example losses DP-SGD and
per-example gradient norms start from.

>>> import torch
>>> mse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
tensor(2.)
>>> mse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]), reduction="none")
tensor([0., 4.])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minitrain.typecheck import Float, Integer, Tensor, TypeCheckError

__all__ = ["mse", "cross_entropy"]

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none' "
                         "(torch.nn.functional's choices)")


def mse(
    pred: Float[Tensor, "*batch"], target: Float[Tensor, "*batch"], reduction: str = "mean"
) -> Float[Tensor, ""] | Float[Tensor, "*batch"]:
    """Squared error, as ``F.mse_loss``: its mean (default), sum, or each element (``"none"``).

    Shapes must match exactly: a ``(B,)`` prediction against a ``(B, 1)`` target is an error,
    never a silent ``(B, B)`` broadcast.

    >>> import torch
    >>> mse(torch.zeros(2), torch.tensor([1.0, 3.0]), reduction="sum")
    tensor(10.)
    """
    _check_reduction(reduction)  # the annotations, checked in a few attribute reads
    if not (isinstance(pred, Tensor) and isinstance(target, Tensor) and pred.is_floating_point()
            and target.is_floating_point() and pred.shape == target.shape):
        raise TypeCheckError(f"mse: pred {_described(pred)} and target {_described(target)} "
                             "must be floating tensors of one shape (*batch), never broadcast")
    return F.mse_loss(pred, target.to(pred.dtype), reduction=reduction)


def cross_entropy(
    logits: Float[Tensor, "*batch vocab"], targets: Integer[Tensor, "*batch"],
    reduction: str = "mean",
) -> Float[Tensor, ""] | Float[Tensor, "*batch"]:
    """Cross-entropy in nats, as ``F.cross_entropy`` on fp32 logits: the mean over all positions
    (default), their sum, or one loss per position (``"none"``, shaped like ``targets``).

    >>> import torch
    >>> cross_entropy(torch.zeros(2, 4), torch.tensor([0, 3]))  # uniform over 4: ln 4
    tensor(1.3863)
    >>> cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), "none").shape
    torch.Size([2, 3])
    """
    _check_reduction(reduction)  # the annotations, checked in a few attribute reads
    if not (isinstance(logits, Tensor) and isinstance(targets, Tensor)
            and logits.is_floating_point() and logits.dim() >= 1 and targets.dtype in _INTS
            and targets.shape == logits.shape[:-1]):
        raise TypeCheckError(f"cross_entropy: logits {_described(logits)} (*batch vocab) and "
                             f"targets {_described(targets)} (*batch) must be floating and "
                             "integer tensors, targets shaped as logits without vocab")
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if targets.dtype not in (torch.int64, torch.uint8):  # what F.cross_entropy takes
        targets = targets.long()
    if logits.dim() <= 2:  # F.cross_entropy's own layouts, (vocab) or (batch, vocab): no
        return F.cross_entropy(logits, targets, reduction=reduction)  # reshapes (vmap's cost)
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction=reduction)
    return flat.reshape(targets.shape) if reduction == "none" else flat


def _described(x: object) -> str:
    """``float32(4, 1)``: a tensor's dtype and shape, for a one-line error."""
    if isinstance(x, Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{tuple(x.shape)}"
    return type(x).__name__
