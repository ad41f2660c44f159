"""Gradient transformations against torch.optim, torch.optim.swa_utils and .grad accumulation."""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import minitrain as mt
from minitrain.optim import (
    add_decayed_weights,
    apply_updates,
    as_optimizer,
    chain,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_rms,
    trace,
)

SHAPES = [(4, 3), (5,), ()]


def _data(seed: int, steps: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    return params, grads


def _torch_run(cls, kwargs, params, grads):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = cls(ps, **kwargs, foreach=False)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def _tx_run(tx, params, grads, requires_grad=False, lowered=True):
    """Run ``as_optimizer(tx)`` (which may lower ``tx`` to fused kernels) or, with
    ``lowered=False``, the transformation itself then ``apply_updates``."""
    opt = as_optimizer(tx)
    params = [p.clone().requires_grad_(requires_grad) for p in params]
    state = opt.init(params)
    for step_grads in grads:
        if lowered:
            params, state = opt.update(step_grads, state, params)
        else:
            updates, state = tx.update(step_grads, state, params)
            params = apply_updates(params, updates)
    return [p.detach() for p in params], state


CHAINS = {
    "adamw": (
        lambda: chain(scale_by_adam(0.8, 0.99, 1e-6, amsgrad=True), add_decayed_weights(0.1),
                      scale_by_learning_rate(0.01)),
        torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                amsgrad=True),
    ),
    "adam_l2": (
        lambda: chain(add_decayed_weights(0.1), scale_by_adam(), scale_by_learning_rate(0.01)),
        torch.optim.Adam, dict(lr=0.01, weight_decay=0.1),
    ),
    "sgd_nesterov": (
        lambda: chain(add_decayed_weights(0.01), trace(0.9, nesterov=True),
                      scale_by_learning_rate(0.1)),
        torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "sgd_dampening": (
        lambda: chain(trace(0.5, dampening=0.3), scale_by_learning_rate(0.1)),
        torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.3),
    ),
    "rmsprop_centered_momentum": (
        lambda: chain(scale_by_rms(0.9, 1e-6, centered=True), trace(0.9),
                      scale_by_learning_rate(0.01)),
        torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, eps=1e-6, centered=True, momentum=0.9),
    ),
}


@pytest.mark.parametrize("requires_grad", [False, True], ids=["batched", "plain"])
@pytest.mark.parametrize("name", CHAINS)
def test_chains_of_transforms_match_torch_optim(name, requires_grad):
    make, cls, kwargs = CHAINS[name]
    params, grads = _data(0, 6)
    with torch.set_grad_enabled(requires_grad):
        ours, _ = _tx_run(make(), params, grads, requires_grad, lowered=False)
        lowered, _ = _tx_run(make(), params, grads, requires_grad)
    for a, b in zip(ours, lowered, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, _torch_run(cls, kwargs, params, grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CHAINS)
def test_batched_and_plain_paths_agree_to_the_bit(name):
    make = CHAINS[name][0]
    params, grads = _data(1, 4)
    batched, state_b = _tx_run(make(), params, grads, lowered=False)
    with torch.enable_grad():
        plain, state_p = _tx_run(make(), params, grads, requires_grad=True, lowered=False)
    for a, b in zip(batched, plain, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(mt.tree.leaves(state_b), mt.tree.leaves(state_p), strict=True):
        assert torch.equal(a, b.detach())


def test_multisteps_equals_grad_accumulation_then_one_torch_step():
    k, steps = 3, 2
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(4, 2, generator=g)
    batches = [torch.randn(5, 4, generator=g) for _ in range(k * steps)]

    def loss(w, x):
        return ((x @ w).tanh() ** 2).mean()

    model = torch.nn.Parameter(w0.clone())
    ref = torch.optim.Adam([model], lr=0.1)
    for i, x in enumerate(batches):
        loss(model, x).backward()
        if (i + 1) % k == 0:
            ref.step()
            ref.zero_grad()

    opt = as_optimizer(mt.optim.MultiSteps(chain(scale_by_adam(), scale_by_learning_rate(0.1)),
                                           every_k=k))
    params = {"w": w0.clone()}
    state = opt.init(params)
    for x in batches:
        grads = mt.grad(lambda p, x=x: loss(p["w"], x))(params)
        params, state = opt.update(grads, state, params)
    torch.testing.assert_close(params["w"], model.detach(), rtol=1e-5, atol=1e-6)
    assert int(state.gradient_step) == steps


def test_ema_equals_averaged_model_with_an_ema_average():
    params, grads = _data(2, 5)
    module = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in params])
    averaged = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    sgd = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5)
    for step_grads in grads:
        for p, g in zip(module.parameters(), step_grads, strict=True):
            p.grad = g.clone()
        sgd.step()
        averaged.update_parameters(module)
    _, state = _tx_run(chain(trace(0.5), scale_by_learning_rate(0.1), mt.optim.ema(0.9)),
                       params, grads)
    for ours, theirs in zip(state[-1].ema, averaged.module.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)


