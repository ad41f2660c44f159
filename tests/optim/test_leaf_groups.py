"""multi_transform and masked hand their inner transformations the leaves keyed by their names
in params, so every group's state is named after its params: a checkpoint resumed with other
labels or another mask is refused, and one written when groups were lists is refused in one
line."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from minitrain import optim
from minitrain._torch import pytree
from minitrain.checkpoint import CheckpointError
from minitrain.optim._wrappers import LeafGroup

HINT = "load with the model and optimizer the checkpoint was saved from"


def build() -> optim.Optimizer:
    """AdamW on the matrices, its decay masked to those with 3 rows; momentum SGD on the rest."""
    adam = optim.chain(optim.scale_by_adam(),
                       optim.masked(optim.add_decayed_weights(0.1),
                                    lambda name, p: p.shape[0] == 3),
                       optim.scale_by_learning_rate(0.01))
    sgd = optim.chain(optim.trace(0.9), optim.scale_by_learning_rate(0.1))
    return optim.as_optimizer(optim.multi_transform(
        {"adam": adam, "sgd": sgd}, lambda name, p: "adam" if p.ndim == 2 else "sgd"))


def params0() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"layer": {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)},
            "head": {"w": torch.randn(2, 1, generator=g), "scale": torch.randn(1, generator=g)}}


def grads(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return mt.tree.map(lambda p: torch.randn(p.shape, generator=g), params0())


def run(optimizer: optim.Optimizer, steps: range, params=None, state=None):
    params = params0() if params is None else params
    state = optimizer.init(params) if state is None else state
    for step in steps:
        params, state = optimizer.update(grads(step), state, params)
    return params, state


def assert_trees_equal(a, b) -> None:
    assert mt.tree.structure(a) == mt.tree.structure(b)
    for (name, x), (_, y) in zip(mt.tree.named_leaves(a), mt.tree.named_leaves(b), strict=True):
        assert torch.equal(x, y), name


def test_each_groups_state_is_named_after_its_params():
    _, state = run(build(), range(1))
    names = [name for name, _ in mt.tree.named_leaves(state)]
    assert "inner_states.adam.0.exp_avg.layer.w" in names
    assert "inner_states.adam.0.exp_avg.head.w" in names
    assert "inner_states.sgd.0.momentum_buffer.layer.b" in names
    assert not any(name.endswith((".0", ".1")) for name in names if "exp_avg" in name)


def as_lists(state):
    """``state`` as it was saved when groups were lists."""
    return pytree.tree_map(lambda node: list(node.values()) if isinstance(node, LeafGroup)
                           else node, state, is_leaf=lambda node: isinstance(node, LeafGroup))


def test_a_checkpoint_written_when_groups_were_lists_is_refused_in_one_line(tmp_path):
    optimizer, params = build(), params0()
    _, state = run(optimizer, range(1))
    assert "inner_states.adam.0.exp_avg.0" in [n for n, _ in mt.tree.named_leaves(as_lists(state))]
    path = mt.checkpoint.save(tmp_path, 1, params, as_lists(state))
    with pytest.raises(mt.checkpoint.CheckpointError, match="in the checkpoint but not in the "
                       "template; load with the model and optimizer") as error:
        mt.checkpoint.load(path, params, optimizer.init(params))
    assert "\n" not in str(error.value)


def masked_decay(prefix: str) -> optim.Optimizer:
    return optim.as_optimizer(optim.chain(
        optim.masked(optim.chain(optim.scale_by_adam(), optim.scale(-0.1)),
                     lambda name, p: name.startswith(prefix)),
        optim.scale(1.0)))


def test_a_checkpoint_resumed_with_another_mask_is_refused(tmp_path):
    params = {"a": torch.ones(3, 3), "b": torch.full((3, 3), 2.0)}
    saved_with = masked_decay("a")
    _, state = saved_with.update({"a": torch.ones(3, 3), "b": -torch.ones(3, 3)},
                                 saved_with.init(params), params)
    path = mt.checkpoint.save(tmp_path, 1, params, state)
    with pytest.raises(CheckpointError, match=HINT):
        mt.checkpoint.load(path, params, masked_decay("b").init(params))
    loaded = mt.checkpoint.load(path, params, masked_decay("a").init(params))
    assert_trees_equal(loaded.opt_state, state)


def test_a_nested_mask_sees_the_names_of_params():
    seen = []

    def label(name, p):
        seen.append(name)
        return name.startswith("blocks")

    inner = optim.masked(optim.scale(0.0), label)
    tx = optim.multi_transform({"matrix": inner, "other": optim.scale(1.0)},
                               lambda name, p: "matrix" if p.ndim == 2 else "other")
    params = {"blocks": {"w": torch.ones(2, 2)}, "head": {"w": torch.ones(2, 2)},
              "bias": torch.ones(2)}
    updates, _ = tx.update(params, tx.init(params), params)
    assert set(seen) == {"blocks.w", "head.w"}
    assert torch.equal(updates["blocks"]["w"], torch.zeros(2, 2))
    assert torch.equal(updates["head"]["w"], torch.ones(2, 2))


def lists_out() -> optim.GradientTransformation:
    """An inner transformation written for list groups: it returns a list of updates."""
    return optim.GradientTransformation(
        lambda params: (), lambda updates, state, params=None: (
            [u * 2 for u in mt.tree.leaves(updates)], state))


def test_an_inner_transformation_returning_a_list_still_routes():
    tx = optim.multi_transform({"x": lists_out(), "y": optim.scale(0.0)},
                               lambda name, p: "x" if name != "c" else "y")
    params = {"a": torch.ones(2), "b": torch.full((1,), 3.0), "c": torch.ones(2)}
    updates, _ = tx.update(params, tx.init(params), params)
    assert torch.equal(updates["a"], torch.full((2,), 2.0))
    assert torch.equal(updates["b"], torch.full((1,), 6.0))
    assert torch.equal(updates["c"], torch.zeros(2))


@pytest.mark.parametrize("returned", [lambda u: u["a"], lambda u: {"other": u["a"]},
                                      lambda u: [u["a"]] * 3])
def test_an_inner_transformation_returning_another_shape_is_a_one_line_error(returned):
    inner = optim.GradientTransformation(
        lambda params: (), lambda updates, state, params=None: (returned(updates), state))
    tx = optim.masked(inner, lambda name, p: name != "c")
    params = {"a": torch.ones(2), "b": torch.ones(1), "c": torch.ones(2)}
    with pytest.raises(ValueError, match="masked's inner transformation returned") as error:
        tx.update(params, tx.init(params), params)
    assert "\n" not in str(error.value)
