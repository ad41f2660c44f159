"""Adafactor beside the rest of mt.optim: a moment whose memory is another leaf's param, a
group with no leaves, and hyperparameters that run the caller's code before the checks."""

from __future__ import annotations

import torch

import minitrain as mt
from minitrain import tree
from tests.optim.conftest import clones, randn, warm_state


def make_adafactor():
    return mt.optim.adafactor(lr=0.01)


def test_adafactors_moment_over_another_leafs_param_donated_gives_the_pure_result():
    """A row moment of leaf b (edited by hand) in the memory of param a: the donated update
    wrote a first and then read b's moment from it (2.4e-4 off the pure update)."""
    params = {"a": randn(0, 64, 64), "b": randn(1, 64, 64)}
    state = warm_state(make_adafactor, params)
    named = tree.named_leaves(state)
    edited = [params["a"][:, :1].abs_() if path.endswith("row_var.b") else t
              for path, t in named]
    state = tree.unflatten(tree.structure(state), edited)
    grads = {"a": randn(2, 64, 64), "b": randn(3, 64, 64)}
    pure = make_adafactor().update(clones(grads), clones(state), clones(params))[0]
    donated = make_adafactor().update(grads, state, params, donate=True)[0]
    for key in params:  # the moment is a strided view: its clone takes the kernel, it does not
        torch.testing.assert_close(donated[key], pure[key], rtol=1e-6, atol=1e-6)


def test_scale_by_adafactor_on_a_group_with_no_leaves():
    tx = mt.optim.scale_by_adafactor()
    state = tx.init({})
    updates, state = tx.update({}, state, {})
    assert updates == {} and int(state.count) == 1


def test_multi_transform_routes_nothing_to_adafactor():
    """``init`` raised a TypeError (``ScaleByAdafactorState`` missing its buffers)."""
    tx = mt.optim.multi_transform(
        {"adam": mt.optim.scale_by_adam(), "adafactor": mt.optim.scale_by_adafactor()},
        {"w": "adam", "b": "adam"})
    params = {"w": torch.ones(4, 3), "b": torch.ones(3)}
    grads = {"w": torch.full((4, 3), 2.0), "b": torch.full((3,), -2.0)}
    updates, _ = tx.update(grads, tx.init(params), params)
    alone = mt.optim.scale_by_adam()
    expected, _ = alone.update(grads, alone.init(params), params)
    for key in params:
        assert torch.equal(updates[key], expected[key])
