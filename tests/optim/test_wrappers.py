"""The wrapper transformations (MultiSteps, ema, apply_if_finite, masked, multi_transform,
inject_hyperparams) against gradient accumulation, ``torch.optim.swa_utils`` and optax's rules,
under vmap, grad, sweeps and checkpoints; and given hostile input: a state from another
transformation, grads shaped unlike the params, a callable that is no schedule, hand-edited
counts."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import minitrain as mt
from minitrain.optim import (
    MultiSteps,
    add_decayed_weights,
    apply_if_finite,
    apply_updates,
    as_optimizer,
    chain,
    ema,
    inject_hyperparams,
    masked,
    multi_transform,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)
from tests.optim.conftest import small_data, tx_run

# --------------------------------------------------------------------------------------------
# Against their references


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
    params, grads = small_data(2, 5)
    module = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in params])
    averaged = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    sgd = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.5)
    for step_grads in grads:
        for p, g in zip(module.parameters(), step_grads, strict=True):
            p.grad = g.clone()
        sgd.step()
        averaged.update_parameters(module)
    _, state = tx_run(chain(trace(0.5), scale_by_learning_rate(0.1), mt.optim.ema(0.9)),
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
    params, grads = small_data(3, 3)
    state = opt.init(params)
    for step_grads in grads:
        params, state = opt.update(step_grads, state, params)
    path = mt.checkpoint.save(tmp_path, 3, params, state)
    loaded = mt.checkpoint.load(path, params, opt.init(params))
    for a, b in zip(mt.tree.leaves(state), mt.tree.leaves(loaded.opt_state), strict=True):
        assert torch.equal(a, b)
    assert type(loaded.opt_state) is type(state)


# --------------------------------------------------------------------------------------------
# Hostile input


NAN, INF = float("nan"), float("inf")


def _optax_step(count, total, finite, max_errors):
    """One update of optax's ``apply_if_finite``: (applied, notfinite_count, total_notfinite)."""
    count = 0 if finite else count + 1
    total += not finite
    return finite or (max_errors is not None and count > max_errors), count, total


SEQUENCE = [1.0, NAN, INF, NAN, 2.0, NAN, INF, 3.0]


def test_apply_if_finite_keeps_counting_after_letting_a_non_finite_update_through():
    tx = apply_if_finite(scale(-1.0), max_consecutive_errors=1)
    state = tx.init([torch.zeros(1)])
    _, state = tx.update([torch.tensor([NAN])], state)
    updates, state = tx.update([torch.tensor([INF])], state)  # the second in a row goes through
    assert torch.equal(updates[0], torch.tensor([-INF]))
    assert (bool(state.last_finite), int(state.notfinite_count),
            int(state.total_notfinite)) == (False, 2, 2)
    _, state = tx.update([torch.tensor([1.0])], state)
    assert (bool(state.last_finite), int(state.notfinite_count),
            int(state.total_notfinite)) == (True, 0, 2)


def _inner():
    return chain(scale_by_adam(), scale(-1.0))


def _expected(max_errors, values):
    """Updates and states of apply_if_finite(_inner()) by optax's rules, from the inner
    transformation applied (or not) by hand. As documented, an update is finite when both the
    incoming updates and the inner result are."""
    inner = _inner()
    inner_state = inner.init([torch.zeros(2)])
    count = total = 0
    out = []
    for value in values:
        updates, new_state = inner.update([torch.tensor(value)], inner_state)
        finite = bool(torch.isfinite(torch.tensor(value)).all() & torch.isfinite(updates[0]).all())
        applied, count, total = _optax_step(count, total, finite, max_errors)
        if applied:
            inner_state = new_state
        else:
            updates = [torch.zeros(2)]
        out.append((updates, (count, finite, total), inner_state))
    return out


