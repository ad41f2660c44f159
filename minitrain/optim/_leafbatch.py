"""Lists of tensors that do arithmetic like one tensor, through ``torch._foreach_*`` kernels:
how a per-leaf rule (:func:`minitrain.optim.leafwise`) runs batched without a second
definition."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch

__all__ = ["LeafBatch"]


class LeafBatch(list):
    """A list of same-device, same-dtype tensors that does arithmetic like one tensor.

    Arithmetic and the torch functions with a ``torch._foreach_*`` kernel run as one foreach
    call; any other torch function or tensor method runs leaf by leaf, so a per-leaf rule works
    unchanged on a batch.

    >>> b = LeafBatch([torch.ones(2), torch.zeros(3)])
    >>> list(torch.sqrt(b * 4 + 1))
    [tensor([2.2361, 2.2361]), tensor([1., 1., 1.])]
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        foreach = _FOREACH_FUNCTIONS.get(func)
        if foreach is not None:
            result = foreach(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return _per_leaf(func, args, kwargs)

    def _binary(self, other, name):
        if isinstance(other, LeafBatch) or isinstance(other, int | float) and not isinstance(
            other, bool
        ):
            return _fe(name, self, other)
        if isinstance(other, Tensor) and other.dim() == 0 and name in ("add", "mul", "div"):
            return _fe(name, self, other)
        return _per_leaf(getattr(Tensor, f"__{name}__" if name != "div" else "__truediv__"),
                         (self, other), {})

    def __add__(self, other):
        return self._binary(other, "add")

    def __radd__(self, other):
        return self._binary(other, "add")

    def __mul__(self, other):
        return self._binary(other, "mul")

    def __rmul__(self, other):
        return self._binary(other, "mul")

    def __truediv__(self, other):
        return self._binary(other, "div")

    def __sub__(self, other):
        if isinstance(other, LeafBatch) or isinstance(other, int | float):
            return _fe("sub", self, other)
        return _per_leaf(Tensor.__sub__, (self, other), {})

    def __rsub__(self, other):
        if isinstance(other, int | float):  # -x + c equals c - x exactly
            return _fe("add", _fe("neg", self), other)
        return _per_leaf(Tensor.__rsub__, (self, other), {})

    def __rtruediv__(self, other):
        return _per_leaf(Tensor.__rtruediv__, (self, other), {})

    def __neg__(self):
        return _fe("neg", self)

    # Rules are pure: ``x += y`` rebinds x to a new batch (list's += would extend the list).
    __iadd__ = __add__
    __imul__ = __mul__
    __isub__ = __sub__
    __itruediv__ = __truediv__

    def __gt__(self, other):
        return _per_leaf(Tensor.__gt__, (self, other), {})

    def __lt__(self, other):
        return _per_leaf(Tensor.__lt__, (self, other), {})

    def __ge__(self, other):
        return _per_leaf(Tensor.__ge__, (self, other), {})

    def __le__(self, other):
        return _per_leaf(Tensor.__le__, (self, other), {})

    def __pow__(self, other):
        if isinstance(other, int | float):
            return _fe("pow", self, other)
        return _per_leaf(Tensor.__pow__, (self, other), {})

    def __getattr__(self, name):  # tensor methods, leaf by leaf
        method = getattr(Tensor, name)
        if not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: _per_leaf(method, (self, *args), kwargs)

    def sqrt(self):
        return _fe("sqrt", self)

    def abs(self):
        return _fe("abs", self)

    def sign(self):
        return _fe("sign", self)

    def to(self, *args, **kwargs):
        return self if args and args[0] == self[0].dtype and not kwargs else _per_leaf(
            Tensor.to, (self, *args), kwargs
        )


def _fe(name: str, *args: Any, **kwargs: Any) -> LeafBatch:
    """``torch._foreach_<name>`` on plain lists (a LeafBatch argument would dispatch back to
    ``LeafBatch.__torch_function__``)."""
    raw = [list(a) if isinstance(a, LeafBatch) else a for a in args]
    return LeafBatch(_torch.foreach[name](*raw, **kwargs))


def _per_leaf(func: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    n = next(len(a) for a in (*args, *kwargs.values()) if isinstance(a, LeafBatch))

    def pick(value: Any, i: int) -> Any:
        if isinstance(value, LeafBatch):
            return value[i]
        if isinstance(value, tuple | list) and any(isinstance(v, LeafBatch) for v in value):
            return type(value)(pick(v, i) for v in value)
        return value

    results = [
        func(*(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()})
        for i in range(n)
    ]
    if results and isinstance(results[0], tuple):
        return tuple(LeafBatch(column) for column in zip(*results, strict=True))
    return LeafBatch(results)


def _foreach_lerp(start, end, weight):
    if isinstance(start, LeafBatch) and isinstance(end, LeafBatch) and (
        isinstance(weight, int | float) or isinstance(weight, Tensor) and weight.dim() == 0
    ):
        return _fe("lerp", start, end, weight)
    return NotImplemented


def _foreach_maximum(a, b):
    if isinstance(a, LeafBatch) and isinstance(b, LeafBatch):
        return _fe("maximum", a, b)
    return NotImplemented


def _foreach_addcmul(a, t1, t2, *, value=1):
    if all(isinstance(x, LeafBatch) for x in (a, t1, t2)) and isinstance(value, int | float):
        return _fe("addcmul", a, t1, t2, value=value)
    return NotImplemented


_FOREACH_FUNCTIONS: dict[Callable, Callable] = {
    torch.sqrt: lambda x: _fe("sqrt", x),
    torch.abs: lambda x: _fe("abs", x),
    torch.sign: lambda x: _fe("sign", x),
    torch.neg: lambda x: _fe("neg", x),
    torch.exp: lambda x: _fe("exp", x),
    torch.lerp: _foreach_lerp,
    torch.maximum: _foreach_maximum,
    torch.addcmul: _foreach_addcmul,
}
