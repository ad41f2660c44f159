"""Low- and high-precision dtypes, traced hyperparameters and torch-only arguments across the
optimizer family, each against torch.optim: SGD's bf16/fp16 leaves (which torch's CPU
``_fused_sgd_`` skips), Rprop's eta factors in the leaf's dtype, Muon's plain path in torch's
decay order, Adam's ``decoupled_weight_decay``, and vmap over NAdam/RAdam betas and Rprop's lr."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt

HALVES = [torch.bfloat16, torch.float16]


def _torch_steps(cls, p0, grads, **kwargs):
    p = torch.nn.Parameter(p0.clone())
    optimizer = cls([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach(), optimizer.state[p]


def _mt_steps(optimizer, p0, grads, donate=False, requires_grad=False):
    params = {"w": p0.clone().requires_grad_(requires_grad)}
    state = optimizer.init(params)
    for g in grads:
        params, state = optimizer.update({"w": g.clone()}, state, params, donate=donate)
    return params["w"].detach(), state


def _data(n, dtype, steps, seed=0, shape=None):
    gen = torch.Generator().manual_seed(seed)
    shape = shape or (n,)
    p0 = torch.randn(shape, generator=gen).to(dtype)
    return p0, [torch.randn(shape, generator=gen).to(dtype) for _ in range(steps)]


# --------------------------------------------------------------------------------------------
# 1. SGD on bf16 / fp16 leaves: torch's default (foreach / for-loop) path, bit for bit

SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1),
    dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    dict(lr=0.05, momentum=0.5, weight_decay=0.01, maximize=True),
    dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True),
]


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("n", [16, 64, 1000])
@pytest.mark.parametrize("config", SGD_CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_sgd_half_precision_equals_torch_default_path(dtype, config, n, donate):
    p0, grads = _data(n, dtype, steps=4)
    ours, state = _mt_steps(mt.optim.sgd(**config), p0, grads, donate=donate)
    for foreach in (None, False):  # torch's default on CPU: the for-loop path
        theirs, torch_state = _torch_steps(torch.optim.SGD, p0, grads, foreach=foreach, **config)
        assert torch.equal(ours, theirs), (foreach, (ours.float() - theirs.float()).abs().max())
        if config.get("momentum"):
            assert torch.equal(state.momentum_buffer["w"], torch_state["momentum_buffer"])
    assert ours.dtype == dtype and not torch.equal(ours, p0)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_sgd_half_precision_pure_update_leaves_inputs_alone(dtype):
    p0, (g,) = _data(64, dtype, steps=1)
    optimizer = mt.optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.1)
    params, grads = {"w": p0.clone()}, {"w": g.clone()}
    state = optimizer.init(params)
    new, new_state = optimizer.update(grads, state, params)
    assert torch.equal(params["w"], p0) and torch.equal(grads["w"], g)
    assert torch.equal(state.momentum_buffer["w"], torch.zeros_like(p0))
    donated, _ = optimizer.update(grads, optimizer.init({"w": p0.clone()}), {"w": p0.clone()},
                                  donate=True)
    assert torch.equal(new["w"], donated["w"]) and not torch.equal(new["w"], p0)


@pytest.mark.parametrize("n", [64, 1000])
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("name, config", [
    ("adam", dict(lr=0.1, eps=1e-3)),
    ("adamw", dict(lr=0.1, eps=1e-3, amsgrad=True)),
    ("adagrad", dict(lr=0.1)),
])
def test_fused_aliases_update_every_half_precision_element(name, config, dtype, n):
    """Adam, AdamW and Adagrad keep torch's fused kernels on bf16/fp16 leaves: those update
    every element (unlike ``_fused_sgd_``) and equal ``fused=True`` bit for bit."""
    p0, grads = _data(n, dtype, steps=3)
    ours, _ = _mt_steps(getattr(mt.optim, name)(**config), p0, grads)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}
    theirs, _ = _torch_steps(cls[name], p0, grads, fused=True, **config)
    assert torch.equal(ours, theirs)
    one, _ = _mt_steps(getattr(mt.optim, name)(**config), p0, grads[:1])
    assert bool((one != p0).all())


# --------------------------------------------------------------------------------------------
# 2. Rprop's factors in the leaf's dtype; init with a traced lr


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_rprop_step_sizes_in_leaf_dtype_equal_torch(dtype, requires_grad):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(40, generator=gen).to(dtype)
    # Same signs for three steps (step sizes grow by etaplus), then some flips.
    signs = torch.ones(40)
    signs[::3] = -1
    grads = [torch.ones(40, dtype=dtype)] * 3 + [
        (signs * torch.rand(40, generator=gen)).to(dtype) for _ in range(3)]
    config = dict(lr=0.1, etas=(0.3, 1.7), step_sizes=(1e-3, 0.9))
    theirs, torch_state = _torch_steps(torch.optim.Rprop, p0, grads, **config)
    ours, state = _mt_steps(mt.optim.rprop(**config), p0, grads, requires_grad=requires_grad)
    step_size = state[-1].step_size["w"]
    assert step_size.dtype == dtype
    assert torch.equal(step_size, torch_state["step_size"])
    assert torch.equal(state[-1].prev["w"], torch_state["prev"])
    assert torch.equal(ours, theirs)
    if not requires_grad:
        donated, donated_state = _mt_steps(mt.optim.rprop(**config), p0, grads, donate=True)
        assert torch.equal(donated, ours)
        assert torch.equal(donated_state[-1].step_size["w"], step_size)


def test_rprop_init_and_update_under_vmap_over_lr():
    lrs = [0.01, 0.05, 0.2]
    p0, grads = _data(6, torch.float32, steps=4)

    def init(lr, params):
        return mt.optim.rprop(lr=lr).init(params)

    def update(lr, params, state, g):
        return mt.optim.rprop(lr=lr).update(g, state, params)

    params = {"w": p0.expand(3, 6).clone()}
    state = torch.func.vmap(init)(torch.tensor(lrs), params)
    for g in grads:
        params, state = torch.func.vmap(update)(torch.tensor(lrs), params, state,
                                                {"w": g.expand(3, 6).clone()})
    for i, lr in enumerate(lrs):
        theirs, torch_state = _torch_steps(torch.optim.Rprop, p0, grads, lr=lr)
        torch.testing.assert_close(params["w"][i], theirs, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(state[-1].step_size["w"][i], torch_state["step_size"])


# --------------------------------------------------------------------------------------------
# 3. Muon's plain path: torch's p (1 - lr wd) then p - lr ratio NS(update)


@pytest.mark.parametrize("shape, adjust", [((32, 16), None), ((16, 24), "match_rms_adamw")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_muon_plain_path_equals_torch_and_fast_path(dtype, shape, adjust):
    gen = torch.Generator().manual_seed(0)
    p0 = (torch.randn(shape, generator=gen) * 2).to(dtype)
    grads = [torch.randn(shape, generator=gen).to(dtype) for _ in range(12)]
    config = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    theirs, _ = _torch_steps(torch.optim.Muon, p0, grads, **config)
    fast, _ = _mt_steps(mt.optim.muon(**config), p0, grads)
    plain, state = _mt_steps(mt.optim.muon(**config), p0, grads, requires_grad=True)
    assert torch.equal(fast, theirs)
    assert torch.equal(plain, theirs), (plain.float() - theirs.float()).abs().max()
    fast_state = _mt_steps(mt.optim.muon(**config), p0, grads)[1]
    assert torch.equal(state[0][0].momentum_buffer["w"], fast_state[0][0].momentum_buffer["w"])
    assert int(state[0][0].count) == int(state[-1].count) == len(grads)


def test_muon_plain_path_keeps_autograd_and_schedules():
    p0, grads = _data(0, torch.float32, steps=3, shape=(8, 4))
    schedule = mt.optim.cosine_schedule(0.05, decay_steps=3)
    ours, _ = _mt_steps(mt.optim.muon(lr=schedule), p0, grads, requires_grad=True)
    fast, _ = _mt_steps(mt.optim.muon(lr=schedule), p0, grads)
    assert torch.equal(ours, fast)
    params = {"w": p0.clone().requires_grad_()}
    optimizer = mt.optim.muon(lr=0.1)
    new, _ = optimizer.update({"w": grads[0]}, optimizer.init(params), params)
    new["w"].sum().backward()  # differentiable through p (1 - lr wd)
    torch.testing.assert_close(params["w"].grad, torch.full_like(p0, 1 - 0.1 * 0.1))


# --------------------------------------------------------------------------------------------
# 4. Adam(decoupled_weight_decay=True) is AdamW, as in torch


@pytest.mark.parametrize("impl", ["auto", "fast", "plain"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_decoupled_weight_decay_matches_torch(amsgrad, impl):
    p0, grads = _data(50, torch.float64, steps=6)
    config = dict(lr=0.05, weight_decay=0.3, amsgrad=amsgrad)
    ours, state = _mt_steps(mt.optim.adam(**config, decoupled_weight_decay=True, impl=impl),
                            p0, grads)
    theirs, torch_state = _torch_steps(torch.optim.Adam, p0, grads, decoupled_weight_decay=True,
                                       **config)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state.exp_avg_sq["w"], torch_state["exp_avg_sq"])
    adamw, _ = _mt_steps(mt.optim.adamw(**config, impl=impl), p0, grads)
    assert torch.equal(ours, adamw)
    coupled, _ = _mt_steps(mt.optim.adam(**config, impl=impl), p0, grads)
    assert not torch.allclose(ours, coupled)


# --------------------------------------------------------------------------------------------
# 5. vmap over NAdam / RAdam betas


@pytest.mark.parametrize("name", ["NAdam", "RAdam"])
def test_vmap_over_betas_matches_torch_per_member(name):
    betas = [(0.8, 0.9), (0.5, 0.99), (0.0, 0.5)]
    factory = {"NAdam": mt.optim.nadam, "RAdam": mt.optim.radam}[name]
    p0, grads = _data(0, torch.float32, steps=8, shape=(4, 3))
    b1 = torch.tensor([b[0] for b in betas])
    b2 = torch.tensor([b[1] for b in betas])

    def init(b1, b2, params):
        return factory(lr=0.01, betas=(b1, b2)).init(params)

    def update(b1, b2, params, state, g):
        return factory(lr=0.01, betas=(b1, b2)).update(g, state, params)

    params = {"w": p0.expand(3, 4, 3).clone()}
    state = torch.func.vmap(init)(b1, b2, params)
    for g in grads:
        params, state = torch.func.vmap(update)(b1, b2, params, state,
                                                {"w": g.expand(3, 4, 3).clone()})
    for i, member in enumerate(betas):
        theirs, _ = _torch_steps(getattr(torch.optim, name), p0, grads, lr=0.01, betas=member,
                                 foreach=False)
        torch.testing.assert_close(params["w"][i], theirs, rtol=1e-5, atol=1e-6)


def test_vmap_over_adadelta_rho_matches_torch_per_member():
    rhos = [0.5, 0.9, 0.99]
    p0, grads = _data(0, torch.float32, steps=8, shape=(4, 3))

    def init(rho, params):
        return mt.optim.adadelta(lr=1.0, rho=rho).init(params)

    def update(rho, params, state, g):
        return mt.optim.adadelta(lr=1.0, rho=rho).update(g, state, params)

    rho = torch.tensor(rhos)
    params = {"w": p0.expand(3, 4, 3).clone()}
    state = torch.func.vmap(init)(rho, params)
    for g in grads:
        params, state = torch.func.vmap(update)(rho, params, state,
                                                {"w": g.expand(3, 4, 3).clone()})
    for i, member in enumerate(rhos):
        theirs, _ = _torch_steps(torch.optim.Adadelta, p0, grads, lr=1.0, rho=member,
                                 foreach=False)
        torch.testing.assert_close(params["w"][i], theirs, rtol=1e-5, atol=1e-6)


def test_vmap_over_schedule_free_beta2_matches_each_member():
    beta2s = [0.9, 0.99, 0.999]
    p0, grads = _data(0, torch.float32, steps=8, shape=(4, 3))

    def make(beta2):
        return mt.optim.schedule_free_adamw(lr=0.01, betas=(torch.tensor(0.9), beta2))

    def run(beta2):
        opt, params = make(beta2), {"w": p0.clone()}
        state = opt.init(params)
        for g in grads:
            params, state = opt.update({"w": g.clone()}, state, params)
        return params["w"]

    batched = torch.func.vmap(run)(torch.tensor(beta2s))
    for i, member in enumerate(beta2s):
        torch.testing.assert_close(batched[i], run(torch.tensor(member)), rtol=1e-6, atol=1e-7)
