"""mt.optim.schedule_free_adamw against ``schedulefree.AdamWScheduleFree``, step for step, with
its warmup and its train/eval parameter switch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from schedulefree import AdamWScheduleFree

import minitrain as mt

SHAPES = ((4, 3), (5,), (), (2, 3, 4))


def make(seed: int, steps: int = 10) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=g) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=g) for shape in SHAPES] for _ in range(steps)]
    return params, grads


def reference(params, grads_seq, foreach, **kwargs):
    """Train (y) params after each step, eval (x) params at the end, and the final state."""
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    opt = AdamWScheduleFree(leaves, foreach=foreach, **kwargs)
    opt.train()
    trained = []
    for grads in grads_seq:
        for p, g in zip(leaves, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        trained.append([p.detach().clone() for p in leaves])
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in leaves]
    opt.eval()
    return trained, [p.detach().clone() for p in leaves], state


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), lr=st.sampled_from([0.0025, 0.05]),
       betas=st.sampled_from([(0.9, 0.999), (0.95, 0.99)]),
       weight_decay=st.sampled_from([0.0, 0.1]), warmup_steps=st.sampled_from([0, 4, 20]),
       r=st.sampled_from([0.0, 1.0]), weight_lr_power=st.sampled_from([2.0, 0.0]),
       foreach=st.booleans(), plain=st.booleans())
def test_matches_schedulefree_step_for_step_with_eval_params(
    seed, lr, betas, weight_decay, warmup_steps, r, weight_lr_power, foreach, plain
):
    kwargs = dict(lr=lr, betas=betas, weight_decay=weight_decay, warmup_steps=warmup_steps,
                  r=r, weight_lr_power=weight_lr_power)
    params, grads_seq = make(seed)
    trained, evaluated, ref_state = reference(params, grads_seq, foreach, **kwargs)
    opt = mt.optim.schedule_free_adamw(**kwargs)
    y = [p.clone().requires_grad_(plain) for p in params]
    state = opt.init(y)
    with torch.enable_grad() if plain else torch.no_grad():
        for grads, want in zip(grads_seq, trained, strict=True):
            y, state = opt.update(grads, state, y)
            for a, b in zip(y, want, strict=True):
                torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    x = mt.optim.schedule_free_eval_params(state, y)
    for a, b in zip(x, evaluated, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    inner = next(s for s in state if isinstance(s, mt.optim.ScheduleFreeAdamwState))
    for field in ("z", "exp_avg_sq"):
        for a, b in zip(getattr(inner, field), ref_state, strict=True):
            torch.testing.assert_close(a.detach(), b[field], rtol=1e-5, atol=1e-6)


def test_eval_params_before_any_update_are_the_params():
    params, _ = make(0)
    opt = mt.optim.schedule_free_adamw()
    x = mt.optim.schedule_free_eval_params(opt.init(params), params)
    assert all(torch.equal(a, b) for a, b in zip(x, params, strict=True))


def test_eval_params_are_pure():
    params, grads_seq = make(1, steps=2)
    opt = mt.optim.schedule_free_adamw(lr=0.1)
    state = opt.init(params)
    params, state = opt.update(grads_seq[0], state, params)
    before = [p.clone() for p in params]
    mt.optim.schedule_free_eval_params(state, params)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


def test_eval_params_need_a_schedule_free_state():
    opt = mt.optim.adamw()
    params = [torch.zeros(2)]
    with pytest.raises(ValueError, match="schedule_free_adamw"):
        mt.optim.schedule_free_eval_params(opt.init(params), params)


def test_a_schedule_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="warmup_steps"):
        mt.optim.schedule_free_adamw(lr=mt.optim.constant_schedule(0.1))
