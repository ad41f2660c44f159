"""``Experiment(uses_key=True)``: the loss gets ``fold_in(key(seed), step)`` in every run."""

import textwrap

import pytest
import torch

import minitrain as mt
from minitrain.precision import get_backend
from minitrain.train import fit, make_train_step
from minitrain.train.step import step_key, with_fixed_key
from minitrain.train.sweep import fit_sweep, load_sweep
from minitrain.tree import unstack

CPU = get_backend("cpu")


def noisy(seen=None, steps=4, lr=0.1, state=False):
    """A linear model whose loss adds key-drawn noise to its weights (DP-SGD's shape)."""

    def loss(params, *rest, key):
        batch = rest[-1]
        if seen is not None:
            seen.append(key.tolist())
        noise = 0.5 * mt.random.normal(key, params["w"].shape)
        value = ((batch @ (params["w"] + noise) - 1) ** 2).mean()
        return (value, {"n": rest[0]["n"] + 1}) if state else value

    return mt.Experiment(
        init=lambda g: {"w": torch.zeros(3)}, loss=loss,
        next_batch=lambda g: torch.randn(8, 3, generator=g),
        optimizer=mt.optim.sgd(lr=lr), steps=steps, uses_key=True,
        init_state=(lambda g: {"n": torch.tensor(0)}) if state else None,
    )


@pytest.mark.parametrize("state", [False, True], ids=["stateless", "with-init-state"])
def test_the_loss_gets_fold_in_of_the_seed_key_and_the_step(state):
    seen = []
    fit(noisy(seen, state=state), CPU, seed=7, progress=False)
    expected = [mt.random.fold_in(mt.random.key(7), step).tolist() for step in range(1, 5)]
    assert seen == expected
    assert step_key(7, 3).tolist() == expected[2]


def test_a_resumed_run_draws_what_an_uninterrupted_one_draws(tmp_path):
    whole = fit(noisy(), CPU, seed=3, progress=False)
    fit(noisy(steps=2), CPU, seed=3, out_dir=tmp_path, progress=False)
    seen = []
    resumed = fit(noisy(seen), CPU, seed=3, out_dir=tmp_path, resume=True, progress=False)
    assert seen == [step_key(3, step).tolist() for step in (3, 4)]
    assert torch.equal(whole.params["w"], resumed.params["w"])


def test_the_keys_change_the_result_and_other_seeds_draw_other_keys():
    a = fit(noisy(), CPU, seed=0, progress=False).params["w"]
    b = fit(noisy(), CPU, seed=1, progress=False).params["w"]
    assert not torch.equal(a, b)


def test_each_sweep_member_draws_its_own_seeds_keys_as_its_single_run(tmp_path):
    script = tmp_path / "keyed.py"
    script.write_text(textwrap.dedent("""
        import torch
        import minitrain as mt

        CONFIG = {"lr": 0.1, "steps": 3}

        def experiment(config):
            def loss(params, batch, *, key):
                noise = 0.5 * mt.random.normal(key, params["w"].shape)
                return ((batch @ (params["w"] + noise) - 1) ** 2).mean()

            return mt.Experiment(init=lambda g: {"w": torch.zeros(3)}, loss=loss,
                                 next_batch=lambda g: torch.randn(8, 3, generator=g),
                                 optimizer=mt.optim.sgd(lr=config["lr"]),
                                 steps=config["steps"], uses_key=True)
        """))
    ensemble = load_sweep(script, ["lr=0.05,0.1"], seeds=[0, 1])
    result = fit_sweep(ensemble, CPU, progress=False)  # checks members against single runs
    for member, params in zip(ensemble.members, unstack(result.params), strict=True):
        single = fit(ensemble.experiments[member.index], CPU, seed=member.seed, progress=False)
        torch.testing.assert_close(params["w"], single.params["w"])


def test_a_step_of_a_keyed_loss_without_a_key_is_refused_and_with_fixed_key_runs():
    experiment = noisy()
    params = {"w": torch.zeros(3)}
    step = make_train_step(experiment, CPU)
    with pytest.raises(ValueError, match="uses_key=True: pass the step its key"):
        step(params, experiment.optimizer.init(params), torch.ones(8, 3))
    fixed = with_fixed_key(experiment, seed=2, step=5)
    out = make_train_step(fixed, CPU)(params, experiment.optimizer.init(params), torch.ones(8, 3))
    keyed = step(params, experiment.optimizer.init(params), torch.ones(8, 3), key=step_key(2, 5))
    assert torch.equal(out.params["w"], keyed.params["w"])


def test_a_loss_without_uses_key_is_called_without_a_key():
    experiment = mt.Experiment(
        init=lambda g: {"w": torch.zeros(2)}, loss=lambda p, x: (x @ p["w"] - 1).square().mean(),
        next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1), steps=2)
    assert with_fixed_key(experiment) is experiment
    assert fit(experiment, CPU, progress=False).summary["steps"] == 2
