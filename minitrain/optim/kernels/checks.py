"""Checks that stand between an update's inputs and the fused / streaming kernels.

Those kernels walk raw storage: a state leaf of another shape, or a grad whose strides differ
from its param's (expanded, transposed, sliced, overlapping), would be read out of bounds or in
the wrong order. :func:`pointers` runs before any of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch, tree

__all__ = ["check_storages", "donatable", "grad_leaf_error", "naming_bad_grads",
           "none_param_error", "pointers", "storage_holds"]

_PLAIN = (Tensor, torch.nn.Parameter)


def grad_leaf_error(grads: Any) -> ValueError | None:
    """The error naming the first grad that is None (the ``.grad`` of a param the loss does
    not use) or not dense (a sparse embedding grad); None when all are dense tensors.

    >>> str(grad_leaf_error({"w": None})).split(";")[0]
    "the grad of 'w' is None (a param the loss does not use?)"
    """
    for name, g in tree.named_leaves(grads):
        if g is None:
            return ValueError(
                f"the grad of {name!r} is None (a param the loss does not use?); pass "
                f"torch.zeros_like(param) for it, or leave the param out"
            )
        if isinstance(g, Tensor) and g.layout is not torch.strided:
            return ValueError(
                f"the grad of {name!r} is a {g.layout} tensor, but the optimizers take dense "
                f"grads; pass grad.to_dense() (or build the embedding with sparse=False)"
            )
    return None


def naming_bad_grads(update: Callable[..., Any]) -> Callable[..., Any]:
    """``update(grads, ...)`` whose error over a None or sparse grad is re-raised as
    :func:`grad_leaf_error`'s one line. Costs nothing until something raises."""

    @functools.wraps(update)
    def checked(grads: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return update(grads, *args, **kwargs)
        except (NotImplementedError, RuntimeError, AttributeError, TypeError):
            if (named := grad_leaf_error(grads)) is not None:
                raise named from None
            raise

    return checked


def none_param_error(params: Any) -> ValueError | None:
    for name, p in tree.named_leaves(params):
        if p is None:
            return ValueError(f"param {name!r} is None; pass a tensor for every param, or "
                              f"leave it out")
    return None


def donatable(written: Iterable[Any], read: Iterable[Any]) -> bool:
    """Whether an update may write the tensors ``written`` (params, state) in place: no two of
    them share memory (tied weights passed twice, ``torch.from_dlpack`` aliases), none has two
    elements at one address, none shares memory with one it ``read`` (grads, which may share
    with each other), and every leaf has a storage to compare (no functorch tensor).

    >>> w, g = torch.ones(3), torch.ones(3)
    >>> donatable([w, torch.zeros(3)], [g]), donatable([w, g], [g, w])
    (True, False)
    >>> donatable([w, torch.from_dlpack(w)], [g, g]), donatable([w.expand(2, 3)], [g])
    (False, False)
    """
    written, read = _memory(written, written=True), _memory(read, written=False)
    return written is not None and read is not None and not _overlapping(written, read)


def _memory(tensors: Iterable[Any], written: bool) -> list[tuple[int, int]] | None:
    """The ``[start, end)`` addresses of each non-empty tensor's storage (for a storage without
    memory, such as meta or fake, its StorageImpl's address, which only it meets). None where a
    tensor has no storage (a functorch tensor) or, ``written``, may overlap itself."""
    spans = []
    for t in tensors:
        if not isinstance(t, Tensor) or t.numel() == 0:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        if written and not t.is_contiguous() and _overlaps_itself(t):
            return None
        # A fake tensor (a subclass) has a meta storage, whose data_ptr warns (and is 0).
        start = storage.data_ptr() if type(t) in _PLAIN or storage.device.type != "meta" else 0
        if start:
            spans.append((start, start + (storage.nbytes() or 1)))
        else:
            spans.append((storage._cdata, storage._cdata + 1))
    return spans


def _overlaps_itself(t: Tensor) -> bool:
    """Whether two elements of ``t`` may share an address (a stride 0, or interleaved strides).

    >>> _overlaps_itself(torch.ones(4, 4)[:, ::2]), _overlaps_itself(torch.ones(4).expand(2, 4))
    (False, True)
    """
    extent = 1  # the elements that the dims of smaller strides span
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True)
                               if n > 1):
        if stride < extent:
            return True
        extent += (size - 1) * stride
    return False