def test_apply_if_finite_skips_and_counts_non_finite_updates():
    tx = mt.optim.apply_if_finite(chain(scale_by_adam(), scale_by_learning_rate(0.1)))
    params = [torch.ones(3)]
    state = tx.init(params)
    updates, state = tx.update([torch.ones(3)], state, params)
    before = state.inner_state
    bad, state = tx.update([torch.tensor([1.0, float("inf"), 0.0])], state, params)
    assert torch.equal(bad[0], torch.zeros(3))
    assert int(state.total_notfinite) == 1 and not bool(state.last_finite)
    assert all(torch.equal(a, b) for a, b in zip(mt.tree.leaves(state.inner_state),
                                                  mt.tree.leaves(before), strict=True))
    again, state = tx.update([torch.ones(3)], state, params)
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1


@pytest.mark.parametrize("bad_step", [0, 1], ids=["between-inner-steps", "at-an-inner-step"])
def test_apply_if_finite_around_multisteps_drops_a_non_finite_micro_batch(bad_step):
    tx = mt.optim.apply_if_finite(mt.optim.MultiSteps(mt.optim.scale(-0.1), every_k=2))
    params = [torch.zeros(2)]
    state = tx.init(params)
    seen = []
    for step in range(7):
        grad = torch.full((2,), float("nan") if step == bad_step else 1.0)
        updates, state = tx.update([grad], state, params)
        params = apply_updates(params, updates)
        seen.append(float(params[0][0]))
    # The bad micro-batch is skipped, the next ones pair up: three inner steps of -0.2.
    assert seen[-1] == pytest.approx(-0.6) and int(state.total_notfinite) == 1


def test_multi_transform_routes_leaves_and_masked_skips_the_rest():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    grads = {"w": torch.full((2, 2), 2.0), "b": torch.full((2,), 2.0)}
    tx = mt.optim.multi_transform(
        {"sgd": scale_by_learning_rate(0.5), "frozen": mt.optim.scale(0.0)},
        {"w": "sgd", "b": "frozen"},
    )
    updates, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(updates["w"], torch.full((2, 2), -1.0))
    assert torch.equal(updates["b"], torch.zeros(2))
    masked = mt.optim.masked(scale_by_learning_rate(0.5), lambda name, p: p.ndim == 1)
    updates, _ = masked.update(grads, masked.init(params), params)
    assert torch.equal(updates["w"], grads["w"]) and torch.equal(updates["b"], -torch.ones(2))
    with pytest.raises(ValueError, match="label 'x'"):
        mt.optim.multi_transform({"a": mt.optim.identity()}, lambda n, p: "x").init(params)


def test_inject_hyperparams_changes_lr_mid_run_and_vmaps_over_members():
    tx = mt.optim.inject_hyperparams(scale_by_learning_rate)(learning_rate=0.1)
    params = [torch.ones(2)]
    state = tx.init(params)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    state = state._replace(hyperparams={"learning_rate": torch.tensor(0.25)})
    updates, state = tx.update([torch.ones(2)], state, params)
    assert torch.equal(updates[0], torch.full((2,), -0.25))

    lrs = torch.tensor([0.1, 0.2], dtype=torch.float64)

    def member(lr, p):
        opt = as_optimizer(mt.optim.inject_hyperparams(
            lambda learning_rate: chain(scale_by_adam(), scale_by_learning_rate(learning_rate))
        )(learning_rate=lr))
        new, _ = opt.update([torch.ones(2)], opt.init([p]), [p])
        return new[0]

    out = torch.func.vmap(member)(lrs, torch.ones(2, 2))
    torch.testing.assert_close(out, torch.tensor([[0.9, 0.9], [0.8, 0.8]]))


def test_clip_by_global_norm_has_both_forms_and_matches_torch():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped, norm = mt.optim.clip_by_global_norm(grads, 1.0)
    tx = mt.optim.clip_by_global_norm(1.0)
    updates, _ = tx.update(grads, tx.init(grads))
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(ps, grads.values(), strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ps, 1.0)
    for ours, both, p in zip(updates.values(), clipped.values(), ps, strict=True):
        torch.testing.assert_close(ours, p.grad)
        assert torch.equal(ours, both)
    assert float(norm) == 5.0


def test_hyperparameters_are_checked_like_torch_optim():
    with pytest.raises(ValueError, match="lr"):
        scale_by_learning_rate(torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="betas"):  # torch.optim.Adam refuses the mix
        mt.optim.adam(betas=(0.9, torch.tensor(0.99)))
    # The transform takes it (inject_hyperparams makes one beta a tensor), as optax does.
    mixed, plain = scale_by_adam(0.9, torch.tensor(0.99)), scale_by_adam(0.9, 0.99)
    grads = [torch.tensor([1.0, -2.0])]
    torch.testing.assert_close(mixed.update(grads, mixed.init(grads))[0][0],  # a float32 beta
                               plain.update(grads, plain.init(grads))[0][0])
    with pytest.raises(ValueError, match="betas"):
        scale_by_adam(1.5)
    tx = scale_by_adam(torch.tensor([[[0.9]]]), torch.tensor([[0.999]]))
    updates, state = tx.update([torch.ones(4, 3)], tx.init([torch.zeros(4, 3)]))
    assert updates[0].shape == (4, 3)
    with pytest.raises(ValueError, match="nesterov"):
        trace(0.0, nesterov=True)
    with pytest.raises(ValueError, match="chain argument 0"):
        chain(mt.optim.sgd())


