"""Simulated low-precision matmuls: each GEMM equals quantize-then-fp32-matmul, bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain import precision
from minitrain.precision import matmuls, quantize


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def fp8_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fp8_max / amax`` rounded once to fp32 (torchao divides in float64; torch's fp32
    ``448 / t`` is ``448 * (1 / t)``, rounded twice)."""
    return (mt.precision.spec(fmt).max / x.abs().amax().double()).float()


def per_tensor(x: torch.Tensor, fmt: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: TE's scaled saturating cast, with mt.precision.quantize."""
    if scale is None:
        scale = fp8_scale(x, fmt)
    return quantize(x * scale, fmt, saturate=True) / scale


def blockwise(x: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    return quantize(x.movedim(dim, -1).contiguous(), fmt).movedim(-1, dim)


def test_fp8_cast_equals_quantize_with_saturation():
    x = torch.cat([randn(4096, scale=100.0), randn(4096, scale=1e-4), torch.tensor([1e6, -1e6])])
    for fmt in matmuls.PER_TENSOR:
        assert torch.equal(matmuls._fp8_codes(x, fmt).float(), quantize(x, fmt, saturate=True))


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "mxfp4", "nvfp4"])
def test_forward_and_backward_gemms_are_quantize_then_fp32_matmul(name):
    r = precision.RECIPES[name]
    a = randn(64, 96, seed=1, scale=3.0).requires_grad_()
    b = randn(96, 32, seed=2).requires_grad_()
    g = randn(64, 32, seed=3, scale=1e-3)
    y = precision.matmul(a, b, name)
    ga, gb = torch.autograd.grad(y, (a, b), g)
    a, b = a.detach(), b.detach()
    if name == "fp8":
        qa, qb = per_tensor(a, "fp8_e4m3"), per_tensor(b, "fp8_e4m3")
        qg = per_tensor(g, "fp8_e5m2")  # the backward pass quantizes grad_output to e5m2
        expected = (qa @ qb, qg @ qb.T, qa.T @ qg)
    else:  # blocks along each GEMM's reduction dimension
        f, fb = r.forward, r.backward
        expected = (
            blockwise(a, f, -1) @ blockwise(b, f, 0),
            blockwise(g, fb, -1) @ blockwise(b, f, -1).T,
            blockwise(a, f, 0).T @ blockwise(g, fb, 0),
        )
    for actual, want in zip((y, ga, gb), expected, strict=True):
        assert torch.equal(actual, want)
    assert not torch.equal(y, a @ b)  # it did quantize


def test_grad_output_is_rounded_to_e5m2_not_e4m3():
    a, b = torch.eye(4).requires_grad_(), torch.eye(4)
    g = torch.tensor([[1.0, 1.125, 1.25, 1.375]] * 4)  # e4m3 values, three of them not e5m2
    (ga,) = torch.autograd.grad(precision.matmul(a, b, "fp8"), (a,), g)
    assert torch.equal(ga, per_tensor(g, "fp8_e5m2"))
    assert not torch.equal(ga, g)


def test_reduction_dimension_not_a_multiple_of_the_block_is_zero_padded():
    a, b = randn(5, 40, seed=4), randn(40, 3, seed=5)
    padded = precision.matmul(F.pad(a, (0, 24)), F.pad(b, (0, 0, 0, 24)), "mxfp8")
    assert torch.equal(precision.matmul(a, b, "mxfp8"), padded)


def test_mode_routes_linear_matmul_and_at_through_the_recipe():
    x, w, bias = randn(8, 32, seed=6), randn(16, 32, seed=7), randn(16, seed=8)
    expected = per_tensor(x, "fp8_e4m3") @ per_tensor(w.T, "fp8_e4m3") + bias
    with precision.simulate("fp8"):
        outs = [F.linear(x, w, bias), x @ w.T + bias, torch.matmul(x, w.T) + bias]
        outs.append(torch.mm(x, w.T) + bias)
        assert (torch.arange(3) @ torch.arange(3)).item() == 5  # integers pass through
    for out in outs:
        assert torch.equal(out, expected)
    assert not torch.equal(x @ w.T + bias, expected)  # outside the context: fp32 again


def test_from_module_model_under_grad_and_vmap():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    params, apply = mt.from_module(net)
    x, y = randn(16, 32, seed=9), randn(16, 1, seed=10)

    def loss(p, x, y):
        with precision.simulate("mxfp8"):
            return F.mse_loss(apply(p, x), y)

    grads = mt.grad(loss)(params, x, y)
    members = mt.tree.stack([params, mt.tree.map(lambda t: t * 0.5, params)])
    batched = mt.vmap(mt.grad(loss), in_dims=(0, None, None))(members, x, y)
    second = mt.grad(loss)(mt.tree.map(lambda t: t * 0.5, params), x, y)
    for name in grads:
        assert torch.equal(batched[name][0], grads[name])
        assert torch.equal(batched[name][1], second[name])
    with torch.no_grad():
        fp32 = mt.grad(lambda p, x, y: F.mse_loss(apply(p, x), y))(params, x, y)
    assert not torch.equal(grads["0.weight"], fp32["0.weight"])


