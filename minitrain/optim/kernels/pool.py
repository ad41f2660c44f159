"""Recycled output buffers for pure CPU updates: one pool per thread, made on its first use.

A pure update writes every new param and state tensor into memory the caller did not pass in.
Fresh ``torch.empty`` memory costs page faults on the CPU (glibc hands large freed blocks back
to the kernel, so each step maps and zero-fills them again), more than the update's arithmetic.
The pool keeps an alias of each buffer it hands out; once the caller has dropped every tensor
and view of it (the storage's use count, as inductor's cudagraph trees check it, is back to the
alias alone), the next update reuses the memory. Nobody can observe the reuse, so the update
stays pure; up to two generations of params and state stay allocated between updates.
"""

from __future__ import annotations

import ctypes
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

    def _idle(self, held: list[tuple[Tensor, int]]) -> list[Tensor]:
        alone = _alone()
        return [alias for alias, storage in held if _torch.storage_use_count(storage) <= alone]

    def idle_bytes(self) -> int:
        """Bytes of buffers that only this pool holds: its extra memory right now."""
        return sum(alias.untyped_storage().nbytes() for held in self._held.values()
                   for alias in self._idle(held))

    def begin_update(self) -> None:
        """Find the buffers nobody else holds any more; call once before an update."""
        self._demand = {}
        self._free = {key: self._idle(held) for key, held in self._held.items()}

    def __call__(self, like: list[Tensor]) -> list[Tensor]:
        """An uninitialized contiguous CPU buffer of each tensor's shape and dtype, recycled
        where one is free."""
        if _torch.storage_use_count is None:  # no way to tell a free buffer
            return [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in like]
        return [self._take((t.shape, t.dtype)) for t in like]

    def _take(self, key: tuple) -> Tensor:
        shape, dtype = key
        demand = self._demand[key] = self._demand.get(key, 0) + 1
        free, nbytes = self._free.get(key), shape.numel() * dtype.itemsize
        while free:
            alias = free.pop()
            storage = alias.untyped_storage()
            if sys.getrefcount(storage) > _storage_refs_alone():
                continue  # no tensor holds it, but someone holds its storage object
            if storage.nbytes() >= nbytes:
                return alias.detach()
            # Resized by hand (``resize_``): a kernel writing into it would write past its end.
            self._held[key] = [held for held in self._held[key] if held[0] is not alias]
        _from_the_heap(nbytes)
        # CPU by name: under torch.set_default_device('cuda' or 'meta') a kernel would get a
        # pointer it cannot write.
        buffer = torch.empty(shape, dtype=dtype, device="cpu")
        held = self._held.setdefault(key, [])
        if len(held) < 2 * demand:  # two generations (inputs and outputs) at most
            held.append((buffer, buffer.untyped_storage()._cdata))
        return buffer.detach()


# glibc's malloc serves a request of at least its mmap threshold (128 KiB at first) with a
# fresh mmap, and raises the threshold to the size of such a chunk when one is freed, if the
# chunk is at most 32 MiB (mallopt(3), M_MMAP_THRESHOLD).
_MMAP_THRESHOLD = 128 * 1024
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_PAGE = 4096
_ALIGNMENT = 64  # c10's alignment for CPU tensors (posix_memalign)
_HEAP_SIZES: set[int] = set()


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc, whose malloc torch's CPU tensors use."""
    try:
        libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):
        return None
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                    ctypes.c_size_t]
    libc.posix_memalign.restype = ctypes.c_int
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    return libc


def _from_the_heap(nbytes: int) -> None:
    """Let buffers of ``nbytes`` come from malloc's heap, not from fresh mmaps (each at the
    same offset in a page, which is slower), by freeing one mmapped block of that size first,
    as glibc's own rule does after the first such free. Once per size, on glibc only."""
    if nbytes in _HEAP_SIZES or not _MMAP_THRESHOLD <= nbytes <= _MMAP_THRESHOLD_MAX - _PAGE:
        return
    _HEAP_SIZES.add(nbytes)
    libc = _glibc()
    block = ctypes.c_void_p()
    if libc is not None and libc.posix_memalign(ctypes.byref(block), _ALIGNMENT, nbytes) == 0:
        libc.free(block)


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


def _probe() -> Tensor:
    """A plain one-element CPU tensor made outside any dispatch mode (a probe is not part of
    the update a mode such as the accounting ``Counter`` watches)."""
    with _torch.disable_current_modes():
        return torch.empty(1, device="cpu")


@functools.cache
def _alone() -> int:
    """The use count of a storage held by one tensor (measured on first use, not at import:
    the module may first be imported under a functorch transform)."""
    probe = _probe()  # alive while its storage is counted
    return _torch.storage_use_count(probe.untyped_storage()._cdata)


@functools.cache
def _storage_refs_alone() -> int:
    """References to a storage's Python object that nobody else holds, counted as ``_take``
    counts them (one local name and the call's argument)."""
    probe = _probe()
    storage = probe.untyped_storage()
    return sys.getrefcount(storage)
