"""Model state (BatchNorm buffers) carried by the train loop: fit equals the module trained the
classic way, and a checkpointed, resumed run equals an uninterrupted one to the bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minitrain as mt
from minitrain.errors import ExperimentError
from minitrain.train.ensemble_step import make_member_step
from minitrain.train.setup import run_generators
from minitrain.train.step import init_carry, make_train_step

CPU = mt.get_backend("cpu")
LR, MOMENTUM, DECAY = 0.1, 0.9, 1e-3


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),  # cumulative average
        nn.Flatten(), nn.Linear(4 * 4 * 4, 3), nn.BatchNorm1d(3),
    )


def next_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 3, 8, 8, generator=generator), torch.randint(0, 3, (6,),
                                                                        generator=generator)


def bn_experiment(steps: int, **overrides) -> mt.Experiment:
    params, state, apply = mt.from_module(small_cnn(), with_state=True)

    def loss(params, state, batch):
        x, y = batch
        logits, new_state = apply(params, state, x)
        return nn.functional.cross_entropy(logits, y), new_state

    options = dict(
        init=lambda g: params, init_state=lambda g: state, loss=loss, next_batch=next_batch,
        optimizer=mt.optim.sgd(lr=LR, momentum=MOMENTUM, weight_decay=DECAY), steps=steps,
        name="bn_cnn",
    )
    return mt.Experiment(**{**options, **overrides})


def torch_reference(steps: int) -> nn.Module:
    """The same CNN trained by torch.optim.SGD on the batches fit draws (seed 0)."""
    net = small_cnn()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    _, data = run_generators(0)
    for _ in range(steps):
        x, y = next_batch(data)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net


def test_fit_with_batchnorm_state_equals_torch_sgd():
    steps = 5
    result = mt.fit(bn_experiment(steps), CPU, progress=False)
    reference = torch_reference(steps)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(result.params[name], p.detach(), rtol=1e-5, atol=1e-6)
    state = result.state.model_state
    buffers = dict(reference.named_buffers())
    assert sorted(state) == sorted(buffers)
    for name, b in buffers.items():
        torch.testing.assert_close(state[name], b, rtol=1e-5, atol=1e-6)
    assert int(state["1.num_batches_tracked"]) == steps
    assert result.state.loss_scale is None  # fp32: nothing to scale


def test_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path):
    whole = mt.fit(bn_experiment(6), CPU, progress=False)
    run = tmp_path / "run"
    mt.fit(bn_experiment(3), CPU, progress=False, out_dir=run, checkpoint_every=2)
    resumed = mt.fit(bn_experiment(6), CPU, progress=False, out_dir=run, resume=True)
    assert resumed.summary["resumed_from"] == 3
    for tree_a, tree_b in [(whole.params, resumed.params), (whole.opt_state, resumed.opt_state),
                           (whole.state.model_state, resumed.state.model_state)]:
        for a, b in zip(mt.tree.leaves(tree_a), mt.tree.leaves(tree_b), strict=True):
            assert torch.equal(a, b)
    assert int(resumed.state.model_state["1.num_batches_tracked"]) == 6


def test_evaluate_receives_the_model_state():
    seen = []

    def evaluate(params, state):
        seen.append(int(state["1.num_batches_tracked"]))
        return {"tracked": float(state["1.num_batches_tracked"])}

    result = mt.fit(bn_experiment(2, evaluate=evaluate), CPU, progress=False)
    assert seen == [2] and result.summary["eval"] == {"tracked": 2.0}


def test_a_stateful_loss_that_forgets_the_state_is_a_one_line_error():
    params, state, apply = mt.from_module(small_cnn(), with_state=True)
    experiment = bn_experiment(
        1, loss=lambda p, s, batch: nn.functional.cross_entropy(apply(p, s, batch[0])[0],
                                                                batch[1]))
    with pytest.raises(ExperimentError, match=r"returns \(loss, new_state\)"):
        mt.fit(experiment, CPU, progress=False)


def test_a_new_state_of_another_shape_is_refused():
    params, state, apply = mt.from_module(small_cnn(), with_state=True)

    def loss(p, s, batch):
        logits, new_state = apply(p, s, batch[0])
        return nn.functional.cross_entropy(logits, batch[1]), {"only": logits.sum()}

    with pytest.raises(ExperimentError, match="not shaped like the state"):
        mt.fit(bn_experiment(1, loss=loss), CPU, progress=False)


def test_the_pure_step_needs_its_carry_and_leaves_inputs_untouched():
    experiment = bn_experiment(1)
    step = make_train_step(experiment, CPU)
    params = experiment.init(torch.Generator())
    opt_state = experiment.optimizer.init(params)
    batch = next_batch(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="init_carry"):
        step(params, opt_state, batch)
    carry = init_carry(experiment, CPU, torch.Generator())
    before = {name: t.clone() for name, t in carry.model_state.items()}
    out = step(params, opt_state, batch, carry)
    assert all(torch.equal(carry.model_state[k], before[k]) for k in before)
    assert int(out.carry.model_state["1.num_batches_tracked"]) == 1


def test_sweeps_refuse_model_state_in_one_line():
    with pytest.raises(ExperimentError, match="does not carry model state"):
        make_member_step(bn_experiment(1), CPU)
