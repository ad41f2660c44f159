"""Recycled output buffers for pure CPU updates: one pool per thread, made on its first use.

A pure update writes every new param and state tensor into memory the caller did not pass in.
Fresh ``torch.empty`` memory costs page faults on the CPU (glibc hands large freed blocks back
to the kernel, so each step maps and zero-fills them again), more than the update's arithmetic.
The pool keeps an alias of each buffer it hands out; once the caller has dropped every tensor
and view of it (the storage's use count, as inductor's cudagraph trees check it, is back to the
alias alone), the next update reuses the memory. Nobody can observe the reuse, so the update
stays pure; up to two generations of params and state stay allocated between updates."""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch import Tensor

from minitrain import _torch

__all__ = ["BufferPool", "current", "idle_bytes"]


class BufferPool:
    """Output buffers for pure CPU updates, recycled once nothing outside the pool holds them."""

    def __init__(self) -> None:
        # per (shape, dtype): (alias, its StorageImpl's address) of each buffer handed out; the
        # pool alone holds the alias (a storage object kept would count as a use)
        self._held: dict[tuple, list[tuple[Tensor, int]]] = {}
        self._free: dict[tuple, list[Tensor]] = {}
        self._demand: dict[tuple, int] = {}

    def _idle(self, key: tuple) -> list[Tensor]:
        """The buffers of ``key`` nobody else holds: no tensor, no storage object, and whole
        (one resized by hand, ``resize_``, would let a kernel write past its end)."""
        shape, dtype = key
        (alone, refs_alone), nbytes = _alone(), shape.numel() * dtype.itemsize
        idle = []
        for alias, address in self._held[key]:
            if _torch.storage_use_count(address) <= alone:
                storage = alias.untyped_storage()
                if sys.getrefcount(storage) <= refs_alone and storage.nbytes() >= nbytes:
                    idle.append(alias)
        return idle

    def idle_bytes(self) -> int:
        """Bytes of buffers that only this pool holds: its extra memory right now."""
        return sum(alias.untyped_storage().nbytes() for key in self._held
                   for alias in self._idle(key))

    def begin_update(self) -> None:
        """Find the buffers nobody else holds any more; call once before an update."""
        self._demand = {}
        self._free = {key: self._idle(key) for key in self._held}

    def __call__(self, like: list[Tensor]) -> list[Tensor]:
        """An uninitialized contiguous CPU buffer of each tensor's shape and dtype, recycled
        where one is free."""
        return [self._take((t.shape, t.dtype)) for t in like]

    def _take(self, key: tuple) -> Tensor:
        demand = self._demand[key] = self._demand.get(key, 0) + 1
        if self._free.get(key):
            return self._free[key].pop().detach()
        # CPU by name: under torch.set_default_device('cuda' or 'meta') a kernel would get a
        # pointer it cannot write.
        buffer = torch.empty(key[0], dtype=key[1], device="cpu")
        held = self._held.setdefault(key, [])
        if len(held) < 2 * demand:  # two generations (inputs and outputs) at most
            held.append((buffer, buffer.untyped_storage()._cdata))
        return buffer.detach()


_THREAD = threading.local()


def current() -> BufferPool:
    """This thread's pool (each thread has its own, so no two updates share a free buffer).

    >>> current() is current()
    True
    """
    pool = getattr(_THREAD, "pool", None)
    if pool is None:
        pool = _THREAD.pool = BufferPool()
    return pool


def idle_bytes() -> int:
    """Bytes this thread's pool holds beyond what callers hold: the pure update's extra memory.

    >>> isinstance(idle_bytes(), int)
    True
    """
    pool = getattr(_THREAD, "pool", None)
    return 0 if pool is None else pool.idle_bytes()


@functools.cache
def _alone() -> tuple[int, int]:
    """The use count of a storage held by one tensor, and the references to its Python object
    that nobody else holds, counted as ``_idle`` counts them (one local name and the call's
    argument). Measured on first use, not at import (the module may first be imported under a
    functorch transform), on a probe made outside any dispatch mode (it is not part of the
    update a mode such as the accounting ``Counter`` watches)."""
    with _torch.disable_current_modes():
        probe = torch.empty(1, device="cpu")
    uses = _torch.storage_use_count(probe.untyped_storage()._cdata)  # no storage object held
    storage = probe.untyped_storage()
    return uses, sys.getrefcount(storage)