def _overlapping(written: list[tuple[int, int]], read: list[tuple[int, int]]) -> bool:
    """Whether two ``written`` ``[start, end)`` ranges meet, or a ``read`` one meets a written
    one (read ranges may meet each other).

    >>> _overlapping([(0, 4), (4, 8)], [(8, 9), (8, 12)]), _overlapping([(0, 4)], [(3, 5)])
    (False, True)
    """
    written = sorted(written)
    end = 0
    for start, stop in written:
        if start < end:
            return True
        end = stop
    index, n = 0, len(written)  # walk the sorted written ranges beside the read ones
    for start, stop in sorted(read):
        while index < n and written[index][1] <= start:
            index += 1
        if index < n and written[index][0] < stop:
            return True
    return False


def pointers(rows: Sequence[list[Tensor] | None], dtype: torch.dtype | None = None,
             like: list[Tensor] | None = None) -> list[list[int] | None] | None:
    """Each row's data pointers where every tensor of ``rows`` (lists of leaves; None for an
    absent row) is a plain contiguous CPU tensor of its param's shape and dtype (params:
    ``like``, else ``rows[0]``; ``dtype`` where given), not requiring grad, not negated, held
    by its storage; else None. Whether rows written in place may meet is :func:`donatable`'s.

    >>> p = [torch.zeros(3)]
    >>> pointers([p, [torch.ones(1).expand(3)]]) is None  # stride 0
    True
    >>> pointers([p, [torch.ones(6)[::2]]]) is None  # strided
    True
    """
    like = rows[0] if like is None else like
    n = len(like)
    metas = []  # per leaf: its shape, dtype, element size and bytes
    for t in like:
        kind = t.dtype if dtype is None else dtype
        metas.append((t.shape, kind, kind.itemsize, t.numel() * kind.itemsize))
    wrapped = _torch.is_functorch_wrapped_tensor
    found: list[list[int] | None] = []
    for row in rows:
        if row is None:
            found.append(None)
            continue
        if len(row) != n:
            return None
        addresses = []
        for t, (shape, kind, size, nbytes) in zip(row, metas, strict=True):
            if not (type(t) in _PLAIN and t.dtype is kind and t.shape == shape and t.is_cpu
                    and t.is_contiguous() and not t.requires_grad and not t.is_neg()
                    and not wrapped(t)):
                return None
            storage = t.untyped_storage()
            start, offset = storage.data_ptr(), t.storage_offset() * size
            if offset + nbytes > storage.nbytes():
                return None
            addresses.append(start + offset)
        found.append(addresses)
    return found


def check_storages(trees: Sequence[tuple[str, Any]]) -> None:
    """``ValueError`` naming the first plain tensor leaf of ``trees`` (``(what, tree)`` pairs)
    whose storage holds fewer bytes than the tensor addresses (one resized by hand).

    >>> t = torch.ones(4); _ = t.untyped_storage().resize_(0)
    >>> check_storages([("param", {"w": t})])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: param 'w': its storage holds 0 bytes, fewer than the tensor addresses (was it...
    """
    for what, values in trees:
        for name, t in tree.named_leaves(values):
            if type(t) in _PLAIN and not _torch.is_functorch_wrapped_tensor(t) \
                    and not storage_holds(t):
                where, _, leaf = name.rpartition(".")
                # a state buffer is named by the param it is for
                name = f"{where} leaf {leaf!r}" if what == "state" and where else repr(name)
                raise ValueError(
                    f"{what} {name}: its storage holds {t.untyped_storage().nbytes()} bytes, "
                    f"fewer than the tensor addresses (was it resized?); pass tensors whose "
                    f"storage holds them")


def storage_holds(t: Tensor) -> bool:
    """Whether ``t``'s storage holds every element ``t`` addresses."""
    n = t.numel()
    if n == 0:
        return True
    extent = n if t.is_contiguous() else 1 + sum(
        (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + extent) * t.element_size() <= t.untyped_storage().nbytes()
