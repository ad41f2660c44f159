"""Stride math: how a tensor's shape and strides map indices to positions in its storage.

Element ``index`` lives at ``storage_offset + sum(i * s for i, s in zip(index, strides))``; the
rules follow PyTorch's own (c10 ``compute_contiguous``, ATen ``computeStride``) on plain tuples.

>>> x = contiguous((4, 4))                  # the chapter's 4x4 example
>>> t = transpose(x, 0, 1)
>>> x.strides, t.strides, view_strides(t.shape, t.strides, (16,))
((4, 1), (1, 4), None)
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "Layout", "layout_of", "contiguous", "contiguous_strides", "offset", "is_contiguous",
    "transpose", "permute", "slice", "expand", "view", "view_strides", "infer_shape",
]

Shape = tuple[int, ...]


class Layout(NamedTuple):
    """Shape, strides (in elements) and storage offset of a view."""

    shape: Shape
    strides: Shape
    storage_offset: int = 0


def _check_same_rank(shape: Sequence[int], strides: Sequence[int]) -> None:
    if len(shape) != len(strides):
        raise ValueError(
            f"shape {tuple(shape)} has {len(shape)} dims but strides {tuple(strides)} have "
            f"{len(strides)}; give one stride per dimension"
        )


def _dim(dim: int, ndim: int) -> int:
    """Wrap a possibly negative dimension, as torch does."""
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise ValueError(f"dimension {dim} is out of range for a {ndim}-d tensor")
    return dim % max(ndim, 1)


def layout_of(tensor: torch.Tensor) -> Layout:
    """The layout of a torch tensor.

    >>> layout_of(torch.zeros(2, 3).t())
    Layout(shape=(3, 2), strides=(1, 3), storage_offset=0)
    """
    return Layout(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def contiguous_strides(shape: Sequence[int]) -> Shape:
    """Row-major strides of a fresh tensor; a size-0 dimension counts as 1 (as torch does).

    >>> contiguous_strides((2, 3, 4)), contiguous_strides((2, 0, 3))
    ((12, 4, 1), (3, 3, 1))
    """
    if any(size < 0 for size in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative size; sizes must be >= 0")
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def contiguous(shape: Sequence[int]) -> Layout:
    """The layout of a fresh row-major tensor of ``shape``.

    >>> contiguous((2, 3))
    Layout(shape=(2, 3), strides=(3, 1), storage_offset=0)
    """
    return Layout(tuple(shape), contiguous_strides(shape))


def offset(index: Sequence[int], strides: Sequence[int], storage_offset: int = 0) -> int:
    """Position in storage of element ``index``: storage_offset + sum(index * strides).

    >>> offset((1, 2), (4, 1)), offset((1, 2), (1, 4), storage_offset=3)
    (6, 12)
    """
    _check_same_rank(index, strides)
    if any(i < 0 for i in index):
        raise ValueError(f"index {tuple(index)} is negative; add the dimension's size first")
    return storage_offset + sum(i * s for i, s in zip(index, strides, strict=True))


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the layout is row-major with no gaps (c10 ``compute_contiguous``).

    >>> is_contiguous((2, 3), (3, 1)), is_contiguous((3, 2), (1, 3)), is_contiguous((1, 3), (7, 1))
    (True, False, True)
    """
    _check_same_rank(shape, strides)
    if math.prod(shape) == 0:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def transpose(layout: Layout, dim0: int, dim1: int) -> Layout:
    """Swap two dimensions: their sizes and strides trade places.

    >>> transpose(contiguous((2, 3)), 0, 1)
    Layout(shape=(3, 2), strides=(1, 3), storage_offset=0)
    """
    order = list(range(len(layout.shape)))
    if order:
        d0, d1 = _dim(dim0, len(order)), _dim(dim1, len(order))
        order[d0], order[d1] = order[d1], order[d0]
    return permute(layout, order)


def permute(layout: Layout, dims: Sequence[int]) -> Layout:
    """Reorder dimensions: output dimension ``i`` is input dimension ``dims[i]``.

    >>> permute(contiguous((2, 3, 4)), (2, 0, 1)).strides
    (1, 12, 4)
    """
    ndim = len(layout.shape)
    wrapped = [_dim(d, ndim) for d in dims]
    if sorted(wrapped) != list(range(ndim)):
        raise ValueError(f"permute needs each of the {ndim} dimensions once; got {tuple(dims)}")
    shape = tuple(layout.shape[d] for d in wrapped)
    strides = tuple(layout.strides[d] for d in wrapped)
    return Layout(shape, strides, layout.storage_offset)


