"""The global-norm clip's factor in plain Python floats equals torch's float32 ops on the norm,
and the kernels' norm of norms is the exactly summed norm, rounded once to float32."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain.optim.kernels import streaming
from minitrain.optim.transforms import clip_factor

needs_kernels = pytest.mark.skipif(
    not streaming.available(), reason="no C compiler: the streaming kernels cannot be built"
)

float32s = st.floats(width=32, allow_nan=True, allow_infinity=True)
norms = st.one_of(st.floats(min_value=0.0, width=32, allow_infinity=True),
                  st.sampled_from([0.0, math.inf, math.nan, 2.0**-149, 3.4028234663852886e38]))
max_norms = st.one_of(st.floats(min_value=1e-30, max_value=1e30), st.integers(1, 10**6),
                      st.sampled_from([1e-45, 1e39, math.inf, 0.1, 1.0]))


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@settings(max_examples=400, deadline=None)
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), float32s))
def test_float32_rounds_as_torch_does(value):
    want = torch.tensor(value, dtype=torch.float32).item()
    assert _same(streaming.float32(value), want)


@settings(max_examples=600, deadline=None)
@given(norm=norms, max_norm=max_norms)
def test_clip_factor_equals_torchs_float32_ops(norm, max_norm):
    norm32 = torch.tensor(norm, dtype=torch.float32)
    want = float(torch.clamp(max_norm / (norm32 + 1e-6), max=1.0))
    assert _same(clip_factor(norm32.item(), max_norm), want)


def _torch_norm_of_leaf_norms(leaves):
    """The kernels' norm as torch ops compute it from the float64 sums of squares."""
    sums = torch.tensor(streaming.sum_of_squares(leaves), dtype=torch.float64)
    return torch.linalg.vector_norm(sums.to(torch.float32).sqrt(), 2)


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=40),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e18, 1.5e19, 1e25]),
       seed=st.integers(0, 2**16))
# A leaf whose float32 sum of squares, 191698560, torch's CPU sqrt rounds to 13845.5244140625
# where the correctly rounded float32 is 13845.525390625.
@example(sizes=[450, 1361, 2215, 785], scale=1000.0, seed=305)
def test_the_kernels_norm_equals_torchs_ops_on_the_leaf_norms(sizes, scale, seed):
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(n, generator=g) * scale * float(torch.rand((), generator=g))
              for n in sizes]
    ours, theirs = streaming.global_norm(leaves), _torch_norm_of_leaf_norms(leaves)
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == ()
    assert torch.equal(ours, theirs) or (ours.isnan() and theirs.isnan())


@needs_kernels
@pytest.mark.parametrize("values", [
    (2918.0, 2639.0, 1879.0, 2623.0, 1784.0),  # a sum that float32 and exact sums round apart
    (1.5e19, 1.5e19),  # the norm of the leaf norms overflows float32, as torch's does
])
def test_the_kernels_norm_rounds_as_torch_does_where_an_exact_sum_would_not(values):
    leaves = [torch.tensor([v]) for v in values]
    ps = [torch.nn.Parameter(torch.zeros(1)) for _ in values]
    for p, t in zip(ps, leaves, strict=True):
        p.grad = t.clone()
    want = torch.nn.utils.clip_grad_norm_(ps, 1.0)
    clipped, norm = mt.optim.clip_by_global_norm(leaves, 1.0)
    assert torch.equal(norm, want)
    for c, p in zip(clipped, ps, strict=True):
        assert torch.equal(c, p.grad)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(max_norm=st.sampled_from([1e-3, 0.5, 1, 3.0, 1e6]), seed=st.integers(0, 2**16))
def test_a_lowered_clip_and_the_clip_run_op_by_op_scale_alike(max_norm, seed):
    g = torch.Generator().manual_seed(seed)
    grads = {"w": torch.randn(40, 33, generator=g), "b": torch.randn(33, generator=g) * 5}
    clipped, norm = mt.optim.clip_by_global_norm(grads, max_norm)
    factor = mt.optim.transforms.clip_scale(grads, max_norm)
    assert norm.dtype == torch.float32 and factor == clip_factor(norm.item(), max_norm)
    for name, value in grads.items():
        want = value if factor == 1.0 else value * factor
        assert torch.equal(clipped[name], want), name