def test_delayed_scaling_history_comes_back_as_the_gradient_of_the_state():
    a = randn(8, 32, seed=11, scale=2.0)
    w = randn(32, 16, seed=12).requires_grad_()
    g = randn(8, 16, seed=13)
    r = precision.Recipe(history_len=4)
    state = precision.init_state(r, precision.count_matmuls(lambda: a @ w))
    assert state.shape == (1, 3, 4)

    def step(state):
        state = state.requires_grad_()
        with precision.simulate(r, state):
            y = a @ w
        gw, new_state = torch.autograd.grad(y, (w, state), g)
        return y, gw, new_state

    y0, gw0, state1 = step(state)  # the first step scales by 1
    qg = quantize(g, "fp8_e5m2", saturate=True)
    assert torch.equal(
        y0, quantize(a, "fp8_e4m3", saturate=True) @ quantize(w.detach(), "fp8_e4m3", saturate=True)
    )
    assert torch.equal(gw0, quantize(a, "fp8_e4m3", saturate=True).T @ qg)
    amaxes = torch.stack([a.abs().amax(), w.detach().abs().amax(), g.abs().amax()])
    assert torch.equal(state1[0, :, 0], amaxes) and not state1[0, :, 1:].any()
    y1, _, state2 = step(state1.detach())  # the second step scales by the recorded amaxes
    s = precision.delayed_scale(state1[0], "fp8_e4m3")
    want = per_tensor(a, "fp8_e4m3", s[0]) @ per_tensor(w.detach(), "fp8_e4m3", s[1])
    assert torch.equal(y1, want)
    assert torch.equal(state2[0, :, 1], amaxes)


def test_delayed_state_under_vmap_is_per_member():
    a = randn(3, 8, 32, seed=14) * torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1)
    w = randn(32, 16, seed=15)
    state = precision.init_state("fp8", 1)

    def loss(w, state, a):
        with precision.simulate("fp8", state):
            return (a @ w).sum()

    grad = torch.func.grad(loss, argnums=(0, 1))
    _, states = torch.func.vmap(grad, in_dims=(None, None, 0))(w, state, a)
    for i in range(3):
        assert torch.equal(states[i], grad(w, state, a[i])[1])
        assert states[i][0, 0, 0] == a[i].abs().amax()


def test_bad_recipe_and_state_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="choose one of"):
        precision.recipe("fp7")
    with pytest.raises(ValueError, match="state=None"):
        precision.init_state("mxfp8", 2)
    with (
        pytest.raises(ValueError, match="count_matmuls"),
        precision.simulate("fp8", torch.zeros(1, 3, 4)),
    ):
        torch.eye(2) @ torch.eye(2) @ torch.eye(2)


def test_scaled_mm_gemms_are_built_from_the_same_fp8_codes():
    # torch._scaled_mm runs on CPU too: the real-fp8 recipe (cuda-fp8's) is exercised here.
    a = randn(32, 64, seed=16, scale=3.0).requires_grad_()
    b = randn(64, 48, seed=17).requires_grad_()
    g = randn(32, 48, seed=18, scale=1e-2)
    y = precision.matmul(a, b, "fp8-scaled-mm")
    ga, gb = torch.autograd.grad(y, (a, b), g)
    a, b = a.detach(), b.detach()
    e4, e5 = "fp8_e4m3", "fp8_e5m2"
    sa, sb, sg = fp8_scale(a, e4), fp8_scale(b, e4), fp8_scale(g, e5)
    a8, b8, ia, ib = precision.scaled_mm_operands(a, b, (e4, e4), (sa, sb))
    assert b8.stride() == (1, 64)  # column-major, as cuBLASLt wants it
    assert torch.equal(a8.float(), quantize(a * sa, e4, saturate=True))  # the same codes
    assert torch.equal(b8.float(), quantize(b * sb, e4, saturate=True))
    assert ia == 1 / sa and ib == 1 / sb
    assert torch.equal(y, torch._scaled_mm(a8, b8, scale_a=ia, scale_b=ib, out_dtype=torch.float32))
    g8, bt8, ig, ib2 = precision.scaled_mm_operands(g, b.T, (e5, e4), (sg, sb))
    assert g8.dtype == torch.float8_e5m2
    want_ga = torch._scaled_mm(g8, bt8, scale_a=ig, scale_b=ib2, out_dtype=torch.float32)
    assert torch.equal(ga, want_ga)
    simulated = precision.matmul(a.requires_grad_(), b.requires_grad_(), "fp8")
    sim_ga, sim_gb = torch.autograd.grad(simulated, (a, b), g)
    for real, sim in ((y, simulated), (ga, sim_ga), (gb, sim_gb)):
        torch.testing.assert_close(real, sim.detach(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The fp8 -> float32 decode through the format's table, against torch's cast


def _same_bits(a, b):
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32),
                                                        b[~nan].view(torch.int32))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), fmt=st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
       magnitude=st.integers(-30, 30))
