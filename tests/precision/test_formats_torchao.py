"""Block and sub-byte formats against torchao's reference implementations, bit for bit.

The references are torchao's own functions (``torchao/prototype/mx_formats``, 0.18):
``to_mx`` + ``to_dtype`` for MXFP8 and MXFP4 (OCP FLOOR scales), ``nvfp4_quantize`` with
``per_tensor_amax_to_scale`` and the dequantization of ``NVFP4Tensor.dequantize`` for NVFP4, and
``f32_to_f4_unpacked`` / ``f32_to_f6_*_unpacked`` for the element formats; ml_dtypes checks the
element formats a second time. Inputs: gaussians, gaussians scaled over many decades, blocks with
outliers, and blocks built so that elements land exactly on rounding ties, in fp32 and bf16.

One torchao quirk is left out on purpose: for a block whose amax is below 2**-118 (mxfp8) or
2**-124 (mxfp4), ``to_mx`` divides by 2**-126 but stores (and multiplies back by) 2**-127, the
scale the OCP spec gives; minitrain uses 2**-127 both ways, so the inputs here stay above that.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.references import require as reference

ml_dtypes = reference("ml_dtypes")
reference("torchao")
from torchao.prototype.mx_formats import kernels  # noqa: E402
from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale  # noqa: E402

from minitrain import precision  # noqa: E402

MX_ELEMENTS = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}


def bits(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return torch.where(torch.isnan(x), math.nan, x).view(torch.int32)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor):
    actual, expected, inputs = actual.flatten(), expected.flatten(), inputs.flatten()
    mismatch = bits(actual) != bits(expected)
    if mismatch.any():
        i = int(mismatch.nonzero()[0, 0])
        raise AssertionError(
            f"{int(mismatch.sum())} of {mismatch.numel()} differ; first: input "
            f"{inputs[i].item()!r} gave {actual[i].item()!r}, torchao {expected[i].item()!r}"
        )


def torchao_mx(x: torch.Tensor, name: str) -> torch.Tensor:
    element = MX_ELEMENTS[name]
    scale, data = to_mx(x.contiguous(), element, 32)
    return to_dtype(data, scale, element, 32, torch.float32)


def torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """``nvfp4_quantize`` with a per-tensor scale, dequantized as ``NVFP4Tensor.dequantize``."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    tensor_scale = per_tensor_amax_to_scale(x2.abs().amax())
    block_scale, packed = nvfp4_quantize(x2, 16, per_tensor_scale=tensor_scale)
    elements = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(packed))
    total = tensor_scale * block_scale.to(torch.float32)
    values = elements.reshape(x2.shape[0], -1, 16) * total.reshape(x2.shape[0], -1, 1)
    return values.reshape(x.shape)


