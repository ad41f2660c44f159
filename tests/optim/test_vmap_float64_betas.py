"""vmap over float64 betas (or a centered RMSprop's alpha) with float32 params, as a sweep
passes float64 values: lerp wants a batched weight in its input's dtype (it raised
"expected dtype float for `weight` but got dtype double")."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

import minitrain as mt

CASES = {
    "adam": lambda b: mt.optim.adam(lr=0.1, betas=(b, b * 0 + 0.999)),
    "adamax": lambda b: mt.optim.adamax(lr=0.1, betas=(b, b * 0 + 0.999)),
    "nadam": lambda b: mt.optim.nadam(lr=0.1, betas=(b, b * 0 + 0.999)),
    "radam": lambda b: mt.optim.radam(lr=0.1, betas=(b, b * 0 + 0.999)),
    "lion": lambda b: mt.optim.lion(lr=0.1, betas=(b, b * 0 + 0.99)),
    "rmsprop_centered": lambda b: mt.optim.rmsprop(lr=0.1, alpha=b, centered=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_over_float64_values_with_float32_params_equals_separate_runs(name):
    g = torch.Generator().manual_seed(0)
    params, grads = torch.randn(5, generator=g), torch.randn(5, generator=g)

    def three_updates(value):
        opt = CASES[name](value)
        p, state = [params], opt.init([params])
        for scale in (1.0, -0.5, 2.0):
            p, state = opt.update([grads * scale], state, p)
        return p[0]

    values = torch.tensor([0.8, 0.9, 0.95], dtype=torch.float64)
    got = vmap(three_updates)(values)
    assert got.dtype == torch.float32
    want = torch.stack([three_updates(float(v)) for v in values])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
