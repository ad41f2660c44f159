"""Number formats against torch's native casts and ml_dtypes, bit for bit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain import precision
from tests.references import require as reference

ml_dtypes = reference("ml_dtypes")

TORCH_FORMATS = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
ML_DTYPES_FORMATS = {
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn,
    "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn,
}


def bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns, with every NaN mapped to one pattern."""
    x = x.float()
    return torch.where(torch.isnan(x), math.nan, x).view(torch.int32)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor):
    mismatch = bits(actual) != bits(expected)
    if mismatch.any():
        i = int(mismatch.nonzero()[0, 0])
        raise AssertionError(
            f"{int(mismatch.sum())} mismatches; first: input {inputs[i].item()!r} gave "
            f"{actual[i].item()!r}, expected {expected[i].item()!r}"
        )


def via_ml_dtypes(x: torch.Tensor, dtype) -> torch.Tensor:
    return torch.from_numpy(x.numpy().astype(dtype).astype(np.float32))


def all_codes(bit_count: int) -> torch.Tensor:
    return torch.arange(2**bit_count)


def codes_and_midpoints(name: str) -> torch.Tensor:
    """Every finite value of a format, the midpoints between neighbours, and the fp32 numbers
    on either side of each midpoint: every rounding decision the format can make."""
    s = precision.spec(name)
    grid = precision.decode(all_codes(s.bits), s)
    grid = torch.unique(grid[torch.isfinite(grid)]).double()  # sorted; -0 and 0 merge
    mid = ((grid[1:] + grid[:-1]) / 2).float()  # exact: neighbours differ by a power of two
    assert torch.equal(mid.double(), (grid[1:] + grid[:-1]) / 2)
    return torch.cat(
        [
            grid.float(),
            mid,
            torch.nextafter(mid, torch.full_like(mid, math.inf)),
            torch.nextafter(mid, torch.full_like(mid, -math.inf)),
            torch.tensor([0.0, -0.0]),
        ]
    )


# ---------------------------------------------------------------------------------------------
# Specs


@pytest.mark.parametrize("name", list(TORCH_FORMATS))
def test_spec_matches_torch_finfo(name):
    s, info = precision.spec(name), torch.finfo(TORCH_FORMATS[name])
    assert s.bits == info.bits
    assert s.max == info.max
    assert s.min_normal == info.smallest_normal
    assert s.epsilon == info.eps
    assert s.torch_dtype == str(TORCH_FORMATS[name]).removeprefix("torch.")


@pytest.mark.parametrize("name", [*ML_DTYPES_FORMATS, "e8m0"])
def test_spec_matches_ml_dtypes_finfo(name):
    dtype = ML_DTYPES_FORMATS.get(name, ml_dtypes.float8_e8m0fnu)
    s, info = precision.spec(name), ml_dtypes.finfo(dtype)
    assert s.max == float(info.max)
    assert s.min_normal == float(info.smallest_normal)
    assert s.min_subnormal == float(info.smallest_subnormal)
    assert s.epsilon == float(info.eps)
    assert s.mantissa_bits == info.nmant
    assert s.exponent_bits == info.nexp


def test_spec_of_tf32_and_block_formats():
    tf32 = precision.spec("tf32")
    assert (tf32.bits, tf32.max, tf32.epsilon) == (19, (2 - 2**-10) * 2.0**127, 2**-10)
    assert precision.spec("nvfp4").bits_per_element == 4 + 8 / 16
    assert precision.spec("mxfp4").bits_per_element == 4 + 8 / 32
    assert precision.spec("mxfp8").bits_per_element == 8 + 8 / 32
    assert precision.spec("nvfp4").block_size == 16 and precision.spec("mxfp8").block_size == 32


def test_unknown_format_is_a_value_error():
    with pytest.raises(ValueError, match="unknown number format 'fp7'"):
        precision.spec("fp7")


# ---------------------------------------------------------------------------------------------
# Decoding codes


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_decode_every_code_matches_torch(name):
    s = precision.spec(name)
    codes = all_codes(s.bits)
    int_dtype = torch.int16 if s.bits == 16 else torch.uint8
    native = codes.to(torch.int32).to(int_dtype).view(TORCH_FORMATS[name]).float()
    assert_bitwise_equal(precision.decode(codes, name), native, codes)


@pytest.mark.parametrize("name", ["fp6_e2m3", "fp6_e3m2", "fp4_e2m1"])
def test_decode_every_code_matches_ml_dtypes(name):
    s = precision.spec(name)
    codes = all_codes(s.bits)
    expected = codes.numpy().astype(np.uint8).view(ML_DTYPES_FORMATS[name]).astype(np.float32)
    assert_bitwise_equal(precision.decode(codes, name), torch.from_numpy(expected), codes)