def test_the_table_decode_is_torchs_cast_bit_for_bit(seed, fmt, magnitude):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(129, 257, generator=g) * 2.0**magnitude
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45])
    top = matmuls.spec(fmt).max
    codes = x.clamp(-top, top).to(matmuls._TORCH_FP8[fmt])
    assert _same_bits(matmuls._decode(codes), codes.float())


def test_the_table_decode_runs_under_counters_fake_tensors_vmap_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    codes = torch.randn(4, 64, 256).to(torch.float8_e4m3fn)
    with mt.accounting.Counter() as counter:
        assert torch.equal(matmuls._decode(codes), codes.float())
    assert counter.records  # its ops are counted
    with FakeTensorMode() as fake:
        assert matmuls._decode(fake.from_tensor(codes)).shape == codes.shape
    assert torch.equal(torch.func.vmap(matmuls._decode)(codes), codes.float())
    compiled = torch.compile(matmuls._decode, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(codes), codes.float())


# ---------------------------------------------------------------------------------------------
# Activation checkpointing inside a simulation


def _grads_with_and_without_checkpointing(recipe_name, state, context_fn=None, twice=False):
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    a = torch.randn(32, 32, generator=g, requires_grad=True)
    b = torch.randn(32, 32, generator=g, requires_grad=True)
    results = []
    for checkpointed in (False, True):
        history = None if state is None else state.clone().requires_grad_(True)
        with precision.simulate(recipe_name, history):
            if checkpointed:
                h = checkpoint(lambda x, w: torch.relu(x @ w) @ w, x, a, use_reentrant=False,
                               context_fn=functools.partial(precision.recompute_context,
                                                            context_fn))
            else:
                h = torch.relu(x @ a) @ a
            loss = ((h @ b) ** 2).mean()
        inputs = [a, b] + ([history] if history is not None else [])
        grads = torch.autograd.grad(loss, inputs, retain_graph=twice)
        if twice:  # the graph kept: the region is recomputed again, from the same matmul
            assert all(torch.equal(u, v) for u, v in zip(
                grads, torch.autograd.grad(loss, inputs), strict=True))
        results.append(grads)
    return results


@pytest.mark.parametrize("name,delayed", [("fp8", True), ("fp8", False), ("mxfp8", False),
                                          ("nvfp4", False)])
def test_a_checkpointed_region_recomputes_its_simulated_matmuls_bit_for_bit(name, delayed):
    """torch.utils.checkpoint (non-reentrant) recomputes in the backward pass, after the
    simulation: with recompute_context the recomputation replays it from the region's first
    matmul, so grads and the updated amax histories equal the run without checkpointing."""
    state = precision.init_state(name, 3) + torch.tensor([0.5, 2.0, 8.0])[:, None, None] \
        if delayed else None
    plain, checkpointed = _grads_with_and_without_checkpointing(name, state)
    assert len(plain) == (3 if delayed else 2)
    for u, v in zip(plain, checkpointed, strict=True):
        assert torch.equal(u, v)


def test_checkpoint_replay_keeps_a_callers_context_fn_and_recomputes_again():
    entered = []

    class Note:  # reusable, as torch enters the recomputation's context on every recompute
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            entered.append(self.what)

        def __exit__(self, *exc):
            return False

    def context_fn():
        return Note("forward"), Note("recompute")

    state = precision.init_state("fp8", 3) + 1.0
    plain, checkpointed = _grads_with_and_without_checkpointing("fp8", state, context_fn,
                                                                twice=True)
    assert all(torch.equal(u, v) for u, v in zip(plain, checkpointed, strict=True))
    assert entered == ["forward", "recompute", "recompute"]


def test_a_reentrant_checkpoint_inside_a_simulation_is_refused_in_one_line():
    from torch.utils.checkpoint import checkpoint

    a, x = torch.randn(32, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    with precision.simulate("fp8"), pytest.raises(ValueError, match="use_reentrant=False"):
        checkpoint(lambda x: x @ a, x, use_reentrant=True)
    # outside a simulation, torch's reentrant checkpoint is untouched
    checkpoint(lambda x: x @ a, x, use_reentrant=True).sum().backward()
    assert torch.equal(a.grad, x.detach().sum(0)[:, None].expand(32, 32))


def test_a_checkpoint_without_recompute_context_fails_loudly_and_torch_stays_as_it_was():
    import torch.utils.checkpoint as ckpt

    before = dict(vars(ckpt))
    g = torch.Generator().manual_seed(0)
    x, a = torch.randn(4, 32, generator=g), torch.randn(32, 32, generator=g, requires_grad=True)
    with precision.simulate("fp8"):
        h = ckpt.checkpoint(lambda x, w: torch.relu(x @ w) @ w, x, a, use_reentrant=False)
        loss = (h**2).mean()
    with pytest.raises(ckpt.CheckpointError):  # the recomputation saved other tensors
        torch.autograd.grad(loss, [a])
    assert all(vars(ckpt).get(name) is value for name, value in before.items())
