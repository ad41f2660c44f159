"""Updates of CPU params under ``torch.set_default_device``: the kernels' output buffers and
the states' counts, lrs and flags stay on the CPU, so an update gives the same params as with
no default device set (a buffer made on "meta" or "cuda" once handed the kernels a pointer they
wrote through: a segfault)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from benchmarks_harness import load_benchmark

import minitrain as mt

OPTIMIZERS = load_benchmark("optim").OPTIMIZERS
FAMILY = load_benchmark("optim").FAMILY
hand_built_adamw = load_benchmark("optim").hand_built_adamw

FACTORIES = {
    **{name: (row[0], row[2]) for name, row in OPTIMIZERS.items()},
    **{name: (row[0], row[2]) for name, row in FAMILY.items()},
    "clip_adam_decay_schedule": (hand_built_adamw, {}),
}


def _params(matrices_only: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 96, generator=g), "big": torch.randn(256, 256, generator=g),
              "b": torch.randn(96, generator=g)}
    return {k: v for k, v in params.items() if v.ndim == 2 or not matrices_only}


def _run(name: str, donate: bool, default_device: str | None):
    factory, kwargs = FACTORIES[name]
    params = _params(matrices_only=name == "muon")
    g = torch.Generator().manual_seed(1)
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(3)]
    torch.set_default_device(default_device)
    try:
        opt = factory(**kwargs)
        state = opt.init(params)
        for step_grads in grads:
            params, state = opt.update(step_grads, state, params, donate=donate)
    finally:
        torch.set_default_device(None)
    return params, state


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", FACTORIES)
def test_an_update_of_cpu_params_ignores_the_default_device(name, donate):
    expected, _ = _run(name, donate, None)
    params, state = _run(name, donate, "meta")
    leaves = mt.tree.leaves((params, state))
    devices = {t.device.type for t in leaves if isinstance(t, torch.Tensor)}
    assert devices == {"cpu"}, devices
    for key, value in expected.items():
        torch.testing.assert_close(params[key], value, rtol=0, atol=0)


def test_the_norm_of_no_leaves_is_a_cpu_float32_zero():
    torch.set_default_device("meta")
    torch.set_default_dtype(torch.float64)
    try:
        norm = mt.tree.global_norm({})
        clipped, clip_norm = mt.optim.clip_by_global_norm({}, 1.0)
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    assert (norm.device.type, norm.dtype, float(norm)) == ("cpu", torch.float32, 0.0)
    assert clipped == {} and (clip_norm.device.type, float(clip_norm)) == ("cpu", 0.0)


def test_the_pool_never_hands_a_kernel_a_meta_buffer():
    # In a child: before the fix, the pure update's second step segfaulted here.
    code = """import torch, minitrain as mt
opt = mt.optim.adamw(lr=1e-3)
p, g = {"w": torch.randn(1 << 20)}, {"w": torch.randn(1 << 20)}
s = opt.init(p)
p, s = opt.update(g, s, p)
torch.set_default_device("meta")
p, s = opt.update(g, s, p)
print(p["w"].device, p["w"].isfinite().all().item())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "MINITRAIN_TYPECHECK": "0"})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["cpu", "True"]
