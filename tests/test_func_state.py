"""Buffers a forward pass updates (BatchNorm statistics) as explicit state of a pure apply."""

import pytest
import torch
from torch import nn

import minitrain as mt


def small_cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),  # cumulative average
        nn.Flatten(), nn.Linear(4 * 4 * 4, 3), nn.BatchNorm1d(3),
    )


def batches(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 3, 8, 8, generator=generator),
             torch.randint(0, 3, (6,), generator=generator)) for _ in range(steps)]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_training_with_state_equals_the_module_trained_the_classic_way(momentum):
    data = batches(4)
    reference = small_cnn()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum, weight_decay=1e-3)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()

    params, state, apply = mt.from_module(small_cnn(), with_state=True)

    def loss_fn(params, state, x, y):
        logits, new_state = apply(params, state, x)
        return nn.functional.cross_entropy(logits, y), new_state

    optimizer = mt.optim.sgd(lr=0.1, momentum=momentum, weight_decay=1e-3)
    opt_state = optimizer.init(params)
    step = mt.value_and_grad(loss_fn, has_aux=True)
    for x, y in data:
        before = {name: t.clone() for name, t in state.items()}
        (_, new_state), grads = step(params, state, x, y)
        assert all(torch.equal(before[name], state[name]) for name in state)  # never mutated
        params, opt_state = optimizer.update(grads, opt_state, params)
        state = new_state

    for name, p in reference.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)
    buffers = dict(reference.named_buffers())
    assert sorted(state) == sorted(buffers)
    for name, b in buffers.items():
        torch.testing.assert_close(state[name], b, rtol=1e-5, atol=1e-6)
    assert int(state["1.num_batches_tracked"]) == len(data)


def test_eval_mode_reads_the_state_and_returns_it_unchanged():
    module = small_cnn().eval()
    params, state, apply = mt.from_module(module, with_state=True)
    state = {name: t + 0.5 if t.is_floating_point() else t for name, t in state.items()}
    x = batches(1)[0][0]
    out, new_state = apply(params, state, x)
    torch.testing.assert_close(out, torch.func.functional_call(module, (params, state), (x,)))
    assert all(torch.equal(new_state[name], state[name]) for name in state)


def test_without_state_from_module_is_unchanged():
    module = nn.Linear(3, 2)
    params, apply = mt.from_module(module)
    x = torch.randn(4, 3)
    torch.testing.assert_close(apply(params, x), module(x))


def test_train_mode_batchnorm_without_state_is_the_known_failure():
    # Why the state exists: the buffers held by apply are captured, and grad refuses to update
    # them in place.
    params, apply = mt.from_module(nn.BatchNorm1d(2))
    with pytest.raises(RuntimeError, match="captured"):
        mt.grad(lambda p: apply(p, torch.randn(4, 2)).sum())(params)


def test_a_wrong_state_is_a_one_line_error():
    params, state, apply = mt.from_module(nn.BatchNorm1d(2), with_state=True)
    with pytest.raises(ValueError, match=r"apply\(params, state, \*inputs\)"):
        apply(params, torch.randn(4, 2))


def test_state_is_vmapped_like_the_params():
    # A sweep of K models: each model's params and state carry the leading axis.
    params, state, apply = mt.from_module(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
                                          with_state=True)
    k = 3
    stacked = [{n: t.expand(k, *t.shape).clone() for n, t in tree.items()}
               for tree in (params, state)]
    x = torch.randn(k, 5, 3, generator=torch.Generator().manual_seed(0))
    outs, new_states = mt.vmap(apply)(*stacked, x)
    for i in range(k):
        out, new_state = apply(params, state, x[i])
        torch.testing.assert_close(outs[i], out)
        for name in state:
            torch.testing.assert_close(new_states[name][i], new_state[name])