def test_decode_e8m0_matches_torch():
    codes = all_codes(8)
    native = codes.to(torch.uint8).view(torch.float8_e8m0fnu).float()
    assert_bitwise_equal(precision.decode(codes, "e8m0"), native, codes)


def test_fp4_values_are_the_chapters_sixteen():
    listed = [v for _, v in precision.values("fp4_e2m1")]
    assert len(listed) == 16
    chapter = [-6, -4, -3, -2, -1.5, -1.0, -0.5, 0, 0.5, 1.0, 1.5, 2, 3, 4, 6]
    assert sorted(set(listed)) == chapter


# ---------------------------------------------------------------------------------------------
# Rounding, exhaustively against torch's casts


def test_fp16_every_code_midpoint_and_neighbour_matches_torch():
    x = codes_and_midpoints("fp16")
    assert_bitwise_equal(precision.quantize(x, "fp16"), x.to(torch.float16).float(), x)


def test_fp16_over_every_bf16_code_matches_torch():
    # bf16 codes span fp32's whole exponent range: overflow to inf and underflow to 0.
    x = all_codes(16).to(torch.int16).view(torch.bfloat16).float()
    x = x[~torch.isnan(x)]
    assert_bitwise_equal(precision.quantize(x, "fp16"), x.to(torch.float16).float(), x)


def test_bf16_every_code_with_every_rounding_case_matches_torch():
    # Upper 16 bits: every bf16 code. Lower 16 bits: exact, just above, below, at and past
    # the tie, and the largest: every rounding decision of fp32 -> bf16.
    upper = all_codes(16).to(torch.int64) << 16
    lower = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    patterns = (upper[:, None] | lower[None, :]).flatten()
    x = patterns.to(torch.int64).bitwise_and(0xFFFFFFFF)
    x = torch.where(x >= 2**31, x - 2**32, x).to(torch.int32).view(torch.float32)
    x = x[~torch.isnan(x)]
    assert_bitwise_equal(precision.quantize(x, "bf16"), x.to(torch.bfloat16).float(), x)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_every_code_and_midpoint_matches_torch(name):
    x = codes_and_midpoints(name)
    x = x[x.abs() <= precision.spec(name).max]
    assert_bitwise_equal(precision.quantize(x, name), x.to(TORCH_FORMATS[name]).float(), x)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_fp8_in_range_fp32_matches_torch(name, data):
    limit = precision.spec(name).max
    values = st.floats(-limit, limit, width=32, allow_nan=False, allow_subnormal=True)
    x = torch.tensor(data.draw(st.lists(values, min_size=1, max_size=64)), dtype=torch.float32)
    assert_bitwise_equal(precision.quantize(x, name), x.to(TORCH_FORMATS[name]).float(), x)


@settings(deadline=None, max_examples=60)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_fp16_and_bf16_on_any_fp32_match_torch(values):
    x = torch.tensor(values, dtype=torch.float32)
    for name in ("fp16", "bf16", "fp32"):
        expected = x.to(TORCH_FORMATS[name]).float()
        assert_bitwise_equal(precision.quantize(x, name), expected, x)


# ---------------------------------------------------------------------------------------------
# Rounding against ml_dtypes (sub-byte formats and fp8 overflow)


@pytest.mark.parametrize("name", list(ML_DTYPES_FORMATS))
def test_every_code_and_midpoint_matches_ml_dtypes(name):
    x = codes_and_midpoints(name)
    expected = via_ml_dtypes(x, ML_DTYPES_FORMATS[name])
    assert_bitwise_equal(precision.quantize(x, name), expected, x)


@pytest.mark.parametrize("name", list(ML_DTYPES_FORMATS))
@settings(deadline=None, max_examples=40)
@given(values=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_any_fp32_matches_ml_dtypes(name, values):
    # Out of range: inf for e5m2, NaN for e4m3fn, saturation for the fp6 and fp4 formats.
    x = torch.tensor(values, dtype=torch.float32)
    expected = via_ml_dtypes(x, ML_DTYPES_FORMATS[name])
    assert_bitwise_equal(precision.quantize(x, name), expected, x)


def test_e8m0_rounds_like_torch_and_ml_dtypes():
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(4096).uniform_(-126, 126, generator=g))
    x = torch.cat([x, torch.tensor([1.0, 1.5, 3.0, 2.9, 0.75, 2.0**-130])])
    ours = precision.quantize(x, "e8m0")
    assert_bitwise_equal(ours, x.to(torch.float8_e8m0fnu).float(), x)
    in_range = x >= 2.0**-127
    assert_bitwise_equal(ours[in_range], via_ml_dtypes(x[in_range], ml_dtypes.float8_e8m0fnu), x)


# ---------------------------------------------------------------------------------------------
# Options and the chapter's examples