def slice(  # noqa: A001 - the name of the operation
    layout: Layout, dim: int, start: int | None = None, stop: int | None = None, step: int = 1
) -> Layout:
    """``x[..., start:stop:step, ...]`` along ``dim``: Python's clamping, a positive step.

    >>> slice(contiguous((4, 4)), 1, 1, None, 2)
    Layout(shape=(4, 2), strides=(4, 2), storage_offset=1)
    """
    if step <= 0:
        raise ValueError(f"slice step must be positive (torch has no negative strides); got {step}")
    d = _dim(dim, len(layout.shape))
    size = layout.shape[d]
    first, last, _ = builtins.slice(start, stop, step).indices(size)
    length = max(0, -(-(last - first) // step))  # ceil((last - first) / step)
    shape = layout.shape[:d] + (length,) + layout.shape[d + 1 :]
    strides = layout.strides[:d] + (layout.strides[d] * step,) + layout.strides[d + 1 :]
    return Layout(shape, strides, layout.storage_offset + first * layout.strides[d])


def expand(layout: Layout, shape: Sequence[int]) -> Layout:
    """Broadcast to ``shape`` without copying (stride 0); ``-1`` keeps a size (ATen).

    >>> expand(contiguous((3, 1)), (2, 3, 4))
    Layout(shape=(2, 3, 4), strides=(0, 1, 0), storage_offset=0)
    """
    old_shape, old_strides = layout.shape, layout.strides
    if len(shape) < len(old_shape):
        raise ValueError(f"cannot expand shape {old_shape} to {tuple(shape)}: give at least "
                         f"{len(old_shape)} dims")
    lead = len(shape) - len(old_shape)
    sizes, strides = [0] * len(shape), [0] * len(shape)
    for i in reversed(range(len(shape))):
        old = i - lead
        if old >= 0:
            size, stride = old_shape[old], old_strides[old]
        else:  # a new leading dimension, of size 1 until expanded (0-d tensors: stride 0)
            size = 1
            stride = sizes[i + 1] * strides[i + 1] if i + 1 < len(shape) else 0
        target = shape[i]
        if target == -1:
            if old < 0:
                raise ValueError(f"-1 is not allowed for the new leading dimension {i}")
            target = size
        if target < 0:
            raise ValueError(f"expanded sizes must be >= 0 or -1; got {target} at dim {i}")
        if size != target:
            if size != 1:
                raise ValueError(
                    f"the expanded size {target} must match the existing size {size} at "
                    f"non-singleton dimension {i}; only size-1 dimensions can expand"
                )
            size, stride = target, 0
        sizes[i], strides[i] = size, stride
    return Layout(tuple(sizes), tuple(strides), layout.storage_offset)


def infer_shape(shape: Sequence[int], numel: int) -> Shape:
    """Resolve one ``-1`` in ``shape`` so it holds ``numel`` elements (torch ``infer_size``).

    >>> infer_shape((2, -1), 6)
    (2, 3)
    """
    unknown = [i for i, size in enumerate(shape) if size == -1]
    if len(unknown) > 1 or any(size < -1 for size in shape):
        raise ValueError(f"shape {tuple(shape)} may hold one -1 and otherwise sizes >= 0")
    known = math.prod(size for size in shape if size != -1)
    resolved = list(shape)
    if unknown:
        if known == 0 or numel % known:
            raise ValueError(f"shape {tuple(shape)} is invalid for {numel} elements")
        resolved[unknown[0]] = numel // known
    if math.prod(resolved) != numel:
        raise ValueError(
            f"shape {tuple(shape)} holds {math.prod(resolved)} elements, not {numel}; "
            "a view keeps the number of elements"
        )
    return tuple(resolved)


def view_strides(
    shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int]
) -> Shape | None:
    """Strides of ``.view(new_shape)``, or None exactly when the view would need a copy.

    A port of ATen's ``computeStride``: the new shape must split into chunks of the same element
    counts as the old shape's contiguous chunks.

    >>> view_strides((2, 3, 4), (12, 4, 1), (6, 4)), view_strides((4, 3), (1, 4), (12,))
    ((4, 1), None)
    """
    _check_same_rank(shape, strides)
    numel = math.prod(shape)
    new_shape = infer_shape(new_shape, numel)
    if not shape:  # a 0-d tensor: every new shape holds one element
        return (1,) * len(new_shape)
    if numel == 0:  # strides are arbitrary: torch keeps the old ones or uses row-major
        return tuple(strides) if tuple(shape) == new_shape else contiguous_strides(new_shape)
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = strides[-1]  # stride of the last dimension of the current chunk
    tensor_numel, view_numel = 1, 1
    for tensor_d in reversed(range(len(shape))):
        tensor_numel *= shape[tensor_d]
        chunk_ends = tensor_d == 0 or (
            shape[tensor_d - 1] != 1 and strides[tensor_d - 1] != tensor_numel * chunk_base_stride
        )
        if not chunk_ends:
            continue
        while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
            new_strides[view_d] = view_numel * chunk_base_stride
            view_numel *= new_shape[view_d]
            view_d -= 1
        if view_numel != tensor_numel:
            return None
        if tensor_d > 0:
            chunk_base_stride = strides[tensor_d - 1]
            tensor_numel, view_numel = 1, 1
    return tuple(new_strides) if view_d == -1 else None


def view(layout: Layout, shape: Sequence[int]) -> Layout | None:
    """The layout of ``.view(shape)``, or None when torch's ``.view`` would raise.

    >>> view(contiguous((2, 6)), (3, -1))
    Layout(shape=(3, 4), strides=(4, 1), storage_offset=0)
    """
    new_shape = infer_shape(shape, math.prod(layout.shape))
    strides = view_strides(layout.shape, layout.strides, new_shape)
    return None if strides is None else Layout(new_shape, strides, layout.storage_offset)
