"""Every format on its edge values (empty tensors, signed zeros, subnormals, tiny values, +-inf,
NaN, each format's max, min normal and min subnormal) mixed with any fp32, against ml_dtypes
(element formats), torchao (MX, NVFP4, the fp8 casts and scales) and numpy (error statistics).

Where a reference has no answer of its own, the rule the test states is minitrain's:
- fp6 and fp4 have no NaN code (ml_dtypes writes -0): minitrain keeps NaN, so it propagates.
- MX blocks with amax below 2**-118: torchao divides by 2**-126 but stores 2**-127; the
  reference is OCP MX v1.0 6.3 (scale 2**clamp(floor(log2 amax) - emax, -127)) with ml_dtypes.
- NVFP4 of an all-zero tensor is zero (torchao: 0 / 0 = NaN); a tensor whose amax is below
  2**-100 is torchao's quantization of it times 2**64, scaled back (torchao's own scales leave
  fp32's range there: 1 / tensor scale overflows, zeros become NaN).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain import precision
from tests.references import require as reference

ml_dtypes = reference("ml_dtypes")
reference("torchao")
from torchao.float8 import float8_utils  # noqa: E402

from tests.precision.test_formats_torchao import torchao_mx, torchao_nvfp4  # noqa: E402

ML_DTYPES = {
    "fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn, "e8m0": ml_dtypes.float8_e8m0fnu,
}
ELEMENTS = [name for name in precision.FORMATS if not precision.spec(name).is_block]
BLOCKS = [name for name in precision.FORMATS if precision.spec(name).is_block]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _edges() -> list[float]:
    f32 = torch.finfo(torch.float32)
    values = {0.0, 1.0, math.inf, math.nan, f32.max, f32.tiny, f32.smallest_normal / 2**23,
              2.0**-127, 2.0**-100, 2.0**-101, 1e-45, 1e-40, 1e-38, 1e-36, 1e-12, 1e-13}
    for name in ELEMENTS:
        s = precision.spec(name)
        values |= {s.max, s.max * 1.25, s.min_normal, s.min_subnormal, s.min_subnormal / 2}
    values = {float(np.float32(v)) for v in values if v <= f32.max}
    return sorted({*values, *(-v for v in values)}, key=repr)


EDGES = _edges()
VALUES = st.one_of(st.sampled_from(EDGES), st.floats(width=32))


def as_tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(-1)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor) -> None:
    """Bit for bit, every NaN alike; the first difference named with its input."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.flatten().float(), expected.flatten().float()
    bits = [torch.where(torch.isnan(t), math.nan, t).view(torch.int32) for t in (a, e)]
    wrong = (bits[0] != bits[1]).nonzero()
    if wrong.numel():
        i = int(wrong[0, 0])
        raise AssertionError(f"{wrong.numel()} differ; first: input {inputs.flatten()[i].item()!r}"
                             f" gave {a[i].item()!r}, expected {e[i].item()!r}")


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to 10 mantissa bits on the bit pattern (ties to even), as cuBLAS's tf32."""
    bits = x.numpy().view(np.uint32).astype(np.uint64)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    out = torch.from_numpy(rounded.astype(np.uint32).view(np.float32))
    return torch.where(torch.isfinite(x), out, x)


def element_reference(x: torch.Tensor, name: str, saturate: bool) -> torch.Tensor:
    if saturate:
        top = precision.spec(name).max
        x = x.clamp(-top, top)
    if name == "tf32":
        return tf32(x)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the answer
        out = torch.from_numpy(x.numpy().astype(ML_DTYPES[name]).astype(np.float32))
    return torch.where(torch.isnan(x), math.nan, out)  # fp6/fp4: no NaN code, NaN stays


def mx_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.numel() == 0:
        return x.clone()
    expected = torchao_mx(x, name)
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    tiny = (amax > 0) & (amax < 2.0**-118)
    if tiny.any():
        element = precision.spec(precision.spec(name).element)
        emax = math.floor(math.log2(element.max))
        safe = torch.where(tiny, amax, 1.0).double()
        scale = torch.exp2((torch.floor(torch.log2(safe)) - emax).clamp(min=-127))
        scaled = (blocks.double() / scale).clamp(-element.max, element.max)
        ocp = element_reference(scaled.float(), element.name, False).double() * scale
        expected = torch.where(tiny, ocp.float(), expected.reshape(-1, 32)).reshape(x.shape)
    return expected