def test_chapter_underflow_example():
    x = torch.tensor([1e-8])
    assert precision.quantize(x, "fp16").item() == 0.0
    assert precision.quantize(x, "bf16").item() != 0.0
    assert precision.error_stats(x, "fp16").underflow == 1.0
    assert precision.error_stats(x, "bf16").underflow == 0.0


def test_saturate_and_flush_subnormals():
    big = torch.tensor([1e6, -1e6, math.inf])
    assert precision.quantize(big, "fp16").tolist() == [math.inf, -math.inf, math.inf]
    assert precision.quantize(big, "fp16", saturate=True).tolist() == [65504.0, -65504.0, 65504.0]
    assert precision.quantize(big, "fp8_e4m3", saturate=True).tolist() == [448.0, -448.0, 448.0]
    assert torch.isnan(precision.quantize(big, "fp8_e4m3")).all()
    tiny = torch.tensor([1e-6, -1e-6])  # fp16 subnormals (smallest normal is 6.1e-5)
    assert (precision.quantize(tiny, "fp16") != 0).all()
    flushed = precision.quantize(tiny, "fp16", subnormals=False)
    assert flushed.tolist() == [0.0, 0.0] and torch.signbit(flushed).tolist() == [False, True]


def test_nan_passes_through():
    x = torch.tensor([math.nan, 1.0])
    for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8"):
        assert torch.isnan(precision.quantize(x.repeat(16), name)[0])


# ---------------------------------------------------------------------------------------------
# Block formats


def nvfp4_reference(x: torch.Tensor) -> torch.Tensor:
    """torchao's nvfp4_quantize (two-level scaling), written with torch's and ml_dtypes' casts:
    elements are multiplied by the reciprocal of the combined scale, as torchao does."""
    blocks = x.reshape(-1, 16)
    tensor_scale = x.abs().amax() / (448.0 * 6.0)
    block_scale = blocks.abs().amax(dim=-1, keepdim=True) / 6.0 / tensor_scale
    block_scale = block_scale.clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn).float()
    total = tensor_scale * block_scale
    scaled = (blocks * ((1.0 / tensor_scale) / block_scale)).clamp(-6.0, 6.0)
    return (via_ml_dtypes(scaled, ml_dtypes.float4_e2m1fn) * total).reshape(x.shape)


