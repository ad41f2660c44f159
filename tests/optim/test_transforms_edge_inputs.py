"""Edge inputs to the gradient transformations: a grad buffer the caller reuses, momentum 0
with dampening, masks and groups that select no leaf, a tensor ``max_norm`` that is
differentiated or vmapped, None, sparse and mismatched grads, and schedules that return a
one-element tensor. References: torch.optim.SGD, torch.nn.utils.clip_grad_norm_, finite
differences."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt

optim = mt.optim


def _sgd_reference(grads, momentum, dampening=0.0, lr=1.0):
    """torch.optim.SGD's params after one step per grad, from zeros."""
    p = torch.nn.Parameter(torch.zeros_like(grads[0]))
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, dampening=dampening)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("wrap", ["plain", "masked", "multi_transform", "as_optimizer"])
def test_trace_keeps_a_copy_of_the_first_grad_not_the_callers_buffer(wrap):
    momentum = optim.trace(0.9)
    if wrap == "masked":
        momentum = optim.masked(momentum, {"w": True})
    elif wrap == "multi_transform":
        momentum = optim.multi_transform({"m": momentum}, {"w": "m"})
    tx = optim.chain(momentum, optim.scale(-1.0))
    params = {"w": torch.zeros(3)}
    buffer = torch.ones(3)  # one grad buffer, refilled each step (zero_grad(set_to_none=False))
    if wrap == "as_optimizer":
        opt = optim.as_optimizer(tx)
        state = opt.init(params)
        params, state = opt.update({"w": buffer}, state, params)
        buffer.zero_().add_(2.0)
        params, state = opt.update({"w": buffer}, state, params)
    else:
        state = tx.init(params)
        total = torch.zeros(3)
        for fill in (1.0, 2.0):
            buffer.zero_().add_(fill)
            updates, state = tx.update({"w": buffer}, state, params)
            total = total + updates["w"]
        params = {"w": total}
    expected = _sgd_reference([torch.ones(3), torch.full((3,), 2.0)], momentum=0.9)
    torch.testing.assert_close(params["w"], expected, rtol=0, atol=0)  # -3.9, not -4.8


def test_trace_without_momentum_ignores_dampening_as_torch_sgd():
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0]), torch.tensor([-1.0, 1.0])]
    opt = optim.as_optimizer(optim.chain(optim.trace(0.0, dampening=0.5), optim.scale(-0.1)))
    params = {"w": torch.zeros(2)}
    state = opt.init(params)
    for g in grads:
        params, state = opt.update({"w": g}, state, params)
    expected = _sgd_reference(grads, momentum=0.0, dampening=0.5, lr=0.1)
    torch.testing.assert_close(params["w"], expected)  # torch's add(alpha=-lr) rounds once


def test_trace_with_vmapped_momentum_matches_each_member():
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])]
    momenta = torch.tensor([0.0, 0.9])

    def run(momentum):
        tx = optim.trace(momentum, dampening=0.5)
        state, out = tx.init([torch.zeros(2)]), None
        for g in grads:
            out, state = tx.update([g], state)
        return out[0]

    batched = torch.func.vmap(run)(momenta)
    for i, m in enumerate(momenta.tolist()):
        torch.testing.assert_close(batched[i], run(m))


def test_decay_with_a_mask_that_selects_no_leaf_passes_updates_through():
    tx = optim.add_decayed_weights(0.1, mask=lambda name, p: p.ndim >= 2)
    params = {"b": torch.ones(3)}
    updates = {"b": torch.tensor([1.0, 2.0, 3.0])}
    assert tx.update(updates, tx.init(params), params)[0]["b"].tolist() == [1.0, 2.0, 3.0]
    assert optim.add_decayed_weights(0.1).update({}, (), {})[0] == {}


@pytest.mark.parametrize("updates,words", [
    ({"v": torch.ones(3)}, "params has 'w' where updates has 'v'"),
    ({"w": torch.ones(4)}, r"at leaf 'w': shape \(3,\) vs \(4,\)"),
])
def test_decay_names_updates_that_do_not_fit_the_params(updates, words):
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match=words):
        optim.add_decayed_weights(0.1).update(updates, (), params)


def test_clip_passes_empty_grads_through_with_a_zero_norm_as_clip_grad_norm():
    grads, norm = optim.clip_by_global_norm({}, 1.0)
    assert grads == {}
    assert norm == torch.nn.utils.clip_grad_norm_([], 1.0) == 0.0
    # A multi_transform label (or a masked group) that holds no leaf is an empty tree.
    tx = optim.multi_transform(
        {"matrix": optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.1)),
         "other": optim.scale(-0.1)},
        lambda name, p: "matrix" if p.ndim == 2 else "other")
    params = {"b": torch.ones(3)}
    torch.testing.assert_close(tx.update(params, tx.init(params), params)[0]["b"],
                               torch.full((3,), -0.1))