def _check_step(updates, state, want):
    want_updates, (count, last, total), want_inner = want
    torch.testing.assert_close(updates, want_updates, equal_nan=True)
    assert (int(state.notfinite_count), bool(state.last_finite),
            int(state.total_notfinite)) == (count, last, total)
    torch.testing.assert_close(mt.tree.leaves(state.inner_state), mt.tree.leaves(want_inner),
                               equal_nan=True)


@pytest.mark.parametrize("max_errors", [None, 0, 1, 2])
def test_apply_if_finite_state_follows_optax_eagerly(max_errors):
    values = [[v, 0.5] for v in SEQUENCE]
    tx = apply_if_finite(_inner(), max_consecutive_errors=max_errors)
    state = tx.init([torch.zeros(2)])
    for value, want in zip(values, _expected(max_errors, values), strict=True):
        updates, state = tx.update([torch.tensor(value)], state)
        _check_step(updates, state, want)


@pytest.mark.parametrize("max_errors", [None, 1])
def test_apply_if_finite_state_follows_optax_under_vmap(max_errors):
    """Two members with their own non-finite steps, updated under torch.func.vmap."""
    members = [[[v, 0.5] for v in SEQUENCE], [[0.5, v] for v in reversed(SEQUENCE)]]
    tx = apply_if_finite(_inner(), max_consecutive_errors=max_errors)
    state = mt.tree.stack([tx.init([torch.zeros(2)]) for _ in members])
    step = torch.func.vmap(lambda g, s: tx.update([g], s))
    wants = [_expected(max_errors, values) for values in members]
    for i in range(len(SEQUENCE)):
        updates, state = step(torch.tensor([values[i] for values in members]), state)
        for m, member_state in enumerate(mt.tree.unstack(state)):
            _check_step([updates[0][m]], member_state, wants[m][i])


def test_apply_if_finite_state_follows_optax_under_grad():
    tx = apply_if_finite(scale(-1.0), max_consecutive_errors=1)

    def loss(w, x, state):
        updates, state = tx.update([x + w], state)
        return torch.nan_to_num(updates[0]).sum(), state

    state, count, total = tx.init([torch.zeros(1)]), 0, 0
    for value in [1.0, NAN, INF, 2.0, NAN]:
        finite = value == value and abs(value) != INF
        applied, count, total = _optax_step(count, total, finite, 1)
        grad, state = torch.func.grad(loss, has_aux=True)(torch.zeros(1), torch.tensor([value]),
                                                          state)
        assert float(grad) == (-1.0 if applied and finite else 0.0)
        assert (int(state.notfinite_count), bool(state.last_finite),
                int(state.total_notfinite)) == (count, finite, total)


PARAMS = {"w": torch.ones(3), "b": torch.ones(2)}

WRAPPERS = {
    "apply_if_finite": (lambda: apply_if_finite(scale_by_adam()), "ApplyIfFiniteState"),
    "masked": (lambda: masked(scale_by_adam(), lambda name, p: True), "MaskedState"),
    "multi_transform": (lambda: multi_transform({"a": scale_by_adam()}, lambda n, p: "a"),
                        "MultiTransformState"),
    "MultiSteps": (lambda: MultiSteps(scale_by_adam(), every_k=2), "MultiStepsState"),
    "inject_hyperparams": (lambda: inject_hyperparams(scale_by_adam)(b1=0.9),
                           "InjectHyperparamsState"),
    "ema": (lambda: ema(0.9), "EmaState"),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_wrapper_refuses_the_state_of_another_transformation(name):
    build, state_name = WRAPPERS[name]
    tx = build()
    wrong = scale_by_adam().init(PARAMS)  # has a .count, as EmaState does
    with pytest.raises(ValueError, match=rf"^{name} expected a {state_name}, got "
                                         r"ScaleByAdamState; pass the state returned by its "
                                         r"init\(params\)$"):
        tx.update(PARAMS, wrong, PARAMS)
    updates, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS)  # its own state still works
    assert set(updates) == {"w", "b"}


