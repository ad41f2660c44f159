"""multi_transform and masked hand their inner transformations the leaves keyed by their names
in params, so every group's state is named after its params: a checkpoint resumed with other
labels or another mask is refused, and checkpoints written when groups were lists still load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import minitrain as mt
from minitrain import optim
from minitrain.checkpoint import CheckpointError
from minitrain.optim._groups import LeafGroup, as_lists
from tests.legacy_groups_spec import build, grads, params0

LEGACY = Path(__file__).parents[1] / "data" / "legacy_groups"
HINT = "load with the model and optimizer the checkpoint was saved from"


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


def test_a_checkpoint_written_when_groups_were_lists_resumes_exactly(tmp_path):
    """tests/data/legacy_groups was saved by minitrain 9dac18a after 3 updates; resumed for 2
    more, it equals 5 uninterrupted updates of today's code, bit for bit."""
    optimizer = build()
    template_params = params0()
    path = shutil.copytree(LEGACY, tmp_path / "run") / "checkpoints" / "step-00000003"
    loaded = mt.checkpoint.load(path, template_params, optimizer.init(template_params))
    params3, state3 = run(optimizer, range(3))
    assert_trees_equal(loaded.params, params3)
    assert_trees_equal(loaded.opt_state, state3)
    assert isinstance(loaded.opt_state.inner_states["adam"][0].exp_avg, LeafGroup)
    resumed = run(optimizer, range(3, 5), loaded.params, loaded.opt_state)
    assert_trees_equal(resumed, run(optimizer, range(5)))


def test_the_legacy_layout_is_the_list_layout_of_todays_state():
    _, state = run(build(), range(1))
    legacy_names = [name for name, _ in mt.tree.named_leaves(as_lists(state))]
    assert "inner_states.adam.0.exp_avg.0" in legacy_names
    assert "inner_states.sgd.0.momentum_buffer.1" in legacy_names


def test_a_legacy_checkpoint_of_other_shapes_is_still_refused(tmp_path):
    path = shutil.copytree(LEGACY, tmp_path / "run") / "checkpoints" / "step-00000003"
    params = mt.tree.map(lambda p: torch.zeros(*p.shape, 2), params0())
    with pytest.raises(CheckpointError, match=HINT):
        mt.checkpoint.load(path, params, build().init(params))


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
