"""A fast path for the family's chains: the same per-leaf rules, with every result written
into recycled buffers.

A pure update on the CPU allocates a fresh tensor per op and leaf; for 4 MB leaves each
allocation maps and zero-fills new pages (glibc returns large freed blocks to the kernel), and
that costs several times the arithmetic (see ``minitrain.optim.base.BufferPool``). Here the
rule's ``update_leaf`` runs on :class:`PooledLeaves`: each op runs leaf by leaf (on the CPU a
``torch._foreach_*`` kernel is the same per-tensor loop) with ``out=`` a buffer from a
:class:`~minitrain.optim.base.BufferPool`, which recycles the buffers nobody holds any more.
The ops and their order are the rule's own, so results equal the chain's bit for bit.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._python_dispatch as _python_dispatch
from torch import Tensor

from minitrain.optim.base import BufferPool

__all__ = ["PooledLeaves"]

# (func, argument signature) -> whether ``out=`` works and the result's shape and dtype
_OUT_SPECS: dict[tuple, tuple[bool, torch.Size, torch.dtype] | None] = {}


def _signature(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (value.shape, value.dtype)
    if isinstance(value, tuple | list):
        return tuple(_signature(v) for v in value)
    return type(value)


class PooledLeaves(list):
    """Same-shape-group leaves whose every op writes into ``pool`` buffers (see module doc)."""

    pool: BufferPool

    def __init__(self, leaves, pool: BufferPool):
        super().__init__(leaves)
        self.pool = pool

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _apply(func, args, kwargs or {})

    def __getattr__(self, name):
        method = getattr(torch, name, None) or getattr(Tensor, name)
        return lambda *args, **kwargs: _apply(method, (self, *args), kwargs)


def _operator(func: Callable, swap: bool = False) -> Callable:
    if swap:
        return lambda self, other: _apply(func, (other, self), {})
    return lambda self, other: _apply(func, (self, other), {})


for _name, _func in {"add": torch.add, "sub": torch.sub, "mul": torch.mul,
                     "truediv": torch.div, "pow": torch.pow, "gt": torch.gt, "lt": torch.lt,
                     "ge": torch.ge, "le": torch.le, "eq": torch.eq}.items():
    setattr(PooledLeaves, f"__{_name}__", _operator(_func))
for _name, _func in {"radd": torch.add, "rmul": torch.mul}.items():
    setattr(PooledLeaves, f"__{_name}__", _operator(_func, swap=True))
PooledLeaves.__rsub__ = lambda self, other: _apply(torch.rsub, (self, other), {})
# ``number / t`` is ``t.reciprocal() * number`` (torch ``Tensor.__rtruediv__``): the same two
# ops, each with ``out=`` (``operator.truediv`` has none, so every call allocated a fresh result).
PooledLeaves.__rtruediv__ = lambda self, other: (
    _apply(torch.mul, (_apply(torch.reciprocal, (self,), {}), other), {})
    if isinstance(other, int | float) else _apply(operator.truediv, (other, self), {}))
PooledLeaves.__neg__ = lambda self: _apply(torch.neg, (self,), {})
PooledLeaves.__iadd__ = PooledLeaves.__add__
PooledLeaves.__isub__ = PooledLeaves.__sub__
PooledLeaves.__imul__ = PooledLeaves.__mul__
PooledLeaves.__itruediv__ = PooledLeaves.__truediv__


def _apply(func: Callable, args: tuple, kwargs: dict) -> Any:
    batch = next(a for a in (*args, *kwargs.values()) if isinstance(a, PooledLeaves))
    results = []
    for i in range(len(batch)):
        leaf_args = tuple(_pick(a, i) for a in args)
        leaf_kwargs = {k: _pick(v, i) for k, v in kwargs.items()}
        results.append(_run(func, leaf_args, leaf_kwargs, batch.pool))
    if results and isinstance(results[0], tuple):
        return tuple(PooledLeaves(column, batch.pool) for column in zip(*results, strict=True))
    if results and not isinstance(results[0], Tensor):
        return results  # e.g. sizes: plain Python values, one per leaf
    return PooledLeaves(results, batch.pool)


def _pick(value: Any, i: int) -> Any:
    if isinstance(value, PooledLeaves):
        return value[i]
    if isinstance(value, tuple | list) and any(isinstance(v, PooledLeaves) for v in value):
        return type(value)(_pick(v, i) for v in value)
    return value


def _run(func: Callable, args: tuple, kwargs: dict, pool: BufferPool) -> Any:
    key = (func, _signature(args), tuple(sorted((k, _signature(v)) for k, v in kwargs.items())))
    known = _OUT_SPECS.get(key)
    if known is not None and known[0]:
        out = _buffer(pool, known[1], known[2], args)
        return func(*args, **kwargs, out=out)
    result = func(*args, **kwargs)
    if known is None and _python_dispatch._get_current_dispatch_mode() is None:
        # Not under a dispatch mode (the accounting Counter, FlopCounterMode, fake tensors):
        # the probe runs the op a second time, which a counter would count as the update's.
        _OUT_SPECS[key] = (_takes_out(func, args, kwargs, result), result.shape, result.dtype) \
            if isinstance(result, Tensor) and result.dim() > 0 else (False, None, None)
    return result


def _buffer(pool: BufferPool, shape: torch.Size, dtype: torch.dtype, args: tuple) -> Tensor:
    like = next(a for a in args if isinstance(a, Tensor) and a.shape == shape)
    if like.dtype != dtype or not like.is_contiguous():
        return torch.empty(shape, dtype=dtype, device=like.device)
    return pool.empty_like(like)


def _takes_out(func: Callable, args: tuple, kwargs: dict, result: Tensor) -> bool:
    """Whether ``func(..., out=buffer)`` works and gives exactly ``result`` for these args."""
    if not any(isinstance(a, Tensor) and a.shape == result.shape for a in args):
        return False
    try:
        again = func(*args, **kwargs, out=torch.empty_like(result))
    except (TypeError, RuntimeError):
        return False
    return isinstance(again, Tensor) and again.dtype == result.dtype and bool(
        torch.equal(again, result) or (result.is_floating_point() and torch.equal(
            torch.isnan(again), torch.isnan(result))))