def test_ema_refuses_a_foreign_state_with_count_and_ema_fields():
    from typing import NamedTuple

    class Other(NamedTuple):
        count: torch.Tensor
        ema: dict

    with pytest.raises(ValueError, match="ema expected a EmaState, got Other"):
        ema(0.9).update(PARAMS, Other(torch.tensor(0), dict(PARAMS)), PARAMS)


def test_multi_transform_refuses_a_state_for_other_labels():
    tx = multi_transform({"a": scale(1.0), "b": scale(2.0)}, lambda n, p: "a")
    other = multi_transform({"a": scale(1.0)}, lambda n, p: "a")
    with pytest.raises(ValueError, match=r"multi_transform .* init\(params\)"):
        tx.update(PARAMS, other.init(PARAMS), PARAMS)


def test_multisteps_refuses_grads_shaped_unlike_its_params():
    params = {"w": torch.ones(3)}
    tx = MultiSteps(scale(-1.0), every_k=2)
    with pytest.raises(ValueError, match=r"differ at leaf 'w': shape \(3,\) vs \(2, 3\)"):
        tx.update({"w": torch.ones(2, 3)}, tx.init(params), params)
    with pytest.raises(ValueError, match="differ at leaf 'w'"):
        tx.update({"v": torch.ones(3)}, tx.init(params), params)


def test_ema_refuses_updates_or_a_state_shaped_unlike_the_params():
    params = {"w": torch.ones(3)}
    tx = ema(0.9)
    with pytest.raises(ValueError, match=r"params and updates differ at leaf 'w': shape"):
        tx.update({"w": torch.ones(2, 3)}, tx.init(params), params)
    with pytest.raises(ValueError, match=r"params and state.ema differ at leaf 'w': shape"):
        tx.update(params, tx.init({"w": torch.ones(2, 3)}), params)


def test_multisteps_and_ema_still_run_under_vmap():
    tx = chain(MultiSteps(scale(-1.0), every_k=2), ema(0.5))
    params = {"w": torch.zeros(2, 3)}  # two members of a (3,) param
    state = mt.tree.stack([tx.init({"w": torch.zeros(3)})] * 2)
    step = torch.func.vmap(lambda g, s, p: tx.update(g, s, p))
    for _ in range(2):
        updates, state = step({"w": torch.ones(2, 3)}, state, params)
        params = mt.optim.apply_updates(params, updates)
    assert torch.equal(params["w"], torch.full((2, 3), -2.0))
    assert torch.equal(state[1].ema["w"], torch.full((2, 3), -1.0))


def _mask(name, p):
    return p.ndim >= 2


def test_inject_hyperparams_passes_static_args_as_they_are():
    params = [torch.ones(2, 2), torch.ones(2)]
    want = add_decayed_weights(0.1, mask=_mask).update(params, (), params)[0]
    for static in ("mask", ["mask"]):
        tx = inject_hyperparams(add_decayed_weights, static_args=static)(
            weight_decay=0.1, mask=_mask)
        state = tx.init(params)
        assert set(state.hyperparams) == {"weight_decay"}
        got, state = tx.update(params, state, params)
        torch.testing.assert_close(got, want)


FACTORIES = sorted(name for name in mt.optim.__all__ if inspect.isfunction(getattr(mt.optim, name))
                   and inspect.signature(getattr(mt.optim, name)).parameters)


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("name", FACTORIES)
def test_inject_hyperparams_refuses_static_args_the_factory_does_not_take(name, partial):
    """Every public factory, and a functools.partial of it (named by its function): a misspelt
    static argument is a one-line error naming it and the factory's arguments; each argument
    the factory takes is accepted."""
    factory = getattr(mt.optim, name)
    factory = functools.partial(factory) if partial else factory
    taken = inspect.signature(factory).parameters
    with pytest.raises(ValueError, match=rf"'no_such_argument', which {name} does not take; "
                                         rf"its arguments: {', '.join(taken)}$"):
        inject_hyperparams(factory, static_args=["no_such_argument", *taken])
    inject_hyperparams(factory, static_args=list(taken))


