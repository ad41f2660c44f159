"""Explicit random keys: counter-based draws that are pure functions of a key (JAX's model).

A key is a plain ``int64`` tensor of shape ``(2,)`` holding two 32-bit words, so keys stack,
split per member under ``torch.func.vmap`` and trace under ``torch.compile`` like any tensor.
Draws encipher the element indices with Threefry-2x32-20 (Salmon et al. 2011, "Parallel random
numbers: as easy as 1, 2, 3"; JAX's ``threefry2x32``) in ``int64`` words masked to 32 bits (no
overflow), laid out as JAX's partitionable Threefry (``split`` and ``uniform`` give JAX's
numbers); the same key gives the same numbers eagerly, vmapped and compiled. A plain CPU key's
counters are enciphered in C (:mod:`minitrain._native`), else by torch's ops.

>>> k1, k2 = split(key(0))
>>> float(uniform(key(0), ())), float(uniform(k2, ()))   # jax.random.uniform's numbers
(0.9476670026779175, 0.007293820381164551)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minitrain import _native, _torch
from minitrain.typecheck import Int, Tensor

__all__ = ["key", "split", "fold_in", "bits", "uniform", "normal", "bernoulli", "threefry2x32"]

Key = Int[Tensor, "2"]
Shape = tuple[int, ...]
_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32 rotation constants (Random123)
_PARITY = 0x1BD11BDA  # Skein's key-schedule parity constant
# normal's u is uniform on (-1, 1): its least value in each dtype it draws u in
_LOW = {torch.float64: math.nextafter(-1.0, 0.0), torch.float32: -1.0 + 2.0**-24}


def key(seed: int | torch.Generator) -> Key:
    """A key from an integer seed: ``(seed >> 32, seed & 0xFFFFFFFF)``, as ``jax.random.key``;
    from a CPU ``torch.Generator`` (an ``Experiment``'s init gets one), two 32-bit words it draws.

    >>> key(42)
    tensor([ 0, 42])
    >>> torch.equal(key(torch.Generator().manual_seed(0)), key(torch.Generator().manual_seed(0)))
    True
    """
    if isinstance(seed, torch.Generator) and seed.device.type == "cpu":
        return torch.randint(2**32, (2,), generator=seed, dtype=torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be an int that fits 64 bits or a CPU torch.Generator, "
                         f"got {seed!r}")
    seed %= 2**64
    return torch.tensor([seed >> 32, seed & _MASK], dtype=torch.int64)


def threefry2x32(k: Key, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    """Threefry-2x32, 20 rounds: the counters ``(x0, x1)`` (32-bit words in int64) enciphered
    under key ``k``; five groups of four rounds, a key injection after each (Random123).

    >>> k = torch.tensor([0x13198A2E, 0x03707344])  # Random123's known-answer test
    >>> [hex(int(w)) for w in threefry2x32(k, torch.tensor(0x243F6A88), torch.tensor(0x85A308D3))]
    ['0xc4923a9c', '0x483df7a0']
    """
    k = k.long()  # a narrower key's words xor-ed in its own dtype would wrap
    return _rounds((k[0], k[1], k[0] ^ k[1] ^ _PARITY), x0, x1)


def _checked(k: Any, *sizes: int) -> Any:
    """``k``, refused in one line where it is no key (an integer tensor of shape ``(2,)``) or a
    size is negative."""
    if not isinstance(k, Tensor) or k.shape != (2,) or k.is_floating_point() or k.is_complex():
        kind = f"{k.dtype} tensor of shape {tuple(k.shape)}" if isinstance(k, Tensor) else \
            type(k).__name__
        raise ValueError(f"a key is an integer tensor of shape (2,) (mt.random.key(seed), or a "
                         f"row of split(key, n) under vmap); got a {kind}")
    if any(size < 0 for size in sizes):
        raise ValueError(f"sizes must be >= 0, got {sizes}")
    return k


def _rounds(ks: tuple, x0: Any, x1: Any) -> tuple[Any, Any]:
    """:func:`threefry2x32` under the key schedule ``ks``, on tensors or on Python ints."""
    x0, x1 = (x0 + ks[0]) & _MASK, (x1 + ks[1]) & _MASK
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = (x0 + x1) & _MASK
            x1 = (((x1 << r) | (x1 >> (32 - r))) & _MASK) ^ x0  # rotate left, mix
        x0 = (x0 + ks[(i + 1) % 3]) & _MASK
        x1 = (x1 + ks[(i + 2) % 3] + i + 1) & _MASK
    return x0, x1


_MODES = {"pairs": (0, torch.int64), "xor": (1, torch.int64), torch.float32: (2, torch.float32),
          torch.float64: (3, torch.float64)}  # _streaming.c's THREEFRY_PAIRS...


def _native_threefry(k: Key, start: int, stop: int, mode: Any, low: float = 0.0,
                     span: float = 1.0) -> Tensor | None:
    """Counters ``start..stop`` enciphered in C (a few microseconds, not ~100 torch ops): rows of
    (high, low) words (``"pairs"``), the words ``high ^ low`` (``"xor"``), or :func:`uniform`'s
    numbers of dtype ``mode`` from them; None without the library."""
    if (library := _native._library()) is None:
        return None
    code, dtype = _MODES[mode]
    out = torch.empty((stop - start, 2) if mode == "pairs" else (stop - start,), dtype=dtype,
                      device="cpu")
    k0, k1 = k.tolist()
    library.minitrain_threefry(k0 & _MASK, k1 & _MASK, start, stop - start, code, low, span,
                               out.data_ptr(), torch.get_num_threads())
    return out


def _plain_cpu(k: Tensor) -> bool:
    """Whether ``k`` is a plain CPU tensor outside torch.compile, vmap / grad wrappers and
    dispatch or function modes: C may draw its words."""
    return (type(k) is torch.Tensor and k.is_cpu
            and not torch.compiler.is_compiling() and not _torch.is_functorch_wrapped_tensor(k)
            and _torch.get_current_dispatch_mode() is None
            and not _torch.is_torch_function_mode_enabled())


def _enciphered(k: Key, start: int, stop: int, mode: str = "pairs") -> Tensor:
    """Counters ``start..stop`` enciphered under ``k``: rows of (high, low) 32-bit words, or
    (``"xor"``) the words ``high ^ low``."""
    if _plain_cpu(k) and (words := _native_threefry(k, start, stop, mode)) is not None:
        return words
    index = torch.arange(start, stop, dtype=torch.int64, device=k.device)
    high, low = threefry2x32(k, index >> 32, index & _MASK)
    return torch.stack((high, low), dim=-1) if mode == "pairs" else high ^ low


def split(k: Key, num: int = 2) -> Int[Tensor, "num 2"]:
    """``num`` new keys; key ``i`` is ``fold_in(k, i)``. Unpack them or ``vmap`` over the rows.

    >>> split(key(0), 3).shape
    torch.Size([3, 2])
    """
    return _enciphered(_checked(k, num), 0, num)


def fold_in(k: Key, data: int | Tensor) -> Key:
    """A new key from ``k`` and a 32-bit integer (a step, a layer index), as JAX's ``fold_in``.

    >>> bool((fold_in(key(0), 1) == split(key(0), 2)[1]).all())
    True
    """
    _checked(k)
    if isinstance(data, int) and _plain_cpu(k):
        return _enciphered(k, data & _MASK, (data & _MASK) + 1)[0]
    data = torch.as_tensor(data, dtype=torch.int64, device=k.device) & _MASK
    return torch.stack(threefry2x32(k, torch.zeros_like(data), data))


def bits(k: Key, shape: Shape) -> Int[Tensor, "..."]:
    """Uniform 32-bit words (in ``int64``) of ``shape``: element ``i`` enciphers counter ``i``.

    >>> bits(key(0), (2, 3)).shape
    torch.Size([2, 3])
    """
    return _enciphered(_checked(k, *shape), 0, math.prod(shape), "xor").reshape(shape)


def uniform(k: Key, shape: Shape, dtype: torch.dtype = torch.float32,
            minval: float = 0.0, maxval: float = 1.0) -> Tensor:
    """Uniform on ``[minval, maxval)``: the top ``m`` bits of each word times ``2**-m``, ``m`` the
    stored significand bits of ``dtype`` (at most 32), as JAX fills the mantissa of ``[1, 2)``.

    >>> u = uniform(key(0), (1000,))
    >>> bool(u.min() >= 0) and bool(u.max() < 1)
    True
    """
    if not dtype.is_floating_point:
        raise ValueError(f"uniform draws floating-point numbers, got dtype={dtype}")
    span, unit = maxval - minval, None
    if dtype in _MODES and _plain_cpu(_checked(k, *shape)):
        exact = math.isfinite(span) and math.frexp(span)[0] == 0.5  # then C rounds as torch
        unit = _native_threefry(k, 0, math.prod(shape), dtype, *((minval, span) if exact else ()))
        if unit is not None and exact:
            return unit.reshape(shape)
    if unit is None:
        m = min(32, -int(math.log2(torch.finfo(dtype).eps)))
        unit = (bits(k, shape) >> (32 - m)).to(dtype) * 2.0**-m
    return torch.clamp(minval + unit.reshape(shape) * span, min=minval)


def normal(k: Key, shape: Shape, dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard normal: ``sqrt(2) * erfinv(u)``, ``u`` uniform on ``(-1, 1)`` (as JAX draws it).

    >>> round(float(normal(key(0), (100_000,)).std()), 1)
    1.0
    """
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (math.sqrt(2) * torch.erfinv(uniform(k, shape, wide, _LOW[wide], 1.0))).to(dtype)


def _split_normal(k: Key, size: int, dtype: torch.dtype) -> tuple[Key, Tensor]:
    """``split(k)``'s first key and :func:`normal` of ``size`` under its second, in one C
    call for a plain CPU key (the same numbers: DP-SGD's noise each step)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    low = _LOW[wide]
    if _plain_cpu(_checked(k, size)) and (library := _native._library()) is not None:
        keys = torch.empty((2, 2), dtype=torch.int64, device="cpu")
        unit = torch.empty(size, dtype=wide, device="cpu")
        k0, k1 = k.tolist()
        library.minitrain_split_draw(k0 & _MASK, k1 & _MASK, size, _MODES[wide][0], low, 1.0 - low,
                                     keys.data_ptr(), unit.data_ptr(), torch.get_num_threads())
        return keys[0], (math.sqrt(2) * torch.erfinv(unit)).to(dtype)
    new_key, noise_key = split(k)
    return new_key, normal(noise_key, (size,), dtype)


def bernoulli(k: Key, p: float | Tensor, shape: Shape) -> Tensor:
    """``True`` with probability ``p``, independently per element (``uniform < p``).

    >>> bernoulli(key(0), 0.0, (3,))
    tensor([False, False, False])
    """
    return uniform(k, shape) < p
