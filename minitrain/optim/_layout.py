"""Leaves of a params tree: validation, weight-decay masks, and their grouping into the fast
path's kernel calls, computed once per tree structure (:class:`LayoutCache`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim.kernels import streaming
from minitrain.optim.kernels.checks import grad_leaf_error
from minitrain.tree import Grads, Params

__all__ = ["CACHE_BATCH_BYTES", "SWEPT_BYTES", "Layout", "LayoutCache", "WeightDecayMask",
           "check_grads", "check_params", "decay_flags", "fast_batches"]

WeightDecayMask = Params | Callable[[str, Tensor], bool] | None
"""Which leaves get weight decay: a pytree of bools like params, or ``fn(name, leaf) -> bool``."""

# Params of this many bytes or more (several times as many pass through an update's kernels,
# with their grads and state) leave the caches cold for the Python after the kernels.
SWEPT_BYTES = 8 * 2**20

# Fast-path batches stay under this many bytes of touched buffers, so that the several passes
# an update makes over one batch hit the last-level cache instead of DRAM.
CACHE_BATCH_BYTES = 16 * 2**20


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


def fast_batches(
    tensors: Sequence[Tensor], decays: Sequence[bool], buffers_per_leaf: int,
    split: bool | Callable[[Tensor], bool] = True,
) -> list[list[int]]:
    """Leaf indices grouped by (device, dtype, decays), split into cache-sized batches (per
    group, when ``split`` is true or returns true for the group's first leaf)."""
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for index, (t, decay) in enumerate(zip(tensors, decays, strict=True)):
        groups.setdefault((t.device, t.dtype, decay), []).append(index)
    batches = []
    for indices in groups.values():
        split_group = split(tensors[indices[0]]) if callable(split) else split
        batch: list[int] = []
        batch_bytes = 0
        for index in indices:
            nbytes = tensors[index].numel() * tensors[index].element_size() * buffers_per_leaf
            if split_group and batch and batch_bytes + nbytes > CACHE_BATCH_BYTES:
                batches.append(batch)
                batch, batch_bytes = [], 0
            batch.append(index)
            batch_bytes += nbytes
        batches.append(batch)
    return batches


def _matching_grads(grads: Grads, params: Params, param_leaves: list[Tensor]) -> list[Tensor]:
    grad_leaves = tree.leaves(grads)
    if (
        len(grad_leaves) != len(param_leaves)
        or tree.structure(grads) != tree.structure(params)
        or any(
            not isinstance(g, Tensor) or g.shape != p.shape or g.dtype != p.dtype
            for g, p in zip(grad_leaves, param_leaves, strict=True)
        )
    ):
        return check_grads(grads, params)  # raises, naming the first mismatching leaf
    return grad_leaves


class Layout(NamedTuple):
    """What an update needs to know about a params tree beyond its tensors' values."""

    decays: list[bool]  # per leaf: whether weight decay applies
    batches: list[list[int]]  # leaf indices per fast-path kernel call, pure updates
    donated_batches: list[list[int]]  # the same for donated updates
    sweeps_caches: bool = False  # params of SWEPT_BYTES or more (see there)


def _signature(leaf: Any) -> Any:
    return (leaf.shape, leaf.dtype) if isinstance(leaf, Tensor) else type(leaf)


def _device(leaf: Any) -> Any:
    return leaf.device if isinstance(leaf, Tensor) else None


class LayoutCache:
    """:class:`Layout` per params structure, checked and computed once per new structure.

    The key is the tree structure and each leaf's shape, dtype and device, so an update of a
    structure seen before skips the validation of params, the weight-decay mask and grouping.
    Grads are still compared with params on every update (structure, shapes, dtypes).
    """

    def __init__(self, mask: WeightDecayMask, buffers_per_leaf: int, fused: bool) -> None:
        self.mask = mask
        self.buffers_per_leaf = buffers_per_leaf
        self.fused = fused
        self.layouts: dict[Any, Layout] = {}

    def layout(self, params, spec, param_leaves, grads, grad_spec, grad_leaves) -> Layout:
        if torch.compiler.is_compiling():  # no Python-side caches inside a traced graph
            check_params(params)
            _matching_grads(grads, params, param_leaves)
            return self._build(params, param_leaves)
        signature = tuple(map(_signature, param_leaves))
        key = (spec, signature, tuple(map(_device, param_leaves)))
        layout = self.layouts.get(key)
        if layout is None:
            check_params(params)
            layout = self.layouts[key] = self._build(params, param_leaves)
        if grad_spec != spec or tuple(map(_signature, grad_leaves)) != signature:
            check_grads(grads, params)  # raises, naming the first mismatching leaf
        return layout

    def _build(self, params: Params, param_leaves: list[Tensor]) -> Layout:
        decays = decay_flags(self.mask, params)
        # Updates that make one pass over memory (a fused kernel in place, the streaming
        # kernels) gain nothing from cache-sized batches, only more calls; multi-pass updates
        # (foreach, or copies then a fused kernel) keep each batch's passes in cache.
        one_pass = not torch.compiler.is_compiling() and streaming.available()

        def multi_pass(leaf: Tensor, donated: bool) -> bool:
            if one_pass and leaf.device.type == "cpu" and leaf.dtype == torch.float32:
                return False
            return not (donated and self.fused)

        return Layout(
            decays,
            fast_batches(param_leaves, decays, self.buffers_per_leaf,
                         split=lambda leaf: multi_pass(leaf, donated=False)),
            fast_batches(param_leaves, decays, self.buffers_per_leaf,
                         split=lambda leaf: multi_pass(leaf, donated=True)),
            sum(leaf.numel() * leaf.element_size() for leaf in param_leaves) >= SWEPT_BYTES,
        )


