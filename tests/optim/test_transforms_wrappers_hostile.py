"""Wrapper transformations given hostile input: apply_if_finite's counts against optax's
rules (eager, vmap, grad), a state from another transformation, grads shaped unlike the
params, and inject_hyperparams with a callable that is no schedule (``static_args``)."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from minitrain.optim import (
    MultiSteps,
    add_decayed_weights,
    apply_if_finite,
    chain,
    ema,
    inject_hyperparams,
    masked,
    multi_transform,
    scale,
    scale_by_adam,
)

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


def test_inject_hyperparams_hints_at_static_args_for_a_callable_that_is_no_schedule():
    build = inject_hyperparams(add_decayed_weights)(weight_decay=0.1, mask=_mask)
    with pytest.raises(ValueError, match=r"static_args=\('mask',\)"):
        build.init([torch.ones(2, 2)])


def test_inject_hyperparams_refuses_static_args_that_are_no_arguments():
    with pytest.raises(ValueError, match=r"static_args \['msk'\] are not arguments of "
                                         r"'add_decayed_weights'"):
        inject_hyperparams(add_decayed_weights, static_args="msk")


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
