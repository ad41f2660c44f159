"""The aliases are chains: equal to their chain to the bit on the plain path, lowered to the
fused / streaming kernels on the fast path, and fixed where torch.optim's semantics differ."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt

ALIASES = {
    "sgd": (mt.optim.sgd, mt.optim.sgd_chain, torch.optim.SGD,
            dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    "adam": (mt.optim.adam, mt.optim.adam_chain, torch.optim.Adam,
             dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    "adamw": (mt.optim.adamw, lambda **k: mt.optim.adam_chain(**k, decoupled=True),
              torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adagrad": (mt.optim.adagrad, mt.optim.adagrad_chain, torch.optim.Adagrad,
                dict(lr=0.1, lr_decay=0.01, weight_decay=0.01)),
    "rmsprop": (mt.optim.rmsprop, mt.optim.rmsprop_chain, torch.optim.RMSprop,
                dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.01)),
}
SHAPES = [(33, 64), (7,), ()]


def _data(seed, steps=4):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    return params, [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def _run(opt, params, grads, requires_grad=False):
    params = [p.clone().requires_grad_(requires_grad) for p in params]
    state = opt.init(params)
    with torch.set_grad_enabled(requires_grad):
        for step_grads in grads:
            params, state = opt.update(step_grads, state, params)
    return [p.detach() for p in params], state


def _torch(cls, kwargs, params, grads):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = cls(ps, **kwargs)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


@pytest.mark.parametrize("name", ALIASES)
def test_alias_equals_its_chain_to_the_bit_on_the_plain_path(name):
    alias, make_chain, _, kwargs = ALIASES[name]
    params, grads = _data(0)
    ours, _ = _run(alias(**kwargs, impl="plain"), params, grads, requires_grad=True)
    chained, _ = _run(mt.optim.as_optimizer(make_chain(**kwargs)), params, grads,
                      requires_grad=True)
    for a, b in zip(ours, chained, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ALIASES)
def test_a_chain_built_by_hand_lowers_to_the_aliases_fast_path(name, monkeypatch):
    alias, make_chain, cls, kwargs = ALIASES[name]
    params, grads = _data(1)
    fast, _ = _run(alias(**kwargs, impl="fast"), params, grads)
    calls = []
    for driver in ("_fast_update", "_stream_update"):
        monkeypatch.setattr(mt.optim.base, driver, _counting(calls, driver))
    lowered, state = _run(mt.optim.as_optimizer(make_chain(**kwargs)), params, grads)
    assert calls, "the chain did not take the fused / streaming path"
    for a, b, c in zip(fast, lowered, _torch(cls, kwargs, params, grads), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    assert isinstance(state, tuple) and int(state[-1].count) == len(grads)


def _counting(calls, driver):
    original = getattr(mt.optim.base, driver)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return counted


@pytest.mark.parametrize("impl", ["fast", "plain"])
@pytest.mark.parametrize("name", ALIASES)
def test_maximize_matches_torch(name, impl):
    alias, _, cls, kwargs = ALIASES[name]
    params, grads = _data(2)
    ours, _ = _run(alias(**kwargs, maximize=True, impl=impl), params, grads)
    for a, b in zip(ours, _torch(cls, dict(kwargs, maximize=True), params, grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["fast", "plain"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1), (1,)])
@pytest.mark.parametrize("factory", [mt.optim.adam, mt.optim.adamw])
def test_one_element_tensor_betas_are_squeezed_like_torch(factory, shape, impl):
    betas = (torch.full(shape, 0.8), torch.full(shape, 0.9))
    opt = factory(lr=0.1, betas=betas, impl=impl)
    params = {"w": torch.ones(4, 3)}
    new, _ = opt.update({"w": torch.ones(4, 3)}, opt.init(params), params)
    assert new["w"].shape == (4, 3)


def test_bad_tensor_hyperparameters_are_refused_naming_them():
    with pytest.raises(ValueError, match="lr"):
        mt.optim.sgd(lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="lr"):
        mt.optim.adam(lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="betas"):
        mt.optim.adamw(betas=(0.9, torch.tensor(0.999)))
    with pytest.raises(ValueError, match="betas"):
        mt.optim.adam(betas=(torch.tensor(0.9), 0.999))


def _take_lane(lane, monkeypatch):
    """Send the alias's updates down one lane: the direct kernel call (default), the rule's
    fast step over the streaming kernel, or over torch's fused kernel."""
    from minitrain.optim import base
    from minitrain.optim.kernels import streaming

    if lane != "direct":
        monkeypatch.setattr(base, "_streams", lambda rule, leaves: False)
    if lane == "torch_fused":
        monkeypatch.setattr(streaming, "usable", lambda tensors: False)


@pytest.mark.parametrize("lane", ["direct", "fast_step", "torch_fused"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_a_leading_clip_folds_into_the_lowered_update(decoupled, lane, monkeypatch):
    params, grads = _data(3)
    _take_lane(lane, monkeypatch)

    def make():
        return mt.optim.chain(
            mt.optim.clip_by_global_norm(0.5), mt.optim.scale_by_adam(),
            mt.optim.add_decayed_weights(0.1), mt.optim.scale_by_learning_rate(0.01),
        ) if decoupled else mt.optim.chain(
            mt.optim.clip_by_global_norm(0.5), mt.optim.add_decayed_weights(0.1),
            mt.optim.scale_by_adam(), mt.optim.scale_by_learning_rate(0.01),
        )

    lowered, _ = _run(mt.optim.as_optimizer(make()), params, grads)
    factory = mt.optim.adamw if decoupled else mt.optim.adam
    clipped_first = [mt.optim.clip_by_global_norm(g, 0.5)[0] for g in grads]
    fast, _ = _run(factory(lr=0.01, weight_decay=0.1, impl="fast"), params, clipped_first)
    plain, _ = _run(mt.optim.as_optimizer(make()), params, grads, requires_grad=True)
    for a, b, c in zip(lowered, fast, plain, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
