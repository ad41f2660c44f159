"""Low-precision matmuls in training, simulated exactly: fp8 (per-tensor scales) and MX / NVFP4.

Each GEMM (the forward one and both backward ones) quantizes its operands bit-exactly as
:func:`minitrain.precision.quantize` does, then multiplies in fp32, as an fp8 tensor core does
(products of fp8 values are exact in fp32). Params, grads and the update stay fp32.

fp8 is Transformer Engine's recipe (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"): e4m3 forward, e5m2 for the output gradient, each tensor scaled by ``fp8_max / amax``
(rounded as torchao's ``amax_to_scale``). The amax comes from the last
``history_len`` steps (TE's ``DelayedScaling``) or, without a history, from the tensor itself
(``Float8CurrentScaling``). The history is pure state, ``(3, history_len)`` per matmul, whose
*gradient* is the updated history (flax's ``fp8_ops`` trick), so it works under
``torch.func.grad`` and ``vmap``. Block formats (``mxfp8``,
``mxfp4``, ``nvfp4``) scale blocks along each GEMM's reduction dimension, zero-padded to whole
blocks, as torchao's MX training does.

>>> import torch
>>> a, b = torch.randn(4, 32), torch.randn(32, 8)
>>> expected = quantize_operand(a, "fp8_e4m3") @ quantize_operand(b, "fp8_e4m3")
>>> torch.equal(matmul(a, b, "fp8"), expected)
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from minitrain import _torch
from minitrain.precision.formats import spec
from minitrain.precision.rounding import quantize

__all__ = ["AMAX_FLOOR", "RECIPES", "Recipe", "amax_to_scale", "delayed_scale", "linear",
           "matmul", "quantize_operand", "recipe", "scaled_mm_operands"]

PER_TENSOR = ("fp8_e4m3", "fp8_e5m2")
BLOCK = ("mxfp8", "mxfp4", "nvfp4")
_TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class Recipe(NamedTuple):
    """Formats of the forward operands and of the output gradient, and the scaling options."""

    forward: str = "fp8_e4m3"  # activations and weights
    backward: str = "fp8_e5m2"  # gradient of the matmul's output
    history_len: int = 16  # delayed scaling: steps of amax history (TE default 1024)
    gemm: str = "simulated"  # or "scaled_mm": real fp8 GEMMs through torch._scaled_mm


RECIPES = {
    "fp8": Recipe("fp8_e4m3", "fp8_e5m2"),  # Transformer Engine's HYBRID format
    "mxfp8": Recipe("mxfp8", "mxfp8"),  # OCP MX: e4m3 elements everywhere (torchao default)
    "mxfp4": Recipe("mxfp4", "mxfp4"),
    "nvfp4": Recipe("nvfp4", "nvfp4"),
    "fp8-scaled-mm": Recipe("fp8_e4m3", "fp8_e5m2", gemm="scaled_mm"),  # fp8 tensor cores
}


def recipe(name: str | Recipe) -> Recipe:
    """A recipe by name (``fp8``, ``mxfp8``, ``mxfp4``, ``nvfp4``), checked.

    >>> recipe("fp8").backward
    'fp8_e5m2'
    """
    if isinstance(name, Recipe):
        r = name
    elif name in RECIPES:
        r = RECIPES[name]
    else:
        raise ValueError(f"unknown matmul format {name!r}; choose one of: {', '.join(RECIPES)}")
    for fmt in (r.forward, r.backward):
        if fmt not in PER_TENSOR + BLOCK:
            raise ValueError(
                f"matmul operands take one of {', '.join(PER_TENSOR + BLOCK)}, not {fmt!r}"
            )
    if r.gemm not in ("simulated", "scaled_mm") or (r.gemm == "scaled_mm" and r.forward in BLOCK):
        raise ValueError(f"gemm is 'simulated' or 'scaled_mm' (fp8 only), got {r.gemm!r}")
    if r.history_len < 1:
        raise ValueError(f"history_len must be at least 1, got {r.history_len}")
    return r


def _fp8_codes(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` saturated and cast to torch's fp8 dtype (round to nearest even); as fp32, equal
    to ``quantize(x, fmt, saturate=True)`` bit for bit."""
    top = spec(fmt).max
    return x.clamp(-top, top).to(_TORCH_FP8[fmt])


# torchao's ``float8_utils.EPS``: ``amax_to_scale`` clamps the amax (in float64) to it, so an
# all-zero or all-tiny tensor scales to zeros, not NaN (0 * inf).
AMAX_FLOOR = 1e-12


def amax_to_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``fp8_max / max(amax, 1e-12)`` divided in float64, rounded
    once to fp32 (the correctly rounded quotient). An inf amax gives 0 and a NaN one NaN, so a
    tensor holding them quantizes to NaN, as torchao's does.

    >>> amax_to_scale(torch.tensor([3.0, 0.0]), "fp8_e4m3")
    tensor([1.4933e+02, 4.4800e+14])
    """
    return (spec(fmt).max / amax.double().clamp(min=AMAX_FLOOR)).float()


def _amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|``, 0 for an empty tensor."""
    return x.abs().amax() if x.numel() else x.new_zeros(())


