"""Ensembles as stacked pytrees, per-example gradients, swept values and the vmapped step."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain.train import Experiment, make_train_step
from minitrain.train.ensemble_step import make_ensemble_step
from minitrain.train.members import build_ensemble, member_grid
from minitrain.train.swept import SweepBinding, SweptValue
from minitrain.tree import stack, unstack

CPU = mt.get_backend("cpu")


# --------------------------------------------------------------------------- stack / unstack


@settings(deadline=None, max_examples=25)
@given(
    members=st.integers(1, 5),
    rows=st.integers(1, 4),
    cols=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_stack_then_unstack_round_trips(members, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    trees = [
        {"w": torch.randn(rows, cols, generator=g), "b": [torch.randn(cols, generator=g)], "n": 3}
        for _ in range(members)
    ]
    stacked = stack(trees)
    assert stacked["w"].shape == (members, rows, cols)
    assert stacked["n"] == 3
    for original, back in zip(trees, unstack(stacked), strict=True):
        assert torch.equal(original["w"], back["w"]) and torch.equal(original["b"][0], back["b"][0])
        assert back["n"] == 3
    # Member k of the stacked tree is torch.stack's row k, leaf by leaf.
    assert torch.equal(stacked["b"][0], torch.stack([t["b"][0] for t in trees]))


def test_stack_names_the_leaf_that_differs():
    with pytest.raises(ValueError, match="'b': torch.float32 on cpu vs torch.float64"):
        stack([{"b": torch.zeros(2)}, {"b": torch.zeros(2, dtype=torch.float64)}])
    with pytest.raises(ValueError, match="non-tensor leaf 'n': 1 vs 2"):
        stack([{"n": 1}, {"n": 2}])
    with pytest.raises(ValueError, match="at least one tree"):
        stack([])
    with pytest.raises(ValueError, match="leading axis"):
        unstack({"a": torch.zeros(2, 3), "b": torch.zeros(3)})


# --------------------------------------------------------------------------- per-example grads


def mlp_loss(params, batch):
    x, y = batch
    hidden = torch.tanh(x @ params["w1"])
    return ((hidden @ params["w2"]).squeeze(-1) - y).square().mean()


@settings(deadline=None, max_examples=15)
@given(batch=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_per_example_grads_equal_a_loop_over_single_examples(batch, seed):
    g = torch.Generator().manual_seed(seed)
    params = {"w1": torch.randn(3, 5, generator=g), "w2": torch.randn(5, 1, generator=g)}
    x, y = torch.randn(batch, 3, generator=g), torch.randn(batch, generator=g)
    grads = mt.per_example_grads(mlp_loss)(params, (x, y))
    for i in range(batch):
        params_i = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        mlp_loss(params_i, (x[i : i + 1], y[i : i + 1])).backward()  # plain autograd, one example
        for name in params:
            assert grads[name].shape == (batch, *params[name].shape)
            torch.testing.assert_close(grads[name][i], params_i[name].grad)


def test_per_example_grads_average_to_the_batch_gradient():
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(3, 5, generator=g), "w2": torch.randn(5, 1, generator=g)}
    batch = (torch.randn(8, 3, generator=g), torch.randn(8, generator=g))
    per_example = mt.per_example_grads(mlp_loss)(params, batch)
    whole = mt.grad(mlp_loss)(params, batch)
    for name in params:  # a mean loss: the batch gradient is the mean of per-example gradients
        torch.testing.assert_close(per_example[name].mean(0), whole[name])


# --------------------------------------------------------------------------- swept values


def test_swept_value_is_member_zero_outside_and_each_member_inside_vmap():
    binding = SweepBinding()
    lr = SweptValue(0.1, "lr", binding)
    assert float(lr) == 0.1 and bool(lr > 0) and f"{float(lr):g}" == "0.1"
    derived = lr * 2  # built outside the step: redone on each member's value inside it
    assert isinstance(derived, SweptValue) and float(derived) == 0.2

    def per_member(values, x):
        with binding.bind({"lr": values}):
            out = x * lr + torch.stack([lr, lr]).sum() + derived
            assert type(out) is not SweptValue  # inside the step, results are plain tensors
            return out

    values = torch.tensor([0.5, 2.0], dtype=torch.float64)
    x = torch.ones(2, 3)
    out = torch.func.vmap(per_member)(values, x)
    expected = torch.stack([x[k] * values[k] + 4 * values[k] for k in range(2)])
    torch.testing.assert_close(out, expected)
    assert float(lr) == 0.1  # unbound again afterwards


def test_optimizer_with_swept_hyperparameters_matches_one_optimizer_per_member():
    binding = SweepBinding()

    def make(lr, weight_decay):
        return mt.optim.adamw(lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))

    lrs, decays = [0.01, 0.1, 0.03], [0.0, 0.1, 0.5]
    shared = make(SweptValue(lrs[0], "lr", binding), SweptValue(decays[0], "wd", binding))
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(4, 3, generator=g)} for _ in lrs]
    grads = [[{"w": torch.randn(4, 3, generator=g)} for _ in lrs] for _ in range(4)]
    singles = [make(lr, wd) for lr, wd in zip(lrs, decays, strict=True)]
    expected = []
    for k, opt in enumerate(singles):
        p, s = params[k], opt.init(params[k])
        for step_grads in grads:
            p, s = opt.update(step_grads[k], s, p)
        expected.append(p)

    def update(g_, s, p, values):
        with binding.bind(values):
            return shared.update(g_, s, p)

    hyper = {"lr": torch.tensor(lrs, dtype=torch.float64), "wd": torch.tensor(decays).double()}
    p = stack(params)
    s = stack([opt.init(q) for opt, q in zip(singles, params, strict=True)])
    for step_grads in grads:
        p, s = torch.func.vmap(update)(stack(step_grads), s, p, hyper)
    for k in range(len(lrs)):
        torch.testing.assert_close(p["w"][k], expected[k]["w"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the ensemble step

CONFIG = {"lr": 0.1, "momentum": 0.9, "dropout": 0.0, "steps": 5}


def toy_experiment(config):
    def loss(params, batch):
        x, y = batch
        h = torch.nn.functional.dropout(x, p=config["dropout"], training=config["dropout"] > 0)
        return ((h @ params["w"]).squeeze(-1) - y).square().mean()

    def next_batch(generator):
        x = torch.randn(4, 3, generator=generator)
        return x, x.sum(-1)

    return Experiment(
        init=lambda g: {"w": torch.randn(3, 1, generator=g)},
        loss=loss,
        next_batch=next_batch,
        optimizer=mt.optim.sgd(lr=config["lr"], momentum=config["momentum"]),
        steps=config["steps"],
    )


def toy_inputs(ensemble):
    g = torch.Generator().manual_seed(0)
    params = [e.init(g) for e in ensemble.experiments]
    states = [e.optimizer.init(p) for e, p in zip(ensemble.experiments, params, strict=True)]
    batches = [e.next_batch(g) for e in ensemble.experiments]
    return params, states, batches


def test_ensemble_step_equals_each_members_own_step():
    members = member_grid(CONFIG, {}, {"lr": [0.01, 0.1]}, [0, 1])
    ensemble = build_ensemble(toy_experiment, members)
    params, states, batches = toy_inputs(ensemble)
    step = make_ensemble_step(ensemble, CPU)
    diverged = torch.zeros(4, dtype=torch.int64)
    hyper = ensemble.hyperparameters()
    out = step(stack(params), stack(states), stack(batches), hyper, diverged, 1)
    for k, experiment in enumerate(ensemble.experiments):
        ref = make_train_step(experiment, CPU)(params[k], states[k], batches[k])
        torch.testing.assert_close(out.params["w"][k], ref.params["w"])
        torch.testing.assert_close(out.loss[k], ref.loss)
        torch.testing.assert_close(out.grad_norm[k], ref.grad_norm)
    assert out.diverged_at.tolist() == [0, 0, 0, 0]


def test_a_member_with_a_nan_loss_is_frozen_and_the_others_train_on():
    ensemble = build_ensemble(toy_experiment, member_grid(CONFIG, {}, {"lr": [0.1, 0.2]}, [0]))
    params, states, batches = toy_inputs(ensemble)
    batches[1] = (batches[1][0], torch.full((4,), float("nan")))
    step = make_ensemble_step(ensemble, CPU)
    p, s, b = stack(params), stack(states), stack(batches)
    diverged = torch.zeros(2, dtype=torch.int64)
    out = step(p, s, b, ensemble.hyperparameters(), diverged, 7)
    assert out.diverged_at.tolist() == [0, 7]
    assert torch.equal(out.params["w"][1], params[1]["w"])  # frozen: params as before the step
    count = out.opt_state[-1].count  # scale_by_learning_rate's, last in the chain
    assert int(count[1]) == 0 and int(count[0]) == 1
    assert not torch.equal(out.params["w"][0], params[0]["w"])
    # Once diverged, a member stays frozen even when its next loss is finite.
    clean = stack([batches[0], batches[0]])
    later = step(out.params, out.opt_state, clean, ensemble.hyperparameters(), out.diverged_at, 8)
    assert later.diverged_at.tolist() == [0, 7]
    assert torch.equal(later.params["w"][1], params[1]["w"])


def test_random_ops_differ_per_member_and_repeat_with_the_seed():
    config = {**CONFIG, "dropout": 0.5}
    ensemble = build_ensemble(toy_experiment, member_grid(config, {}, {"lr": [0.1, 0.2]}, [0]))
    params, states, batches = toy_inputs(ensemble)
    same = stack([params[0], params[0]]), stack([states[0], states[0]])
    batch = stack([batches[0], batches[0]])
    step = make_ensemble_step(ensemble, CPU)
    zeros = torch.zeros(2, dtype=torch.int64)

    def losses():
        mt.seed_everything(3)
        return step(*same, batch, ensemble.hyperparameters(), zeros, 1).loss

    first = losses()
    assert first[0] != first[1]  # same params and batch, different dropout masks
    assert torch.equal(first, losses())  # and the same masks again from the same seed