def test_inject_hyperparams_takes_any_static_args_of_a_factory_of_keyword_arguments():
    def scaled(**kwargs):
        return mt.optim.scale(kwargs["step_size"])

    tx = inject_hyperparams(scaled, static_args="step_size")(step_size=2.0)
    assert tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))[0] == [torch.tensor([2.0])]


def test_inject_hyperparams_hints_at_static_args_for_a_callable_that_is_no_schedule():
    build = inject_hyperparams(add_decayed_weights)(weight_decay=0.1, mask=_mask)
    with pytest.raises(ValueError, match=r"static_args=\('mask',\)"):
        build.init([torch.ones(2, 2)])


def test_inject_hyperparams_passes_bools_strings_and_none_as_static():
    params = [torch.ones(2)]
    tx = inject_hyperparams(scale_by_adam)(b1=0.9, amsgrad=True)
    state = tx.init(params)
    assert set(state.hyperparams) == {"b1"} and len(state.inner_state) == 4
    assert set(inject_hyperparams(add_decayed_weights)(weight_decay=0.1, mask=None)
               .init(params).hyperparams) == {"weight_decay"}
    # A scheduled value is still computed per update.
    sched = inject_hyperparams(scale)(step_size=lambda step: 2.0 + step)
    state = sched.init(params)
    for step in range(3):
        updates, state = sched.update([torch.ones(2)], state)
        assert torch.equal(updates[0], torch.full((2,), 2.0 + step))


def _counted_optimizer(name):
    tx = mt.optim
    if name == "scheduled-chain":
        return tx.as_optimizer(tx.chain(tx.scale_by_adam(), tx.scale_by_learning_rate(
            tx.cosine_schedule(0.1, decay_steps=10))))
    if name == "ema-chain":
        return tx.as_optimizer(tx.chain(tx.scale_by_learning_rate(0.1), tx.ema(0.9)))
    if name == "injected":
        return tx.as_optimizer(tx.inject_hyperparams(tx.scale_by_learning_rate)(
            learning_rate=tx.cosine_schedule(0.1, decay_steps=10)))
    raise AssertionError(name)


def _with_counts(state, count):
    """``state`` with every ``count`` field, at any depth, replaced by ``count``."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        fields = {f: _with_counts(getattr(state, f), count) for f in state._fields}
        if "count" in fields:
            fields["count"] = count
        return type(state)(**fields)
    if isinstance(state, tuple):
        return type(state)(_with_counts(s, count) for s in state)
    return state


@pytest.mark.parametrize("count,words", [
    (3, "not a one-element tensor"),
    (torch.zeros((), dtype=torch.int64, device="meta"), "not a one-element tensor"),
    (torch.tensor([1, 2]), "not a one-element tensor"),
    (torch.tensor(-5), "a count of updates is >= 0"),
], ids=["int", "meta", "two-elements", "negative"])
@pytest.mark.parametrize("name", ["scheduled-chain", "ema-chain", "injected"])
def test_a_hand_edited_count_is_a_value_error_naming_it(name, count, words):
    opt = _counted_optimizer(name)
    params = {"w": torch.ones(4, 3)}
    state = _with_counts(opt.init(params), count)
    with pytest.raises(ValueError, match=f"state.count is .*{words}"):
        opt.update({"w": torch.ones(4, 3)}, state, params)


@pytest.mark.parametrize("wrap", [lambda f: f, functools.partial], ids=["function", "partial"])
def test_inject_hyperparams_names_a_factory_that_builds_no_transformation(wrap):
    def not_a_factory(lr):
        return lr

    with pytest.raises(ValueError, match=r"inject_hyperparams\(not_a_factory\) built"):
        inject_hyperparams(wrap(not_a_factory))(lr=0.1).init({"w": torch.ones(1)})
