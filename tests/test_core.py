"""Init, models, function transforms, seeding and shape checks."""

import math
import os
import subprocess
import sys

import pytest
import torch
from jaxtyping import TypeCheckError

import minitrain as mt


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_xavier_keeps_output_scale_independent_of_input_dim():
    # The chapter's point (3.5.1): randn gives outputs ~ sqrt(input_dim); Xavier keeps them O(1).
    for dim in (256, 16384):
        x = torch.randn(dim, generator=gen(1))
        w = mt.init.xavier_normal((dim, 64), generator=gen(2))
        assert 0.5 < float((x @ w).std()) < 1.5
        plain = mt.init.normal((dim, 64), generator=gen(2))
        assert float((x @ plain).std()) > 0.5 * math.sqrt(dim)


def test_truncated_normal_is_cut_at_three_std():
    w = mt.init.truncated_normal((512, 512), generator=gen())
    std = 1 / math.sqrt(512)
    assert float(w.abs().max()) <= 3 * std
    assert abs(float(w.std()) - std * 0.986) < 0.01 * std  # std of N(0,1) cut at ±3 is 0.9866


def test_initializers_are_deterministic_given_a_generator():
    a = mt.models.cruncher_init(dim=8, num_layers=2, generator=gen(3))
    b = mt.models.cruncher_init(dim=8, num_layers=2, generator=gen(3))
    for x, y in zip(mt.tree.leaves(a), mt.tree.leaves(b), strict=True):
        assert torch.equal(x, y)


def test_cruncher_matches_chapter_module():
    params = mt.models.cruncher_init(dim=16, num_layers=3, generator=gen())
    x = torch.randn(8, 16)
    expected = x
    for layer in params["layers"]:
        expected = expected @ layer["weight"]
    expected = (expected @ params["final"]["weight"]).squeeze(-1)
    torch.testing.assert_close(mt.models.cruncher(params, x), expected)
    assert mt.tree.size(params) == mt.models.cruncher_param_count(16, 3)


def test_wrong_shape_names_the_dimension():
    params = mt.models.cruncher_init(dim=16, num_layers=1, generator=gen())
    with pytest.raises(TypeCheckError, match="in_dim"):
        mt.models.cruncher(params, torch.randn(4, 15))
    with pytest.raises(TypeCheckError, match="batch"):
        mt.losses.mse(torch.zeros(4), torch.zeros(5))


def test_value_and_grad_order_and_aux():
    def loss(params, x):
        return (params["w"] * x).pow(2).sum(), {"mean": x.mean()}

    params, x = {"w": torch.tensor([1.0, 2.0])}, torch.tensor([3.0, 4.0])
    (value, aux), grads = mt.value_and_grad(loss, has_aux=True)(params, x)
    torch.testing.assert_close(value, torch.tensor(9.0 + 64.0))
    torch.testing.assert_close(grads["w"], 2 * params["w"] * x**2)
    torch.testing.assert_close(aux["mean"], torch.tensor(3.5))
    g, aux2 = mt.grad(loss, has_aux=True)(params, x)
    torch.testing.assert_close(g["w"], grads["w"])


class MLPWithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.net(x).squeeze(-1) * self.scale


def test_from_module_matches_backward_and_leaves_module_untouched():
    torch.manual_seed(0)
    module = MLPWithBuffer()
    x, y = torch.randn(16, 5), torch.randn(16)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    versions = {k: v._version for k, v in module.named_parameters()}

    params, apply = mt.from_module(module)
    assert sorted(params) == sorted(k for k, _ in module.named_parameters())

    def loss_fn(p, batch):
        xb, yb = batch
        return torch.nn.functional.mse_loss(apply(p, xb), yb)

    loss, grads = mt.value_and_grad(loss_fn)(params, (x, y))
    reference = torch.nn.functional.mse_loss(module(x), y)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)
    # A functional SGD step on params never touches the module's own tensors.
    stepped = mt.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert not torch.equal(stepped["net.0.weight"], module.net[0].weight)
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k])
    assert {k: v._version for k, v in module.named_parameters()} == versions


def test_vmap_is_torch_func_vmap():
    assert mt.vmap is torch.func.vmap
    out = mt.vmap(lambda w, x: x @ w, in_dims=(0, None))(torch.ones(3, 4, 2), torch.ones(5, 4))
    assert out.shape == (3, 5, 2)


def test_seed_everything_covers_torch_numpy_random():
    import random

    import numpy as np

    def draw():
        return (
            torch.rand(3).tolist(),
            np.random.rand(3).tolist(),
            [random.random() for _ in range(3)],
        )

    mt.seed_everything(7)
    first = draw()
    mt.seed_everything(7)
    assert draw() == first
    mt.seed_everything(8)
    assert draw() != first
    with pytest.raises(ValueError, match=r"integer in \[0, 2\*\*63\)"):
        mt.seed_everything(-1)


def test_rng_state_roundtrip():
    mt.seed_everything(1)
    state = mt.rng.get_rng_state()
    first = (torch.rand(2).tolist(), __import__("numpy").random.rand(2).tolist())
    mt.rng.set_rng_state(state)
    assert (torch.rand(2).tolist(), __import__("numpy").random.rand(2).tolist()) == first


COMPILE_CHECKED = """
import torch, minitrain as mt
params = mt.models.cruncher_init(dim=8, num_layers=2, generator=torch.Generator().manual_seed(0))
x = torch.randn(4, 8)
compiled = torch.compile(mt.models.cruncher, fullgraph=True, backend="aot_eager")
assert torch.allclose(compiled(params, x), mt.models.cruncher(params, x))
try:
    mt.models.cruncher(params, torch.randn(4, 7))
except Exception as error:
    print(type(error).__name__)
"""


def test_shape_checked_functions_compile_into_one_graph_and_still_check_eager_calls():
    # A fresh interpreter: pytest's jaxtyping import hook wraps functions in checks of its own.
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_CHECKED], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MINITRAIN_TYPECHECK": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "TypeCheckError"
