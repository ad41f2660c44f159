"""Rounding to a number format: :func:`quantize` (round to nearest, ties to even, in fp32),
the values of bit patterns, and error statistics, so any format can be studied on any machine.

Block formats are scaled as their references do: MXFP8 and MXFP4 as OCP MX v1.0 (FLOOR scales,
torchao's ``to_mx``), NVFP4 as torchao's ``nvfp4_quantize`` with a per-tensor scale.

>>> import torch
>>> x = torch.tensor([1e-8])
>>> quantize(x, "fp16"), quantize(x, "bf16")
(tensor([0.]), tensor([1.0012e-08]))
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from minitrain.precision.formats import FINITE, FN, IEEE, FormatSpec, spec
from minitrain.typecheck import Float, Int, Tensor, typechecked

__all__ = ["ErrorStats", "quantize", "decode", "values", "error_stats"]


# The IEEE 754 layout of the dtypes the rounding runs in: integer view, mantissa bits, bias.
_LAYOUT = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}


def _round_elements(x: torch.Tensor, s: FormatSpec, saturate: bool,
                    subnormals: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``x`` to format ``s``; return (values, mask of values that overflowed).

    Exact for float64 ``x`` (a value of at most 24 significant bits divided by a power of two
    is exact, and ``torch.round`` rounds half to even, IEEE 754 roundTiesToEven), and for fp32
    ``x`` when ``s`` is an fp8, fp6 or fp4 format (the quotients, below 2**4, are exact too).
    """
    magnitude = x.abs()
    finite = torch.isfinite(x)
    # floor(log2 |x|) read from the exponent field, the spacing written into it (torch.frexp
    # and torch.ldexp are scalar loops on the CPU); zero and subnormals read as -bias
    view, mantissa, bias = _LAYOUT[x.dtype]
    fields = torch.where(finite, magnitude, 1.0).view(view) >> mantissa
    exponent = (fields & (2 * bias + 1)) - bias
    # Below the smallest normal the spacing stays 2**(emin - mantissa_bits); without
    # subnormals, what lies below 2**(emin - 1) flushes to zero at any finer spacing.
    emin = 1 - s.bias
    exponent = exponent.clamp(min=emin if subnormals else emin - 1)
    ulp = ((exponent - s.mantissa_bits + bias) << mantissa).view(x.dtype)
    rounded = torch.round(torch.where(finite, x, 0.0) / ulp) * ulp
    if not subnormals:  # flush results below the smallest normal to signed zero
        rounded = torch.where(rounded.abs() < s.min_normal, rounded * 0.0, rounded)
    overflow = (rounded.abs() > s.max) | torch.isinf(x)
    limit = torch.full_like(x, s.max).copysign(x)
    if saturate or s.special == FINITE:  # FINITE formats have no other encoding for overflow
        replacement = limit
    elif s.special == IEEE:
        replacement = torch.full_like(x, math.inf).copysign(x)
    else:
        replacement = torch.full_like(x, math.nan)
    rounded = torch.where(overflow, replacement, rounded)
    return torch.where(torch.isnan(x), x, rounded), overflow