def delayed_scale(history: torch.Tensor, fmt: str) -> torch.Tensor:
    """TE's scale from an amax history: :func:`amax_to_scale` of its largest finite entry, or 1
    while it holds no positive finite amax (a fresh history). An inf or NaN recorded by an
    overflowing step is skipped: TE's ``_default_sf_compute`` would keep its previous scale,
    which a history alone does not hold.

    >>> delayed_scale(torch.tensor([2.0, 4.0, 0.0]), "fp8_e4m3")
    tensor(112.)
    >>> delayed_scale(torch.tensor([float("nan"), 2.0, 4.0]), "fp8_e4m3")
    tensor(112.)
    """
    finite = torch.where(torch.isfinite(history), history, 0.0)
    amax = finite.amax(dim=-1)
    return torch.where(amax > 0, amax_to_scale(amax, fmt), 1.0)


def _along_last(x: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """Block-quantize ``x`` along ``dim``, zero-padding that dimension to whole blocks."""
    block = spec(fmt).block_size
    moved = x.movedim(dim, -1)
    length = moved.shape[-1]
    pad = -length % block
    if pad:
        moved = F.pad(moved, (0, pad))
    return quantize(moved, fmt)[..., :length].movedim(-1, dim)


def quantize_operand(
    x: torch.Tensor, fmt: str, dim: int = -1, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 values a low-precision GEMM sees for operand ``x``: per-tensor formats
    ``quantize(x * scale, fmt, saturate=True) / scale`` (``scale`` default torchao's
    :func:`amax_to_scale` of ``amax(x)``), block formats in blocks along ``dim``, the GEMM's
    reduction dimension.

    >>> quantize_operand(torch.tensor([1.0, 3.0, 448.0]), "fp8_e4m3", scale=torch.tensor(1.0))
    tensor([  1.,   3., 448.])
    """
    x = x.float()
    if fmt in BLOCK:
        return _along_last(x, fmt, dim)
    if scale is None:
        scale = amax_to_scale(_amax(x), fmt)
    return _decode(_fp8_codes(x * scale, fmt)) / scale


def _decode(codes: torch.Tensor) -> torch.Tensor:
    """``codes.float()`` for fp8 ``codes``, bit for bit, as a lookup in the format's 256-entry
    table (torch's fp8 cast is a scalar loop on the CPU, about 1.5x slower).

    >>> _decode(torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn))
    tensor([  1.,  -2., 448.])
    """
    table = torch.arange(256, dtype=torch.uint8, device=codes.device).view(codes.dtype).float()
    index = codes.view(torch.uint8).reshape(-1).int()
    return table.index_select(0, index).view(codes.shape)


def scaled_mm_operands(
    a: torch.Tensor, b: torch.Tensor, formats: tuple[str, str], scales: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The arguments of ``torch._scaled_mm`` for ``a (M, K) @ b (K, N)``: ``a`` in fp8 row-major,
    ``b`` in fp8 column-major (cuBLASLt's layout), and the dequantization scales ``1 / scale``.
    The fp8 codes are those :func:`quantize_operand` rounds to.

    >>> a8, b8, ia, ib = scaled_mm_operands(torch.ones(16, 32), torch.ones(32, 16),
    ...     ("fp8_e4m3", "fp8_e4m3"), (torch.tensor(2.0), torch.tensor(4.0)))
    >>> a8.dtype, b8.stride(), ia.item(), ib.item()
    (torch.float8_e4m3fn, (1, 32), 0.5, 0.25)
    """
    (fa, fb), (sa, sb) = formats, scales
    a8, b8 = _fp8_codes(a.float() * sa, fa), _fp8_codes(b.float() * sb, fb)
    return a8.contiguous(), b8.mT.contiguous().mT, sa.reciprocal(), sb.reciprocal()


def _gemm(a, b, formats, scales, r: Recipe, qa, qb) -> torch.Tensor:
    """``qa @ qb`` in fp32, or the same product on fp8 tensor cores for ``gemm="scaled_mm"``
    (2-D operands whose dimensions are multiples of 16, as cuBLASLt needs; others simulate)."""
    dims = (*a.shape, b.shape[-1])
    if r.gemm == "scaled_mm" and a.ndim == 2 and b.ndim == 2 and all(d % 16 == 0 for d in dims):
        a8, b8, ia, ib = scaled_mm_operands(a, b, formats, scales)
        return _torch.scaled_mm(a8, b8, scale_a=ia, scale_b=ib, out_dtype=torch.float32)
    return qa @ qb


# > 0 while this module's GEMMs run: a simulation lets them through (each operand is quantized
# once, also in a backward pass run inside one).
_BYPASS = [0]


@contextlib.contextmanager
def _bypass() -> Iterator[None]:
    _BYPASS[0] += 1
    try:
        yield
    finally:
        _BYPASS[0] -= 1


def bypassing() -> bool:
    """Whether one of this module's own GEMMs is running."""
    return _BYPASS[0] > 0


def _scale(x: torch.Tensor, fmt: str, history: torch.Tensor | None) -> torch.Tensor:
    """Operand ``x``'s scale: from its amax ``history`` (delayed scaling), else from its own
    amax (current scaling); 1 in a block format, whose scales are per block."""
    if fmt in BLOCK:
        return x.new_ones(())
    return amax_to_scale(_amax(x), fmt) if history is None else delayed_scale(history, fmt)


def _record(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Newest amax first, oldest dropped (TE rolls its ``amax_history`` the same way)."""
    return torch.cat([amax.reshape(1), history[:-1]])


class _LowPrecisionMatmul(torch.autograd.Function):
    """``a @ b`` for ``a (..., M, K)``, ``b (..., K, N)`` (same batch dims, or ``b`` 2-D with
    ``a`` 2-D), with the forward and both backward GEMMs on quantized operands."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, history, r: Recipe):
        a32, b32, fmt = a.float(), b.float(), r.forward
        rows = (None, None) if history is None else (history[0], history[1])
        with _bypass(), torch.autocast(a.device.type, enabled=False):
            sa, sb = _scale(a32, fmt, rows[0]), _scale(b32, fmt, rows[1])
            # block formats scale blocks along the reduction dimension: a's rows, b's columns
            qa, qb = quantize_operand(a32, fmt, -1, sa), quantize_operand(b32, fmt, -2, sb)
            y = _gemm(a32, b32, (fmt, fmt), (sa, sb), r, qa, qb)
            if history is not None:
                history = torch.stack([_record(history[0], _amax(a32)),
                                       _record(history[1], _amax(b32)), history[2]])
        return y.to(torch.promote_types(a.dtype, b.dtype)), qa, qb, history, torch.stack([sa, sb])

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, history, r = inputs
        _, qa, qb, new_history, scales = output
        ctx.recipe = r
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.save_for_backward(a, b, qa, qb, new_history, scales)
        ctx.mark_non_differentiable(qa, qb, scales)

    @staticmethod
    def backward(ctx, grad_y, _qa, _qb, _history, _scales):
        a, b, qa, qb, history, scales = ctx.saved_tensors
        r, g, (sa, sb) = ctx.recipe, grad_y.float(), scales
        fmts = (r.backward, r.forward)
        with _bypass(), torch.autocast(g.device.type, enabled=False):
            sg = _scale(g, r.backward, None if history is None else history[2])
            qg = quantize_operand(g, r.backward, -1, sg)
            qg_columns = quantize_operand(g, r.backward, -2, sg) if r.backward in BLOCK else qg
            if r.forward in BLOCK:  # blocks along each backward GEMM's reduction dimension
                qa, qb = quantize_operand(a, r.forward, -2), quantize_operand(b, r.forward, -1)
            ga = _gemm(g, b.float().mT, fmts, (sg, sb), r, qg, qb.mT)
            gb = _gemm(a.float().mT, g, fmts[::-1], (sa, sg), r, qa.mT, qg_columns)
            if history is not None:  # the "gradient" of the state is the updated state
                history = torch.stack([history[0], history[1], _record(history[2], _amax(g))])
        return ga.to(ctx.dtypes[0]), gb.to(ctx.dtypes[1]), history, None


def matmul(a: torch.Tensor, b: torch.Tensor, r: Recipe | str,
           history: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.matmul(a, b)`` with quantized operands and fp32 accumulation; ``history``: this
    matmul's amax history ``(3, history_len)``, whose gradient is the updated history.

    >>> a, b = torch.randn(2, 3, 32), torch.randn(32, 4)
    >>> matmul(a, b, "mxfp8").shape
    torch.Size([2, 3, 4])
    """
    return recording_matmul(a, b, r, history)[0]


# Under torch.compile the simulated matmul runs eager (a graph break around each one): dynamo
# cannot trace this autograd.Function ("Expected FakeTensor", torch 2.13); the rest compiles.
@_torch.disable_dynamo
def recording_matmul(a: torch.Tensor, b: torch.Tensor, r: Recipe | str,
            history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`matmul`, and the history with this forward pass's operand amaxes recorded (rows 0
    and 1), None without a history."""
    r = recipe(r)
    squeeze = []
    if a.ndim == 1:
        a, squeeze = a.unsqueeze(0), [*squeeze, -2]
    if b.ndim == 1:
        b, squeeze = b.unsqueeze(-1), [*squeeze, -1]
    with _bypass():
        if b.ndim == 2:  # fold a's batch dims into M: one GEMM, as F.linear runs it
            lead = a.shape[:-1]
            y, _, _, recorded, _ = _LowPrecisionMatmul.apply(
                a.reshape(-1, a.shape[-1]), b, history, r)
            y = y.reshape(*lead, b.shape[-1])
        else:
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            a = a.expand(*batch, *a.shape[-2:])
            b = b.expand(*batch, *b.shape[-2:])
            y, _, _, recorded, _ = _LowPrecisionMatmul.apply(a, b, history, r)
    for dim in squeeze:
        y = y.squeeze(dim)
    return y, None if history is None else recorded.detach()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           r: Recipe | str, history: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with quantized operands; the bias is added in fp32."""
    y = matmul(x, weight.mT, r, history)
    return y if bias is None else y + bias