def gaussian(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def inputs(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(32, 128) test inputs: random, scaled over decades, outliers, or exact ties."""
    x = gaussian(32, 128, seed=seed)
    if kind == "scaled":  # each row at its own decade, 1e-20 .. 1e20
        x = x * torch.logspace(-20, 20, 32).unsqueeze(1)
    elif kind == "outliers":  # a few values 1e3-1e4 x the rest, in some blocks
        g = torch.Generator().manual_seed(seed + 1)
        where = torch.rand(x.shape, generator=g) < 0.01
        x = torch.where(where, x * torch.logspace(3, 4, 128), x)
    elif kind == "ties":
        x = ties(seed)
    return x.to(dtype)


def ties(seed: int) -> torch.Tensor:
    """Blocks of 16 whose first element ``a`` sets the block scale and the others are fp4 and
    e4m3 rounding midpoints times ``a / 6``. Every ``a`` is the tensor's amax over a power of
    two, so NVFP4's e4m3 block scales are exact (448 / 2**k) and ``x / (tensor scale x block
    scale)`` hits the ties exactly, where torchao's reciprocal lands next to them."""
    g = torch.Generator().manual_seed(seed)
    fp4_mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    e4m3_mid = torch.tensor([1.0625, 1.1875, 1.3125, 1.4375, 1.5625, 1.6875, 1.8125, 1.9375])
    mids = torch.cat([fp4_mid, fp4_mid * 0.5, e4m3_mid])
    tensor_amax = float(torch.empty(()).uniform_(1, 8, generator=g).bfloat16())
    amax = tensor_amax * 2.0 ** -torch.randint(0, 6, (32, 8, 1), generator=g).float()
    amax[0, 0] = tensor_amax
    picks = torch.randint(0, len(mids), (32, 8, 15), generator=g)
    sign = torch.where(torch.rand(32, 8, 15, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([amax, sign * mids[picks] * (amax / 6.0)], dim=-1)
    return x.reshape(32, 128)


KINDS = ["random", "scaled", "outliers", "ties"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_matches_torchao(kind, dtype):
    x = inputs(kind, dtype)
    if kind == "scaled":  # one tensor scale per tensor: scale each row as its own tensor
        for row in x:
            assert_bitwise_equal(precision.quantize(row, "nvfp4"), torchao_nvfp4(row), row)
    else:
        assert_bitwise_equal(precision.quantize(x, "nvfp4"), torchao_nvfp4(x), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_mx_matches_torchao(name, kind, dtype):
    x = inputs(kind, dtype, seed=3)
    assert_bitwise_equal(precision.quantize(x, name), torchao_mx(x, name), x)


def test_nvfp4_tie_from_the_formats_section():
    # 4.5 sets the block scale 0.75; 1.3125 / 0.75 = 1.75 is a tie (1.5 | 2.0) for a division,
    # but 1.3125 * (1 / tensor scale) / block scale lands just under it: 1.5 * 0.75 = 1.125.
    x = torch.tensor([[4.5, 1.3125] + [0.0] * 14])
    expected = torchao_nvfp4(x)
    assert expected[0, :2].tolist() == [4.5, 1.125]
    assert_bitwise_equal(precision.quantize(x, "nvfp4"), expected, x)
    assert_bitwise_equal(precision.quantize(x.bfloat16(), "nvfp4"), expected, x)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_mx_blocks_holding_nan_or_inf_match_torchao(name, special):
    x = gaussian(2, 64, seed=5) * 100.0
    x[0, 3] = special
    x[1, 40] = special
    for dtype in DTYPES:
        xd = x.to(dtype)
        assert_bitwise_equal(precision.quantize(xd, name), torchao_mx(xd, name), xd)


def test_mx_issue_examples():
    nan_block = torch.tensor([[math.nan, 100.0] + [0.0] * 30])
    inf_block = torch.tensor([[math.inf, 100.0] + [0.0] * 30])
    assert torchao_mx(nan_block, "mxfp8")[0, :2].isnan().all()
    assert precision.quantize(nan_block, "mxfp8")[0, :2].isnan().all()
    assert torchao_mx(inf_block, "mxfp8")[0, :2].tolist() == [math.inf, 0.0]
    assert precision.quantize(inf_block, "mxfp8")[0, :2].tolist() == [math.inf, 0.0]


ELEMENTS = {
    "fp4_e2m1": (kernels.f32_to_f4_unpacked, kernels.f4_unpacked_to_f32, ml_dtypes.float4_e2m1fn),
    "fp6_e2m3": (
        kernels.f32_to_f6_e2m3_unpacked,
        kernels.f6_e2m3_unpacked_to_f32,
        ml_dtypes.float6_e2m3fn,
    ),
    "fp6_e3m2": (
        kernels.f32_to_f6_e3m2_unpacked,
        kernels.f6_e3m2_unpacked_to_f32,
        ml_dtypes.float6_e3m2fn,
    ),
}
assert {DTYPE_FP6_E2M3, DTYPE_FP6_E3M2}  # the names torchao gives the fp6 formats


@pytest.mark.parametrize("name", list(ELEMENTS))
def test_sub_byte_elements_match_torchao_and_ml_dtypes(name):
    encode, decode, ml_dtype = ELEMENTS[name]
    grid = torch.tensor(sorted({v for _, v in precision.values(name)}))
    midpoints = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, midpoints, midpoints.nextafter(grid[1:]), gaussian(4096, seed=7) * 8])
    x = torch.cat([x, -x, torch.tensor([1e30, -1e30])])
    ours = precision.quantize(x, name)
    assert_bitwise_equal(ours, decode(encode(x)), x)
    clamped = x.clamp(-precision.spec(name).max, precision.spec(name).max)  # ml_dtypes has no sat.
    via_ml = torch.from_numpy(clamped.numpy().astype(ml_dtype).astype(np.float32))
    assert_bitwise_equal(ours, via_ml, x)