def _round_e8m0(x: torch.Tensor, saturate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float64 ``x`` to a power of two, ties (1.5 * 2**e) upwards, as torch and ml_dtypes.

    e8m0 is unsigned and has no zero: non-positive and NaN inputs become NaN; values below
    2**-127 become 2**-127; overflow (inf included) is NaN, or 2**127 with ``saturate``.
    """
    positive = x > 0
    fraction, exponent = torch.frexp(torch.where(positive & torch.isfinite(x), x, 1.0))
    exponent = exponent - 1 + (fraction >= 0.75).to(exponent.dtype)  # fraction*2 >= 1.5
    exponent = torch.where(torch.isinf(x), 128, exponent)  # saturates to 2**127 below
    overflow = (exponent > 127) | torch.isinf(x)
    exponent = exponent.clamp(min=-127, max=127)
    rounded = torch.ldexp(torch.ones_like(x), exponent)
    if not saturate:
        rounded = torch.where(overflow, math.nan, rounded)
    return torch.where(positive, rounded, math.nan), overflow & positive


def _check_blocks(x: torch.Tensor, s: FormatSpec) -> None:
    if x.ndim == 0 or x.shape[-1] % s.block_size:
        raise ValueError(
            f"{s.name} scales blocks of {s.block_size} values along the last dimension, but "
            f"the shape is {tuple(x.shape)}; pad or reshape the last dimension to a multiple "
            f"of {s.block_size}"
        )


def _blockwise_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], -1, block).abs().amax(dim=-1, keepdim=True)


def _apply_block_scale(x: torch.Tensor, scale: torch.Tensor, element: FormatSpec,
                       reciprocal: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale blocks down (``/ scale``, or ``* reciprocal`` where given), clamp and round
    elements, multiply back by ``scale``."""
    blocks = x.reshape(*scale.shape[:-1], -1)
    scaled = blocks / scale if reciprocal is None else blocks * reciprocal
    overflow = scaled.abs() > element.max
    clamped = scaled.clamp(-element.max, element.max)
    rounded, _ = _round_elements(clamped, element, saturate=True, subnormals=True)
    values = (rounded * scale).reshape(x.shape)
    return values, overflow.reshape(x.shape)


def _quantize_mx(x: torch.Tensor, s: FormatSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX v1.0, 6.3: scale = 2**(floor(log2(amax)) - emax_elem), elements clamped.

    As torchao ``to_mx`` (FLOOR): the exponent is read from the fp32 bit pattern of the block's
    amax, so an infinite amax has exponent 128 (the block's finite values flush to 0 and the
    infinity stays infinite after scaling back) and a NaN amax makes the whole block NaN (e8m0
    code 0xFF).
    """
    element = spec(s.element)
    emax_element = math.floor(math.log2(element.max))
    amax = _blockwise_amax(x, s.block_size)
    _, exponent = torch.frexp(torch.where(torch.isfinite(amax) & (amax > 0), amax, 1.0))
    exponent = torch.where(torch.isinf(amax), 129, exponent)  # exponent field all ones: 2**128
    shared = (exponent - 1 - emax_element).clamp(min=-127, max=128)  # e8m0 range (+1: NaN)
    scale = torch.ldexp(torch.ones_like(amax), shared)
    scale = torch.where(torch.isnan(amax), math.nan, scale)
    return _apply_block_scale(x, scale, element)


# Below this tensor amax the recipe's fp32 scales leave fp32's range (1 / tensor scale
# overflows, so a zero element becomes 0 * inf = NaN): such a tensor is quantized times 2**64,
# which the recipe maps to the same codes up to that power of two, and scaled back.
_NVFP4_TINY, _NVFP4_LIFT = 2.0**-100, 2.0**64


def _quantize_nvfp4(x: torch.Tensor, s: FormatSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 two-level scaling exactly as torchao ``nvfp4_quantize`` with a per-tensor scale.

    tensor scale = amax(x) / (448 * 6); block scale = amax(block) / 6 / tensor scale, clamped
    to [2**-6, 448] and rounded to e4m3; elements = x * ((1 / tensor scale) / block scale) in
    fp32 (torchao multiplies by this reciprocal to match its Triton kernel; dividing by the
    product rounds differently near ties), clamped to [-6, 6] and rounded to fp4 e2m1; values =
    elements * (tensor scale * block scale), as torchao's ``NVFP4Tensor.dequantize``. An
    all-zero tensor stays zero; one with amax below 2**-100 is quantized times 2**64.
    """
    element, scale_format = spec(s.element), spec(s.scale_format)
    tensor_amax = x.abs().amax()
    zero = tensor_amax == 0  # an all-zero tensor stays zero (no branch: works under vmap)
    lift = torch.where(tensor_amax < _NVFP4_TINY, _NVFP4_LIFT, 1.0)  # exact: a power of two
    x, tensor_amax = x * lift, tensor_amax * lift
    tensor_scale = torch.where(zero, 1.0, tensor_amax) / (scale_format.max * element.max)
    block_scale = _blockwise_amax(x, s.block_size) / element.max / tensor_scale
    block_scale = block_scale.clamp(scale_format.min_normal, scale_format.max)
    block_scale, _ = _round_elements(block_scale.double(), scale_format, True, True)
    block_scale = block_scale.to(x.dtype)
    reciprocal = (1.0 / tensor_scale) / block_scale
    values, overflow = _apply_block_scale(x, tensor_scale * block_scale, element, reciprocal)
    return torch.where(zero, 0.0, values / lift), overflow & ~zero


def _quantize_with_overflow(x: torch.Tensor, fmt: str | FormatSpec, saturate: bool,
                            subnormals: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = spec(fmt)
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if s.is_block:
        _check_blocks(x, s)
        x32 = x.float()
        if x.numel() == 0:  # no blocks to scale
            return x32.clone(), torch.zeros_like(x32, dtype=torch.bool)
        return _quantize_nvfp4(x32, s) if s.tensor_scale else _quantize_mx(x32, s)
    values, overflow = (_round_e8m0(x.double(), saturate) if s.name == "e8m0"
                        else _round_elements(x.double(), s, saturate, subnormals))
    return values.float(), overflow


@typechecked
def quantize(x: Float[Tensor, "*shape"], fmt: str | FormatSpec, *, saturate: bool = False,
             subnormals: bool = True) -> Float[Tensor, "*shape"]:
    """Round ``x`` to format ``fmt`` (nearest, ties to even) and return the values in fp32.

    Overflow gives inf (IEEE) or NaN (``fp8_e4m3``, ``e8m0``) unless ``saturate`` clamps it;
    fp6 and fp4 always saturate. ``subnormals=False`` flushes below the smallest normal to
    zero. Block formats scale blocks along the last dimension and always clamp.

    >>> quantize(torch.tensor([0.3, 2.5, 3.5, 100.0]), "fp4_e2m1")
    tensor([0.5000, 2.0000, 4.0000, 6.0000])
    >>> quantize(torch.tensor([70000.0]), "fp16"), quantize(torch.tensor([500.0]), "fp8_e4m3")
    (tensor([inf]), tensor([nan]))
    """
    return _quantize_with_overflow(x, fmt, saturate, subnormals)[0]


@typechecked
def decode(codes: Int[Tensor, "*shape"], fmt: str | FormatSpec) -> Float[Tensor, "*shape"]:
    """The values (fp32) of integer bit patterns ``codes`` of an element format of <= 16 bits.

    >>> decode(torch.tensor([0b0111, 0b1001]), "fp4_e2m1")
    tensor([ 6.0000, -0.5000])
    """
    s = spec(fmt)
    if s.is_block or s.bits > 16:
        raise ValueError(f"decode handles element formats of at most 16 bits, not {s.name!r}")
    codes = codes.long()
    if ((codes < 0) | (codes >= 2**s.bits)).any():
        raise ValueError(f"{s.name} codes are integers in [0, {2**s.bits}); got one outside")
    if s.name == "e8m0":
        return torch.where(codes == 255, math.nan, torch.exp2((codes - 127).double())).float()
    m_bits = s.mantissa_bits
    sign = torch.where((codes >> (s.bits - 1)) & 1 == 1, -1.0, 1.0)
    field = (codes >> m_bits) & (2**s.exponent_bits - 1)
    mantissa = (codes & (2**m_bits - 1)).double() / 2**m_bits
    normal = field > 0
    significand = torch.where(normal, 1.0 + mantissa, mantissa)
    exponent = torch.where(normal, field, 1) - s.bias
    value = sign * torch.ldexp(significand, exponent)
    top = field == 2**s.exponent_bits - 1
    if s.special == IEEE:
        value = torch.where(top & (mantissa == 0), sign * math.inf, value)
        value = torch.where(top & (mantissa != 0), math.nan, value)
    elif s.special == FN:
        value = torch.where(top & (mantissa == 1 - 2.0**-m_bits), math.nan, value)
    return value.float()


def values(fmt: str | FormatSpec) -> list[tuple[int, float]]:
    """Every code of a format of at most 8 bits and its value, in code order.

    >>> [v for _, v in values("fp4_e2m1")]
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    """
    s = spec(fmt)
    if s.is_block:
        raise ValueError(f"{s.name} is a block format of {s.element} elements sharing a "
                         f"{s.scale_format} scale; list its elements: --values {s.element}")
    if s.bits > 8:
        raise ValueError(f"{s.name} has {2**s.bits} codes; list a format of 8 bits or fewer "
                         "(fp8_e4m3, fp8_e5m2, fp6_e2m3, fp6_e3m2, fp4_e2m1, e8m0)")
    codes = torch.arange(2**s.bits)
    return list(zip(codes.tolist(), decode(codes, s).tolist(), strict=True))


class ErrorStats(NamedTuple):
    """How well a format represents a tensor."""

    rel_error: float  # ||q - x|| / ||x||
    max_rel_error: float  # max |q - x| / |x| over non-zero x
    underflow: float  # fraction of non-zero x that became 0
    overflow: float  # fraction of x beyond the largest value (saturated, inf or NaN)
    bits_per_element: float


@typechecked
def error_stats(x: Float[Tensor, "*shape"], fmt: str | FormatSpec, *, saturate: bool = False,
                subnormals: bool = True) -> ErrorStats:
    """Relative error, underflow and overflow fractions of quantizing ``x`` to ``fmt``.

    >>> g = torch.Generator().manual_seed(0)
    >>> stats = error_stats(torch.randn(1024, generator=g), "bf16")
    >>> stats.rel_error < 2**-8, stats.underflow, stats.overflow
    (True, 0.0, 0.0)
    """
    s = spec(fmt)
    q, overflow = _quantize_with_overflow(x, s, saturate, subnormals)
    x64, q64 = x.double(), q.double()
    nonzero = x64 != 0
    error = (q64 - x64).abs()
    rel = error[nonzero] / x64[nonzero].abs()
    distance, norm = torch.linalg.vector_norm(q64 - x64), torch.linalg.vector_norm(x64)
    count = max(x.numel(), 1)  # an empty tensor: no error, no underflow, no overflow
    return ErrorStats(
        rel_error=0.0 if distance == 0 else float(distance / norm),  # 0 / 0 only when exact
        max_rel_error=float(rel.max()) if rel.numel() else 0.0,
        underflow=int((nonzero & (q64 == 0)).sum()) / count,
        overflow=int(overflow.sum()) / count,
        bits_per_element=s.bits_per_element,
    )