def mx_reference(x: torch.Tensor, element_dtype, element_emax: int) -> torch.Tensor:
    """OCP MX v1.0 section 6.3, with ml_dtypes' casts for the elements."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.floor(torch.log2(amax)) - element_emax
    scale = torch.exp2(exponent.clamp(-127, 127))
    scaled = blocks / scale
    element_max = float(ml_dtypes.finfo(element_dtype).max)
    rounded = via_ml_dtypes(scaled.clamp(-element_max, element_max), element_dtype)
    return (rounded * scale).reshape(x.shape)


def gaussian(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_nvfp4_matches_reference_recipe(scale):
    x = gaussian(8, 64, scale=scale)
    assert_bitwise_equal(precision.quantize(x, "nvfp4"), nvfp4_reference(x), x.flatten())


@pytest.mark.parametrize(
    ("name", "dtype", "emax"),
    [("mxfp4", ml_dtypes.float4_e2m1fn, 2), ("mxfp8", ml_dtypes.float8_e4m3fn, 8)],
)
def test_mx_matches_reference_recipe(name, dtype, emax):
    x = gaussian(4, 128) * torch.logspace(-3, 3, 128)
    assert_bitwise_equal(precision.quantize(x, name), mx_reference(x, dtype, emax), x.flatten())


def test_nvfp4_exact_tie_rounds_as_torchao():
    # 1.3125 * (1 / tensor scale) / block scale lands one ulp under the tie that division hits.
    x = torch.tensor([4.5, 1.3125] + [0.0] * 14)
    assert precision.quantize(x, "nvfp4")[:2].tolist() == [4.5, 1.125]
    assert_bitwise_equal(precision.quantize(x, "nvfp4"), nvfp4_reference(x), x)


@pytest.mark.parametrize(
    ("special", "mxfp8", "mxfp4"),
    [
        (math.nan, [math.nan, math.nan], [math.nan, math.nan]),
        (math.inf, [math.inf, 0.0], [math.inf, 0.0]),
    ],
)
def test_mx_block_with_nan_or_inf_takes_torchaos_scale(special, mxfp8, mxfp4):
    x = torch.tensor([special, 100.0] + [1.0] * 30)
    for name, expected in (("mxfp8", mxfp8), ("mxfp4", mxfp4)):
        q = precision.quantize(x, name)
        assert_bitwise_equal(q[:2], torch.tensor(expected), x[:2])
        other = precision.quantize(torch.cat([x, torch.full((32,), 3.0)]), name)[32:]
        assert torch.equal(other, torch.full((32,), 3.0))  # the next block is untouched


def test_e8m0_saturates_inf_to_largest_power_of_two():
    x = torch.tensor([math.inf, 2.0**128, 3.0])
    assert precision.quantize(x, "e8m0", saturate=True).tolist() == [2.0**127, 2.0**127, 4.0]
    assert precision.quantize(x, "e8m0").isnan()[:2].all()
    decoded = precision.decode(torch.tensor([0, 127, 254, 255]), "e8m0")
    assert decoded.dtype == torch.float32
    assert_bitwise_equal(decoded, torch.tensor([2.0**-127, 1.0, 2.0**127, math.nan]), decoded)


def test_mx_blocks_are_fp4_values_times_a_power_of_two():
    x = gaussian(2, 64, seed=1) * 10.0
    q = precision.quantize(x, "mxfp4").reshape(-1, 32)
    grid = torch.tensor(sorted({abs(v) for _, v in precision.values("fp4_e2m1")}))
    amax = x.reshape(-1, 32).abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)  # emax of e2m1 is 2
    elements = (q / scale).abs()
    assert torch.isin(elements, grid).all()
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))


def test_nvfp4_beats_mxfp4_on_gaussians():
    # NVFP4's finer (e4m3, block 16) scales lower the error of fp4 elements (NVIDIA, 2025).
    x = gaussian(64, 256, seed=2)
    nv, mx = precision.error_stats(x, "nvfp4"), precision.error_stats(x, "mxfp4")
    assert nv.rel_error < mx.rel_error < 0.2
    # A block's largest elements can land past 6 and are clipped: MX floors the scale's
    # exponent, NVFP4 rounds its e4m3 scale down.
    assert 0 < nv.overflow < 1 / 16 and 0 < mx.overflow < 1 / 16
    assert nv.bits_per_element == 4.5


def test_block_formats_keep_range_where_plain_fp4_cannot():
    x = gaussian(4, 64, seed=3, scale=1e-3)
    plain, block = precision.error_stats(x, "fp4_e2m1"), precision.error_stats(x, "nvfp4")
    assert plain.underflow > 0.9 and block.underflow < 0.1


def test_block_shape_error_names_the_fix():
    with pytest.raises(ValueError, match="multiple of 16"):
        precision.quantize(torch.ones(3, 10), "nvfp4")


def test_zero_tensor_quantizes_to_zero():
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        assert torch.equal(precision.quantize(torch.zeros(2, 32), name), torch.zeros(2, 32))


def test_error_stats_overflow_fraction():
    x = torch.tensor([1.0, 2.0, 1e5, -1e5])
    stats = precision.error_stats(x, "fp16", saturate=True)
    assert stats.overflow == 0.5
    assert stats.max_rel_error == pytest.approx((1e5 - 65504) / 1e5)


# ---------------------------------------------------------------------------------------------
# The command


def test_formats_command_json_lists_every_format():
    from click.testing import CliRunner

    from minitrain.cli.formats import formats as formats_command

    result = CliRunner().invoke(formats_command, ["--json", "--stats"])
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in json.loads(result.stdout)}
    assert list(records) == list(precision.FORMATS)
    assert records["fp8_e4m3"]["max"] == 448.0 and records["nvfp4"]["bits_per_element"] == 4.5
    # On N(0, 1): bf16 keeps ~3 significant digits, fp4 loses a fifth of the values to zero.
    assert records["bf16"]["stats"]["rel_error"] < 2**-8
    assert records["fp4_e2m1"]["stats"]["underflow"] > 0.1


def test_formats_command_values_and_mistakes():
    from click.testing import CliRunner

    from minitrain.cli.formats import formats as formats_command

    result = CliRunner().invoke(formats_command, ["--values", "fp4_e2m1", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["value"] for r in json.loads(result.stdout)][:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    table = CliRunner().invoke(formats_command, ["--values", "fp4_e2m1"])
    assert "0111" in table.stdout and "-6" in table.stdout
    wrong = CliRunner().invoke(formats_command, ["--values", "fp7"])
    assert wrong.exit_code == 2 and wrong.output.startswith("error: unknown number format")


@pytest.mark.parametrize("name", ["fp8_e4m3", "mxfp8", "mxfp4", "nvfp4"])
def test_quantize_under_vmap_matches_a_loop(name):
    x = gaussian(3, 2, 32, seed=4)
    x[1] = 0.0  # an all-zero member keeps its own (zero) scale
    batched = torch.func.vmap(lambda t: precision.quantize(t, name))(x)
    assert_bitwise_equal(batched, torch.stack([precision.quantize(t, name) for t in x]), x)
