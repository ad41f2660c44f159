"""Parameter initializers: pure functions of a shape and an explicit ``torch.Generator``.

The chapter (3.5.1): plain ``randn`` grows the output with the input dimension; Xavier scaling
divides by ``sqrt(fan_in)``; a truncated normal also removes the outliers in the tails. Weights
use the chapter's ``(input_dim, output_dim)`` layout, so ``fan_in = shape[0]``.

>>> import torch
>>> w = xavier_normal((16384, 1), generator=torch.Generator().manual_seed(0))
>>> x = torch.randn(16384, generator=torch.Generator().manual_seed(1))
>>> bool(abs(float(x @ w)) < 5)   # plain randn would give ~128 (sqrt(16384))
True
"""

from __future__ import annotations

import math

import torch

__all__ = ["normal", "xavier_normal", "truncated_normal", "fan_in"]

Shape = tuple[int, ...]


def fan_in(shape: Shape) -> int:
    """Number of inputs of a weight in ``(input_dim, output_dim)`` layout (1 for scalars).

    >>> fan_in((64, 32)), fan_in((8,)), fan_in(())
    (64, 8, 1)
    """
    return shape[0] if len(shape) > 0 else 1


def normal(
    shape: Shape, *, generator: torch.Generator, std: float = 1.0,
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> torch.Tensor:
    """Gaussian ``N(0, std²)`` of ``shape``: the chapter's plain ``torch.randn``.

    >>> normal((2, 3), generator=torch.Generator().manual_seed(0)).shape
    torch.Size([2, 3])
    """
    _check_shape(shape)
    if std < 0:
        raise ValueError(f"std must be non-negative, got {std}")
    return std * torch.randn(shape, generator=generator, dtype=dtype, device=device)


def xavier_normal(
    shape: Shape, *, generator: torch.Generator, dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``randn(shape) / sqrt(fan_in)``: the chapter's Xavier initialization (Glorot & Bengio 2010).

    >>> w = xavier_normal((400, 300), generator=torch.Generator().manual_seed(0))
    >>> round(float(w.std() * 20), 1)   # std = 1/sqrt(400) = 0.05
    1.0
    """
    return normal(
        shape, generator=generator, std=1 / math.sqrt(fan_in(shape)), dtype=dtype, device=device
    )


def truncated_normal(
    shape: Shape, *, generator: torch.Generator, std: float | None = None, bound: float = 3.0,
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> torch.Tensor:
    """Normal with std ``std`` (default ``1/sqrt(fan_in)``), resampled outside ±``bound``·std.

    The chapter's ``trunc_normal_(std=1/sqrt(d), a=-3, b=3)`` cuts at ±3 absolute; this cuts at
    ±3 std, as the chapter means.

    >>> w = truncated_normal((256, 256), generator=torch.Generator().manual_seed(0))
    >>> bool(w.abs().max() <= 3 / 16)
    True
    """
    _check_shape(shape)
    if bound <= 0:
        raise ValueError(f"bound must be positive (in units of std), got {bound}")
    std = 1 / math.sqrt(fan_in(shape)) if std is None else std
    if std < 0:
        raise ValueError(f"std must be non-negative, got {std}")
    out = torch.empty(shape, dtype=dtype, device=device)
    return torch.nn.init.trunc_normal_(
        out, mean=0.0, std=std, a=-bound * std, b=bound * std, generator=generator
    )


def _check_shape(shape: Shape) -> None:
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
