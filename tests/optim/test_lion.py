"""mt.optim.lion against lion-pytorch's ``Lion`` over random hyperparameters, and its
decoupled weight decay (the registry's suite runs the rest: maximize, schedules, hostile input)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lion_pytorch import Lion

import minitrain as mt


def make(seed: int, shapes=((4, 3), (5,), (), (2, 3, 4))) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=g) for shape in shapes]
    grads = [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(10)]
    return params, grads


def run_reference(params, grads_seq, **kwargs):
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Lion(leaves, **kwargs)
    for grads in grads_seq:
        for p, g in zip(leaves, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in leaves], [opt.state[p]["exp_avg"] for p in leaves]


def run_minitrain(params, grads_seq, plain=False, **kwargs):
    opt = mt.optim.lion(**kwargs)
    if plain:
        params = [p.clone().requires_grad_() for p in params]
    state = opt.init(params)
    with torch.enable_grad() if plain else torch.no_grad():
        for grads in grads_seq:
            params, state = opt.update(grads, state, params)
    return [p.detach() for p in params], state


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), lr=st.sampled_from([1e-4, 3e-3, 0.1]),
       beta1=st.sampled_from([0.0, 0.9, 0.95]), beta2=st.sampled_from([0.9, 0.99]),
       weight_decay=st.sampled_from([0.0, 0.1, 1.0]), plain=st.booleans())
def test_matches_lion_pytorch(seed, lr, beta1, beta2, weight_decay, plain):
    params, grads = make(seed)
    kwargs = dict(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
    want, want_m = run_reference(params, grads, **kwargs)
    got, state = run_minitrain(params, grads, plain=plain, **kwargs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lion_state = next(s for s in state if isinstance(s, mt.optim.ScaleByLionState))
    for a, b in zip(lion_state.exp_avg, want_m, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


def test_decoupled_weight_decay_of_lion_pytorch_is_weight_decay_over_lr():
    params, grads = make(3)
    want, _ = run_reference(params, grads, lr=0.01, weight_decay=0.05,
                            decoupled_weight_decay=True)
    got, _ = run_minitrain(params, grads, lr=0.01, weight_decay=0.05 / 0.01)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_step_moves_each_coordinate_by_exactly_lr_without_decay():
    params, grads = make(5, shapes=((64,),))
    got, _ = run_minitrain(params, grads[:1], lr=0.5)
    assert torch.allclose((got[0] - params[0]).abs(), torch.tensor(0.5))