def test_clip_takes_max_norm_as_a_keyword():
    tx = optim.clip_by_global_norm(max_norm=1.0)
    torch.testing.assert_close(tx.update([torch.tensor([3.0, 4.0])], ())[0][0],
                               torch.tensor([0.6, 0.8]))


def _clipped_sgd_loss(max_norm, requires_grad=False):
    m = torch.tensor(max_norm, dtype=torch.float64, requires_grad=requires_grad)
    opt = optim.as_optimizer(optim.chain(optim.clip_by_global_norm(m), optim.trace(0.9),
                                 optim.scale_by_learning_rate(0.1)))
    params = {"w": torch.ones(2, dtype=torch.float64)}
    state = opt.init(params)
    for g in ([3.0, 4.0], [1.0, -2.0], [0.5, 0.5]):
        params, state = opt.update({"w": torch.tensor(g, dtype=torch.float64)}, state, params)
    return (params["w"] ** 2).sum(), m


def test_a_tensor_max_norm_is_differentiable_as_finite_differences_say():
    loss, m = _clipped_sgd_loss(1.0, requires_grad=True)
    loss.backward()
    eps = 1e-6
    fd = (_clipped_sgd_loss(1.0 + eps)[0] - _clipped_sgd_loss(1.0 - eps)[0]) / (2 * eps)
    assert m.grad != 0
    torch.testing.assert_close(m.grad, fd, rtol=1e-6, atol=1e-9)
    grads = {"w": torch.tensor([3.0, 4.0])}
    by_func = torch.func.grad(
        lambda m: optim.clip_by_global_norm(m).update(grads, ())[0]["w"].sum())(torch.tensor(1.0))
    torch.testing.assert_close(by_func, torch.tensor(7.0 / 5.0))  # d(3m/5 + 4m/5)/dm


def test_a_vmapped_max_norm_clips_each_member():
    grads = {"w": torch.tensor([3.0, 4.0])}
    out = torch.func.vmap(lambda m: optim.clip_by_global_norm(m).update(grads, ())[0]["w"])(
        torch.tensor([1.0, 10.0]))
    torch.testing.assert_close(out, torch.tensor([[0.6, 0.8], [3.0, 4.0]]))


@pytest.mark.parametrize("name", [
    "scale_by_adam", "scale_by_sign", "trace", "clip", "scale", "add_decayed_weights",
    "clip_by_global_norm", "chain", "adamw", "nadam"])
def test_a_none_grad_is_a_value_error_naming_its_leaf(name):
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    grads = {"a": None, "b": torch.ones(2)}
    factories = {
        "clip": lambda: optim.clip(1.0), "scale": lambda: optim.scale(0.5),
        "add_decayed_weights": lambda: optim.add_decayed_weights(0.1),
        "clip_by_global_norm": lambda: optim.clip_by_global_norm(1.0),
        "chain": lambda: optim.as_optimizer(optim.chain(optim.scale_by_adam(), optim.scale(-0.1))),
        "adamw": lambda: optim.adamw(lr=0.1), "nadam": lambda: optim.nadam(lr=0.1),
    }
    tx = factories.get(name, getattr(optim, name))()
    with pytest.raises(ValueError, match="the grad of 'a' is None"):
        tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize("name", ["scale_by_adam", "trace", "scale_by_rms", "ema"])
def test_a_none_param_at_init_is_a_value_error_naming_it(name):
    tx = optim.ema(0.9) if name == "ema" else getattr(optim, name)()
    with pytest.raises(ValueError, match="param 'a' is None"):
        tx.init({"a": None, "b": torch.ones(2)})


def test_a_state_in_another_dtype_than_its_update_is_named():
    params = {"w": torch.ones(3)}
    tx = optim.scale_by_adam()
    with pytest.raises(ValueError, match=r"state.exp_avg leaf .*'w'.* is torch.float32 but its "
                                         r"update is torch.bfloat16"):
        tx.update({"w": torch.ones(3, dtype=torch.bfloat16)}, tx.init(params), params)


@pytest.mark.parametrize("path", ["batched", "plain"])
def test_a_schedules_one_element_tensor_is_a_0d_lr_on_every_path(path):
    tx = optim.scale_by_learning_rate(lambda step: torch.tensor([0.5]))
    leaf = torch.tensor(2.0, requires_grad=path == "plain")
    updates, state = tx.update([leaf], tx.init([leaf]))
    assert updates[0].shape == () and state.lr.shape == ()
    torch.testing.assert_close(updates[0].detach(), torch.tensor(-1.0))  # -lr * u


def test_inject_hyperparams_takes_one_beta_of_adam():
    params = [torch.zeros(2)]
    grads = [torch.tensor([1.0, -2.0])]
    injected = optim.inject_hyperparams(optim.scale_by_adam)(b1=0.8)
    reference = optim.scale_by_adam(b1=0.8)
    torch.testing.assert_close(injected.update(grads, injected.init(params))[0][0],
                               reference.update(grads, reference.init(params))[0][0])