def test_leafwise_state_shape_mismatch_names_the_leaf():
    tx = scale_by_adam()
    state = tx.init({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"state.exp_avg leaf .*'w'.*shape \(3,\)"):
        tx.update({"w": torch.zeros(4)}, state)


def test_apply_updates_is_pure_and_keeps_dtypes():
    params = {"w": torch.ones(2, dtype=torch.bfloat16)}
    out = apply_updates(params, {"w": torch.full((2,), 0.25)})
    assert out["w"].dtype == torch.bfloat16 and torch.equal(params["w"], torch.ones(2).bfloat16())


def test_injected_hyperparameters_are_swept_by_fit_sweep():
    from minitrain.train.members import build_ensemble, member_grid
    from minitrain.train.sweep import fit_sweep

    config = {"lr": 0.1, "steps": 3}

    def experiment(config):
        tx = mt.optim.inject_hyperparams(
            lambda learning_rate: chain(scale_by_adam(), scale_by_learning_rate(learning_rate))
        )(learning_rate=config["lr"])
        return mt.Experiment(
            init=lambda g: {"w": torch.zeros(2)},
            loss=lambda p, x: ((x @ p["w"] - 1) ** 2).mean(),
            next_batch=lambda g: torch.randn(4, 2, generator=g),
            optimizer=as_optimizer(tx), steps=config["steps"])

    members = member_grid(config, {}, {"lr": [0.01, 0.1]}, seeds=[0])
    result = fit_sweep(build_ensemble(experiment, members), mt.get_backend("cpu"),
                       progress=False)
    lrs = result.opt_state.hyperparams["learning_rate"]
    torch.testing.assert_close(lrs, torch.tensor([0.01, 0.1]), check_dtype=False)
    # Adam moves each coordinate by about lr per step: the members moved 3 * lr.
    torch.testing.assert_close(result.params["w"].abs().amax(dim=1),
                               torch.tensor([0.03, 0.3]), rtol=0.05, atol=0)


def test_a_chain_state_round_trips_through_a_checkpoint(tmp_path):
    tx = mt.optim.apply_if_finite(mt.optim.MultiSteps(
        chain(mt.optim.clip_by_global_norm(1.0), scale_by_adam(amsgrad=True),
              add_decayed_weights(0.1), scale_by_learning_rate(0.01), mt.optim.ema(0.9)),
        every_k=2))
    opt = as_optimizer(tx)
    params, grads = _data(3, 3)
    state = opt.init(params)
    for step_grads in grads:
        params, state = opt.update(step_grads, state, params)
    path = mt.checkpoint.save(tmp_path, 3, params, state)
    loaded = mt.checkpoint.load(path, params, opt.init(params))
    for a, b in zip(mt.tree.leaves(state), mt.tree.leaves(loaded.opt_state), strict=True):
        assert torch.equal(a, b)
    assert type(loaded.opt_state) is type(state)


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float64, torch.float32)])
@pytest.mark.parametrize("path", ["fast", "autograd"])
def test_clip_by_global_norm_in_fp64_equals_clip_grad_norm(dtypes, path):
    """fp64 grads: the norm is taken in fp64 (torch's clip_grad_norm_ takes each norm in its
    grads' dtype), so norm and clipped grads equal torch's to the bit."""
    g = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(37, 11, generator=g, dtype=dtypes[0]) * 3.0,
             "b": torch.randn(11, generator=g, dtype=dtypes[1])}
    ps = [torch.nn.Parameter(torch.zeros_like(v)) for v in grads.values()]
    for p, v in zip(ps, grads.values(), strict=True):
        p.grad = v.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
    assert want_norm.dtype == torch.float64
    if path == "autograd":
        grads = {k: v.clone().requires_grad_(True) for k, v in grads.items()}
    clipped, norm = mt.optim.clip_by_global_norm(grads, 1.0)
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm, want_norm, rtol=0, atol=0)
    for (name, value), p in zip(clipped.items(), ps, strict=True):
        assert value.dtype == p.dtype, name
        torch.testing.assert_close(value.detach(), p.grad, rtol=0, atol=0)
    tx = mt.optim.clip_by_global_norm(1.0)
    updates, _ = tx.update(grads, tx.init(grads))
    for value, p in zip(updates.values(), ps, strict=True):
        torch.testing.assert_close(value.detach(), p.grad, rtol=0, atol=0)
