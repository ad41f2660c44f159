"""Tensors without data: the specs and fake tensors a step is predicted on.

Params and batches may be given as real tensors, fake tensors (from one :func:`fake_mode`),
tensors on the meta device, :class:`TensorSpec` or ``(shape, dtype)`` tuples; :func:`to_fake`
reads each the same way. A step that needs data (``.item()``, a data-dependent shape) raises a
one-line :class:`PredictionError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from minitrain._torch import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    pytree,
)
from minitrain.errors import UserError

__all__ = [
    "PredictionError",
    "TensorSpec",
    "fake_mode",
    "fake_tree",
    "find_mode",
    "meta_tree",
    "one_line_errors",
]


class PredictionError(UserError):
    """A step that cannot be traced without data (``.item()``, data-dependent shapes);
    ``reason`` says which op and why, in a few words."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class TensorSpec(NamedTuple):
    """A tensor's shape and dtype (and device), without data: ``jax.ShapeDtypeStruct``.

    A ``(shape, dtype)`` tuple and a tensor on the meta device are read the same way.

    >>> TensorSpec((8, 1024), torch.int64)
    TensorSpec(shape=(8, 1024), dtype=torch.int64, device='cpu')
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


def fake_mode() -> FakeTensorMode:
    """A fake tensor mode for building a model or a batch to predict with (real tensors that
    meet fake ones are converted, as a module's buffers must be).

    >>> with fake_mode():
    ...     w = torch.nn.Linear(4096, 4096).weight   # no memory behind it
    >>> type(w.data).__name__, w.shape
    ('FakeTensor', torch.Size([4096, 4096]))
    """
    return FakeTensorMode(allow_non_fake_inputs=True)


def _is_spec(x: Any) -> bool:
    if isinstance(x, TensorSpec):
        return True
    return (
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)
        and isinstance(x[0], tuple | list | torch.Size)
        and all(isinstance(n, int) for n in x[0])
    )


def fake_tree(mode: FakeTensorMode, tree: Any) -> Any:
    """``tree`` with each spec and tensor (real, meta or fake) as a fake tensor of ``mode``."""
    return pytree.tree_map(lambda x: _to_fake(mode, x), tree, is_leaf=_is_spec)


def meta_tree(tree: Any) -> Any:
    """The twins of ``tree``'s fake tensors on the meta device, made outside the fake mode (the
    update runs on them: see :mod:`minitrain.accounting.predict`)."""
    return pytree.tree_map(_to_meta, tree, is_leaf=_is_spec)


def _to_fake(mode: FakeTensorMode, x: Any) -> Any:
    if _is_spec(x):
        spec = x if isinstance(x, TensorSpec) else TensorSpec(tuple(x[0]), x[1])
        with mode:
            return torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, FakeTensor):
        if x.fake_mode is not mode:
            raise UserError("tensors from two fake modes; build them under one fake_mode()")
        return x
    if x.is_meta:
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    return mode.from_tensor(x)


def _to_meta(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def find_mode(tree: Any) -> FakeTensorMode | None:
    leaves, _ = pytree.tree_flatten(tree)
    for leaf in leaves:
        if isinstance(leaf, FakeTensor):
            return leaf.fake_mode
    return None


def _describe(func: Any) -> str:
    name = str(func).removesuffix(".default")
    if "_local_scalar_dense" in name:
        return f"{name} (.item(), float() or int() of a tensor) needs the tensor's data"
    return f"{name} needs the tensor's data (its output shape depends on the values)"


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """What fake tensors raise for a step that needs data, as a :class:`PredictionError`."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        reason = f"{_describe(exc.func)}, which fake tensors do not have"
        raise PredictionError(f"{reason}: measure one real step instead", reason) from None
    except UnsupportedOperatorException as exc:
        reason = f"{exc.func} has no fake-tensor implementation"
        raise PredictionError(f"{reason}: measure one real step instead", reason) from None
