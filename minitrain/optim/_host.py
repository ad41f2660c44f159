"""Scalars of optimizer state made on the host: a state's counts, lrs and flags stay on the
CPU (as with no default device set) whatever ``torch.set_default_device`` says."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from minitrain import _torch

__all__ = ["zero_count", "host_tensor", "functorch_wrappers", "is_batched", "is_traced",
           "lerp_weight", "next_step", "schedule_count", "updates_done"]


def zero_count() -> Tensor:
    """A state's update count, 0-d int64 on the host: counts, lrs and flags of a state stay
    on the CPU (as with no default device set) under ``torch.set_default_device``.

    >>> zero_count()
    tensor(0)
    """
    return torch.zeros((), dtype=torch.int64, device="cpu")


def host_tensor(value: Any, dtype: torch.dtype) -> Tensor:
    """``torch.as_tensor(value, dtype=dtype)``, a Python number made on the CPU whatever
    ``torch.set_default_device`` says (a tensor stays on its device).

    >>> host_tensor(0.5, torch.float64)
    tensor(0.5000, dtype=torch.float64)
    """
    return torch.as_tensor(value, dtype=dtype,
                           device=value.device if isinstance(value, Tensor) else "cpu")


def is_traced(value: Any) -> bool:
    """True for a tensor seen through vmap / grad transforms or by a compiler's tracer."""
    if not isinstance(value, Tensor):
        return False
    if torch.compiler.is_compiling():
        return True
    if type(value) in _PLAIN_TENSOR_TYPES:  # fast path: no subclass, so not fake
        return _torch.is_functorch_wrapped_tensor(value)
    if _torch.is_functorch_wrapped_tensor(value):
        return True
    return isinstance(value, _torch.FakeTensor) or not _has_storage(value)


_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def is_batched(value: Tensor) -> bool:
    """True for a tensor batched by ``vmap``, at any level of torch.func transforms (under
    ``grad`` alone, False).

    >>> torch.func.vmap(lambda row: torch.tensor(is_batched(row)))(torch.ones(2, 3)).tolist()
    [True, True]
    """
    return "batched" in functorch_wrappers(value)


def functorch_wrappers(value: Tensor) -> list[str]:
    """The torch.func wrappers around ``value``, outermost first: ``"batched"`` (``vmap``),
    ``"grad"`` (``grad``, ``jvp``) or ``"other"``.

    >>> torch.func.vmap(lambda row: torch.func.grad(lambda r: r.sum() + float(
    ...     functorch_wrappers(r) == ["grad", "batched"]))(row))(torch.ones(2, 3)).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    kinds = []
    while _torch.is_functorch_wrapped_tensor(value):
        kinds.append("batched" if _torch.is_batchedtensor(value) else
                     "grad" if _torch.is_gradtrackingtensor(value) else "other")
        value = _torch.get_unwrapped(value)
    return kinds


def lerp_weight(weight: Any, like: Any) -> Any:
    """``torch.lerp``'s weight for a leaf like ``like``: a traced tensor (a vmapped beta, one
    member's value per row) in ``like``'s dtype, which lerp requires of a batched weight (a
    float64 sweep value on float32 params); anything else (a batch of leaves too) as it is.

    >>> lerp_weight(0.1, torch.ones(1)), lerp_weight(torch.tensor(0.1), torch.ones(1)).dtype
    (0.1, torch.float32)
    """
    if is_traced(weight) and isinstance(like, Tensor) and weight.dtype != like.dtype:
        return weight.to(like.dtype)
    return weight


def _has_storage(value: Tensor) -> bool:
    try:
        value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def updates_done(count: Any) -> int | None:
    """``int(count)``, None where the count is traced; ``ValueError`` for a count that is not
    a one-element real tensor holding a value >= 0 (a state edited by hand).

    >>> updates_done(zero_count() + 3)
    3
    """
    if not isinstance(count, Tensor) or count.numel() != 1 or count.is_meta or \
            count.is_complex():
        raise ValueError(f"state.count is {count!r}, not a one-element tensor; pass the state "
                         f"returned by opt.init(params) or opt.update")
    if is_traced(count):
        return None
    done = int(count)
    if done < 0:
        raise ValueError(f"state.count is {done}, but a count of updates is >= 0; pass the "
                         f"state returned by opt.init(params) or opt.update")
    return done


def next_step(count: Any) -> Any:
    """The 1-based number of the update after ``count`` updates: an int, or a float64 0-d
    tensor where ``count`` is traced (vmap, compile); a hand-edited count is refused as by
    :func:`updates_done`.

    >>> next_step(zero_count() + 3)
    4
    """
    done = updates_done(count)
    return count.to(torch.float64) + 1 if done is None else done + 1


def schedule_count(count: Any) -> Any:
    """What a schedule ``step -> value`` is called with: the number of updates done as an int,
    or ``count`` itself where it is traced (checked as by :func:`updates_done`).

    >>> schedule_count(zero_count() + 2)
    2
    """
    done = updates_done(count)
    return count if done is None else done
