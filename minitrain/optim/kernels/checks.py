"""Checks that stand between an update's inputs and the fused / streaming kernels.

Those kernels walk raw storage: a state leaf of another shape, or a grad whose strides differ
from its param's (expanded, transposed, sliced, overlapping), would be read out of bounds or in
the wrong order. These checks run before any of them (and name the leaf when they refuse).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch, tree

__all__ = ["check_slots", "plain_cpu", "storage_holds", "donatable", "kernel_ready",
           "grad_leaf_error", "naming_bad_grads", "none_param_error"]


def grad_leaf_error(grads: Any) -> ValueError | None:
    """The error naming the first grad that is None (the ``.grad`` of a param the loss does
    not use) or not a dense (strided) tensor (the sparse grad of ``nn.Embedding(sparse=True)``);
    None when all are dense tensors. The optimizers take dense grads, as torch.optim's Adam does.

    >>> grad_leaf_error({"w": torch.ones(2)}) is None
    True
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


def _explaining(fn: Callable[..., Any], explain: Callable[[Any], ValueError | None],
                caught: tuple[type[Exception], ...]) -> Callable[..., Any]:
    """``fn(first, ...)`` whose ``caught`` error, where ``explain(first)`` finds the input to
    blame, is re-raised as that one-line ``ValueError`` (our frames would only hide it). Costs
    nothing until something raises."""

    @functools.wraps(fn)
    def checked(first: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(first, *args, **kwargs)
        except caught:
            if (named := explain(first)) is not None:
                raise named from None
            raise

    return checked


def naming_bad_grads(update: Callable[..., Any]) -> Callable[..., Any]:
    """``update(grads, ...)`` whose error over a None or sparse grad (torch's, from an op with
    no sparse kernel; or an attribute a None lacks) is :func:`grad_leaf_error`'s."""
    return _explaining(update, grad_leaf_error,
                       (NotImplementedError, RuntimeError, AttributeError, TypeError))


def none_param_error(params: Any) -> ValueError | None:
    for name, p in tree.named_leaves(params):
        if p is None:
            return ValueError(f"param {name!r} is None; pass a tensor for every param, or "
                              f"leave it out")
    return None


def donatable(params: list, grads: list, buffers: Iterable[list]) -> bool:
    """Whether an update may write ``params`` and the state ``buffers`` (lists of leaves) in
    place: no two of those non-empty tensors share memory (one passed twice would be updated
    twice, as tied weights passed as two leaves would be; so would two tensors over one memory
    with storages of their own, from ``torch.from_dlpack`` or ``torch.from_numpy``), none of
    them has two elements at one address (stride 0, or strides that interleave), and no grad
    shares memory with any of them (a grad that is another leaf's param, or a hand-edited state
    leaf that is its param, would be read after a write changed it). Grads may share memory
    with each other: they are only read. False also where a leaf has no storage to compare (a
    functorch tensor). (State outside ``buffers`` may share tensors by design: a chain's
    transformations hold one count.)

    >>> w, g = torch.ones(3), torch.ones(3)
    >>> donatable([w], [g], [[torch.zeros(3)]]), donatable([w, g], [g, w], [])
    (True, False)
    >>> donatable([w, torch.from_dlpack(w)], [g, g], []), donatable([w.expand(2, 3)], [g], [])
    (False, False)
    """
    written = _memory(itertools.chain(params, *buffers), written=True)
    read = _memory(grads, written=False)
    return written is not None and read is not None and not _overlapping(written, read)


def _memory(tensors: Iterable[Any], written: bool) -> list[tuple[int, int]] | None:
    """The ``[start, end)`` addresses of each tensor's storage (empty tensors and non-tensors,
    which nothing can alias, left out); for a storage without memory (meta, fake, freed by
    hand), its StorageImpl's address, which only that storage meets. None where a tensor has
    no storage (a functorch tensor) or, ``written``, may overlap itself."""
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
    """Whether two elements of ``t`` may share an address (a stride 0, or strides that
    interleave): an in-place write to it is no elementwise update.

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
    # Written ranges are disjoint and sorted: walk them beside the read ranges, by start.
    index, n = 0, len(written)
    for start, stop in sorted(read):
        while index < n and written[index][1] <= start:
            index += 1
        if index < n and written[index][0] < stop:
            return True
    return False


def kernel_ready(params: list[Tensor], grads: list[Tensor], buffers: dict[str, list],
                 donated: bool = False) -> bool:
    """Whether every param, grad and state leaf is a plain CPU tensor, contiguous within its
    storage, not requiring grad, and every grad and state leaf has its param's shape and dtype:
    the common case, accepted in one pass (never under a compiler). ``donated``: and the update
    may write params and state in place (:func:`donatable`, from the same addresses). False
    sends the update through the full checks (:func:`check_state_shapes`, ``use_plain_path``,
    :func:`fast_path_inputs`, :func:`donatable`), which name a mismatch or copy what the
    kernels cannot read.

    >>> p = [torch.zeros(3)]
    >>> kernel_ready(p, [torch.ones(3)], {"m": [torch.zeros(3)]})
    True
    >>> kernel_ready(p, [torch.ones(1).expand(3)], {})  # stride 0: the full checks copy it
    False
    >>> kernel_ready(p, p, {}, donated=True)  # the grad is the param: not in place
    False
    """
    if torch.compiler.is_compiling():
        return False
    wrapped = _torch.is_functorch_wrapped_tensor
    columns = [grads, *buffers.values()]
    if any(len(column) != len(params) for column in columns):
        return False
    read: list[tuple[int, int]] | None = [] if donated else None
    written: list[tuple[int, int]] | None = [] if donated else None
    sinks = [read, *[written] * len(buffers)]
    for index, p in enumerate(params):
        if type(p) not in _PLAIN:
            return False
        shape, dtype, size = p.shape, p.dtype, p.element_size()
        nbytes = p.numel() * size
        if not _contiguous_cpu(p, wrapped, size, nbytes, written):
            return False
        for column, sink in zip(columns, sinks, strict=True):
            t = column[index]
            # Its param's shape and dtype: its param's element size and byte count too.
            if (type(t) is not Tensor or t.dtype is not dtype or t.shape != shape
                    or not _contiguous_cpu(t, wrapped, size, nbytes, sink)):
                return False
    return written is None or not _overlapping(written, read)


_PLAIN = (Tensor, torch.nn.Parameter)


def _contiguous_cpu(t: Tensor, wrapped, size: int, nbytes: int,
                    storages: list[tuple[int, int]] | None = None) -> bool:
    """A plain CPU tensor of ``nbytes`` bytes of ``size``-byte elements, contiguous, so its
    storage must hold ``[offset, offset + nbytes)``. A tensor with the negative bit
    (torch._neg_view) holds -t in memory: the kernels would read it raw. Its storage's memory,
    ``[start, end)``, goes into ``storages`` (where given) unless the tensor is empty (two
    storages may share memory: ``torch.from_dlpack``, ``torch.from_numpy``)."""
    if not (t.is_cpu and not t.requires_grad and t.is_contiguous() and not wrapped(t)
            and not t.is_neg()):
        return False
    storage = t.untyped_storage()
    held = storage.nbytes()
    if storages is not None and nbytes:
        start = storage.data_ptr()
        storages.append((start, start + held))
    return t.storage_offset() * size + nbytes <= held


# -- the streaming kernel's last guard before raw pointers reach C ------------------------------


def check_slots(slots: Sequence[list[Tensor] | None], n_leaves: int) -> None:
    """Refuse any tensor the kernel would read or write out of bounds: per leaf, every tensor
    must be a CPU float32, contiguous tensor with the param's element count whose storage holds
    all of it. (Callers make grads and state match their params before this; this is the last
    guard before raw pointers reach C.) A row that is the same list object as an earlier one
    (a donated update writes into its inputs) is checked once."""
    sizes = [p.numel() for p in slots[0]]
    float32 = torch.float32
    seen: list[list[Tensor]] = []
    for index, slot in enumerate(slots):
        if slot is None or any(slot is row for row in seen):
            continue
        seen.append(slot)
        if len(slot) != n_leaves:
            raise ValueError(f"streaming slot {index} has {len(slot)} leaves, expected {n_leaves}")
        for leaf, (t, n) in enumerate(zip(slot, sizes, strict=True)):
            # Contiguous with n elements: the storage must hold [offset, offset + n) floats.
            if not (
                t.dtype is float32 and t.is_cpu and t.is_contiguous() and t.numel() == n
                and not t.is_neg()
                and (n == 0 or (t.storage_offset() + n) * 4 <= t.untyped_storage().nbytes())
            ):
                p = slots[0][leaf]
                held = t.untyped_storage().nbytes()
                if t.dtype is float32 and t.is_contiguous() and t.numel() == n and \
                        (t.storage_offset() + n) * 4 > held:
                    raise ValueError(
                        f"streaming slot {index} leaf {leaf}: a {tuple(t.shape)} tensor whose "
                        f"storage holds {held} bytes (was it resized?); pass tensors whose "
                        f"storage holds them"
                    )
                raise ValueError(
                    f"streaming slot {index} leaf {leaf}: {tuple(t.shape)} {t.dtype} "
                    f"{t.device} stride {t.stride()} does not match its param "
                    f"{tuple(p.shape)}; pass contiguous float32 CPU tensors of the param's shape"
                )


def check_storages(trees: Sequence[tuple[str, Any]]) -> None:
    """``ValueError`` naming the first plain tensor leaf of ``trees`` (``(what, tree)`` pairs)
    whose storage holds fewer bytes than the tensor addresses: one resized by hand, which even
    torch's own ops would read past the end of.

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
                if what == "state" and where:  # the param the buffer is for, named alone
                    name = f"{where} leaf {leaf!r}"
                else:
                    name = repr(name)
                raise ValueError(
                    f"{what} {name}: its storage holds {t.untyped_storage().nbytes()} bytes, "
                    f"fewer than the tensor addresses (was it resized?); pass tensors whose "
                    f"storage holds them")


def storage_holds(t: Tensor) -> bool:
    """Whether ``t``'s storage holds every element ``t`` addresses."""
    n = t.numel()
    if n == 0:
        return True
    if t.is_contiguous():
        extent = n
    else:
        extent = 1 + sum((size - 1) * stride
                         for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + extent) * t.element_size() <= t.untyped_storage().nbytes()


def plain_cpu(t: Tensor) -> bool:
    """A plain contiguous CPU tensor whose storage holds it (what a kernel may read)."""
    return (type(t) is Tensor and t.device.type == "cpu" and t.is_contiguous()
            and storage_holds(t))