def nvfp4_reference(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax() if x.numel() else torch.tensor(0.0)
    if amax == 0:
        return torch.zeros_like(x)
    lift = 2.0**64 if amax < 2.0**-100 else 1.0
    return torchao_nvfp4(x * lift) / lift


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("name", ELEMENTS)
@settings(deadline=None, max_examples=60)
@given(values=st.lists(VALUES, max_size=48))
def test_element_formats_on_edge_values_match_ml_dtypes(name, saturate, values):
    x = as_tensor(values)
    actual = precision.quantize(x, name, saturate=saturate)
    assert_same(actual, element_reference(x, name, saturate), x)


@pytest.mark.parametrize("name", ELEMENTS)
def test_every_edge_value_at_once(name):
    x = torch.tensor(EDGES)
    assert_same(precision.quantize(x, name), element_reference(x, name, False), x)


def block_inputs(data, block: int) -> torch.Tensor:
    rows = data.draw(st.integers(0, 3))
    values = data.draw(st.lists(VALUES, min_size=rows * 2 * block, max_size=rows * 2 * block))
    x = as_tensor(values).reshape(rows, 2 * block)
    if data.draw(st.booleans()):  # a tensor of tiny values only
        x = x * data.draw(st.sampled_from([2.0**-110, 2.0**-126, 2.0**-140]))
    return x


@pytest.mark.parametrize("name", BLOCKS)
@settings(deadline=None, max_examples=80)
@given(data=st.data())
def test_block_formats_on_edge_values_match_torchao(name, data):
    s = precision.spec(name)
    x = block_inputs(data, s.block_size)
    expected = nvfp4_reference(x) if s.tensor_scale else mx_reference(x, name)
    assert_same(precision.quantize(x, name), expected, x)


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("fill", [0.0, 1e-45, 1e-40, 1e-36, math.inf, math.nan])
def test_block_formats_on_constant_and_empty_tensors(name, fill):
    block = precision.spec(name).block_size
    for shape in [(0,), (0, block), (3, 0), (2, block)]:
        x = torch.full(shape, fill)
        expected = nvfp4_reference(x) if name == "nvfp4" else mx_reference(x, name)
        assert_same(precision.quantize(x, name), expected, x)
    if math.isfinite(fill):  # finite in, finite out
        assert torch.isfinite(precision.quantize(torch.full((2, block), fill), name)).all()


@pytest.mark.parametrize("fmt", list(FP8))
@settings(deadline=None, max_examples=80)
@given(values=st.lists(VALUES, max_size=48), scale=st.sampled_from([1.0, 2.0**-40, 2.0**-120]))
def test_fp8_cast_with_the_tensors_scale_matches_torchao(fmt, values, scale):
    x = as_tensor(values) * scale
    actual = precision.quantize_operand(x, fmt)
    if x.numel() == 0:
        assert actual.shape == x.shape
        return
    ts = float8_utils.tensor_to_scale(x, FP8[fmt])
    expected = float8_utils.to_fp8_saturated(x * ts, FP8[fmt]).float() / ts
    assert_same(actual, expected, x)
    if torch.isfinite(x).all():
        assert torch.isfinite(actual).all()


AMAXES = st.one_of(st.sampled_from([abs(v) for v in EDGES]),
                   st.floats(0, width=32), st.floats(0, 2.0**-33, width=32))


@pytest.mark.parametrize("fmt", list(FP8))
@settings(deadline=None, max_examples=200)
@given(amaxes=st.lists(AMAXES, min_size=1, max_size=64))
def test_fp8_scale_is_torchaos(fmt, amaxes):
    amax = torch.tensor(amaxes, dtype=torch.float32)
    expected = float8_utils.amax_to_scale(amax, FP8[fmt])
    assert_same(precision.amax_to_scale(amax, fmt), expected, amax)
    usable = torch.isfinite(amax) & (amax > 0)  # a history's skipped or fresh entries scale by 1
    delayed = torch.stack([precision.delayed_scale(a.reshape(1), fmt) for a in amax])
    assert_same(delayed, torch.where(usable, expected, 1.0), amax)


def numpy_stats(x: torch.Tensor, q: torch.Tensor) -> tuple[float, float, float]:
    """rel_error, max_rel_error and underflow by their definitions, in numpy float64."""
    x64, q64 = x.numpy().astype(np.float64), q.numpy().astype(np.float64)
    with np.errstate(all="ignore"):
        distance, norm = np.linalg.norm(q64 - x64), np.linalg.norm(x64)
        rel = np.abs(q64 - x64)[x64 != 0] / np.abs(x64[x64 != 0])
        return (0.0 if distance == 0 else float(distance / norm),
                float(rel.max()) if rel.size else 0.0,
                float(np.sum((x64 != 0) & (q64 == 0)) / max(x64.size, 1)))


@pytest.mark.parametrize("name", ELEMENTS + BLOCKS)
@settings(deadline=None, max_examples=40)
@given(data=st.data())
def test_error_stats_on_edge_values_match_numpy(name, data):
    s = precision.spec(name)
    if s.is_block:
        x = block_inputs(data, s.block_size)
        q = nvfp4_reference(x) if s.tensor_scale else mx_reference(x, name)
    else:
        x = as_tensor(data.draw(st.lists(VALUES, max_size=48)))
        q = element_reference(x, name, False)
    stats = precision.error_stats(x, name)
    expected = numpy_stats(x, q)
    assert np.allclose(stats[:3], expected, rtol=1e-12, atol=0, equal_nan=True), (stats, expected)
    assert 0 <= stats.overflow <= 1 and stats.bits_per_element == s.bits_per_element
    if x.numel() == 0:
        assert stats[:4] == (0.0, 0.0, 0.0, 0.0)
