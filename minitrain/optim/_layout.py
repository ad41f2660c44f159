"""Leaves of a params tree: validation and weight-decay masks."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from minitrain import tree
from minitrain.optim.kernels.checks import grad_leaf_error
from minitrain.tree import Grads, Params

__all__ = ["WeightDecayMask", "check_grads", "check_params", "decay_flags"]

WeightDecayMask = Params | Callable[[str, Tensor], bool] | None
"""Which leaves get weight decay: a pytree of bools like params, or ``fn(name, leaf) -> bool``."""


def check_params(params: Params) -> list[Tensor]:
    """The leaves of ``params``, checked to be floating-point tensors."""
    leaves = tree.named_leaves(params)
    if not leaves:
        raise ValueError("params has no tensor leaves; pass a pytree of floating-point tensors")
    for name, leaf in leaves:
        if not isinstance(leaf, Tensor) or not (leaf.is_floating_point()):
            kind = leaf.dtype if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(
                f"param {name!r} is {kind}; optimizers update floating-point tensors only"
            )
    return [leaf for _, leaf in leaves]


def check_grads(grads: Grads, params: Params) -> list[Tensor]:
    """The leaves of ``grads``, checked to match ``params`` leaf by leaf (structure, shape,
    dtype) and to be dense."""
    if (error := grad_leaf_error(grads)) is not None:
        raise error
    tree.assert_same_structure(params, grads, names=("params", "grads"), check_shapes=True)
    grad_leaves = tree.leaves(grads)
    for (name, param), grad in zip(tree.named_leaves(params), grad_leaves, strict=True):
        if not isinstance(grad, Tensor) or grad.dtype != param.dtype:
            kind = grad.dtype if isinstance(grad, Tensor) else type(grad).__name__
            raise ValueError(
                f"grads differ from params at leaf {name!r}: {kind} vs {param.dtype}; "
                f"pass grads with the params' dtypes"
            )
    return grad_leaves


def decay_flags(mask: WeightDecayMask, params: Params) -> list[bool]:
    """Per leaf: whether weight decay applies (all leaves when ``mask`` is None)."""
    named = tree.named_leaves(params)
    if mask is None:
        return [True] * len(named)
    if callable(mask):
        return [bool(mask(name, leaf)) for name, leaf in named]
    tree.assert_same_structure(params, mask, names=("params", "weight-decay mask"))
    flags = tree.leaves(mask)
    for (name, _), flag in zip(named, flags, strict=True):
        if not isinstance(flag, bool):
            raise ValueError(
                f"weight-decay mask leaf {name!r} is {type(flag).__name__}; use True or False"
            )
    return flags


