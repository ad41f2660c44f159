"""The memory-safety checks between an update's inputs and the C kernel, and of an update
written in place.

The kernel walks raw storage: a state leaf of another shape, or a grad whose strides differ
from its param's (expanded, transposed, sliced, overlapping), would be read out of bounds or in
the wrong order. :func:`pointers` runs before any call (and, donated, checks that no storage
it writes meets another); :func:`donatable` before any other update that writes its inputs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch
from minitrain.optim._checks import _PLAIN

__all__ = ["donatable", "pointers"]


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
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1):
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


def pointers(rows: Sequence[list[Tensor] | None], read: int | None = None,
             dtype: torch.dtype | None = None,
             like: list[Tensor] | None = None) -> list[list[int] | None] | None:
    """Each row's data pointers where every tensor of ``rows`` (lists of leaves; None for an
    absent row) is a plain contiguous CPU tensor of its param's shape and dtype (params:
    ``like``, else ``rows[0]``; ``dtype`` where given), not requiring grad, not negated, held
    by its storage; else None. With ``read`` (the grads' row) the other rows are written in
    place: None too where two written storages meet, or the grads' meet one (what
    :func:`donatable` checks of any tensors, in the same pass).

    >>> p = [torch.zeros(3)]
    >>> pointers([p, [torch.ones(1).expand(3)]]) is None  # stride 0
    True
    >>> pointers([p, p], read=1) is None  # the grad is the param: not in place
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
    spans: list[list[tuple[int, int]]] = [[], []]  # written, read
    for index, row in enumerate(rows):
        if row is None:
            found.append(None)
            continue
        if len(row) != n:
            return None
        sink = None if read is None else spans[index == read]
        addresses = []
        for t, (shape, kind, size, nbytes) in zip(row, metas, strict=True):
            if not (type(t) in _PLAIN and t.dtype is kind and t.shape == shape and t.is_cpu
                    and t.layout is torch.strided and t.is_contiguous() and not t.requires_grad
                    and not t.is_neg() and not wrapped(t)):
                return None
            storage = t.untyped_storage()
            start, held, offset = storage.data_ptr(), storage.nbytes(), t.storage_offset() * size
            if offset + nbytes > held:
                return None
            if sink is not None and nbytes:
                sink.append((start, start + held))
            addresses.append(start + offset)
        found.append(addresses)
    return None if read is not None and _overlapping(*spans) else found
