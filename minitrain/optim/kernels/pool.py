"""Recycled output buffers for pure CPU updates: one pool per thread, made on its first use.

A pure update writes every new param and state tensor into memory the caller did not pass in.
Fresh ``torch.empty`` memory costs page faults on the CPU (glibc hands large freed blocks back
to the kernel, so each step maps and zero-fills them again), more than the update's arithmetic.
The pool keeps an alias of each buffer it hands out; once the caller has dropped every tensor
and view of it (the storage's use count, as inductor's cudagraph trees check it, is back to the
alias alone), the next update reuses the memory. Nobody can observe the reuse, so the update
stays pure; up to two generations of params and state stay allocated between updates.
Nothing outside ``minitrain.optim.kernels`` sees a pool.
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
        # per (shape, strides, dtype): (alias, its StorageImpl's address) of each buffer handed
        # out; the pool alone holds the alias (a storage object kept would count as a use)
        self._held: dict[tuple, list[tuple[Tensor, int]]] = {}
        self._free: dict[tuple, list[Tensor]] = {}
        self._demand: dict[tuple, int] = {}

    def idle_bytes(self) -> int:
        """Bytes of buffers that only this pool holds: its extra memory right now."""
        return sum(alias.untyped_storage().nbytes() for held in self._held.values()
                   for alias, _ in held if _only_alias_left(alias))

    def begin_update(self) -> None:
        """Find the buffers nobody else holds any more; call once before an update."""
        self._demand = {}
        self._free = {}
        if _CAN_COUNT_STORAGE_USES:
            uses, alone = _torch.storage_use_count, _alone()
            for key, held in self._held.items():
                self._free[key] = [alias for alias, storage in held if uses(storage) <= alone]

    def __call__(self, like: list[Tensor]) -> list[Tensor]:
        """An uninitialized buffer of each tensor's shape, dtype and strides (contiguous where
        a tensor is not dense, as ``torch.empty_like``), recycled where one is free."""
        out = []
        key = free = nbytes = None
        for t in like:
            if not t.is_cpu or not _CAN_COUNT_STORAGE_USES:
                out.append(torch.empty_like(t, memory_format=torch.preserve_format))
                continue
            if key is None or key[0] != t.shape or key[1] != t.stride() or key[2] is not t.dtype:
                key = _key(t)
                free, nbytes = self._free.get(key), _storage_nbytes(key)
            out.append(self._take(key, free, nbytes))
        return out

    def _take(self, key: tuple, free: list[Tensor] | None, nbytes: int) -> Tensor:
        demand = self._demand[key] = self._demand.get(key, 0) + 1
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
        buffer = torch.empty_strided(key[0], key[1], dtype=key[2], device="cpu")
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
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "posix_memalign",
                                                "free")):
        return None
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                    ctypes.c_size_t]
    libc.posix_memalign.restype = ctypes.c_int
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    return libc


def _from_the_heap(nbytes: int) -> None:
    """Let buffers of ``nbytes`` come from malloc's heap, not from fresh mmaps (each at the
    same offset in a page: 1.58x torch's fused AdamW against 1.20x from the heap, 2-core EPYC),
    by freeing one mmapped block of that size first, as glibc's own rule does after the first
    such free. Once per size, on glibc only; malloc's own block, never touched."""
    if nbytes in _HEAP_SIZES or not _MMAP_THRESHOLD <= nbytes <= _MMAP_THRESHOLD_MAX - _PAGE:
        return
    _HEAP_SIZES.add(nbytes)
    libc = _glibc()
    block = ctypes.c_void_p()
    if libc is not None and libc.posix_memalign(ctypes.byref(block), _ALIGNMENT, nbytes) == 0:
        libc.free(block)


def _storage_nbytes(key: tuple) -> int:
    """Bytes of a buffer of ``key``'s shape, strides and dtype.

    >>> _storage_nbytes(((3, 2), (1, 3), torch.float32))
    24
    """
    shape, stride, dtype = key
    if 0 in shape:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))) * dtype.itemsize


def _key(t: Tensor) -> tuple:
    """``(shape, strides, dtype)`` of a buffer for ``t``: ``t``'s strides where it is dense
    and no two elements share an address, else contiguous ones (as ``torch.empty_like``).

    >>> _key(torch.ones(3, 2).t())[1], _key(torch.ones(2).expand(3, 2))[1]
    ((1, 2), (2, 1))
    """
    if t.is_contiguous() or _torch.is_non_overlapping_and_dense_or_false(t):
        return t.shape, t.stride(), t.dtype
    return t.shape, _torch.make_contiguous_strides_for(t.shape), t.dtype


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


_CAN_COUNT_STORAGE_USES = _torch.storage_use_count is not None


def _storage_uses(t: Tensor) -> int:
    return _torch.storage_use_count(t.untyped_storage()._cdata)


def _probe() -> Tensor:
    """A plain one-element CPU tensor made outside any dispatch mode (a probe is not part of
    the update a mode such as the accounting ``Counter`` watches)."""
    with _torch.disable_current_modes():
        return torch.empty(1, device="cpu")


@functools.cache
def _alone() -> int:
    """The use count of a storage held by one tensor (measured on first use, not at import:
    the module may first be imported under a functorch transform)."""
    return _storage_uses(_probe())


@functools.cache
def _storage_refs_alone() -> int:
    """References to a storage's Python object that nobody else holds, counted as ``_take``
    counts them (one local name and the call's argument)."""
    probe = _probe()
    storage = probe.untyped_storage()
    return sys.getrefcount(storage)


def _only_alias_left(alias: Tensor) -> bool:
    return _storage_uses(alias) <= _alone()
