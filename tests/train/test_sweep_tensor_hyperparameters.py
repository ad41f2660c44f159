"""What a sweep can vary beyond lr and weight_decay (see ``minitrain.train.sweep``'s docstring):
the refusal of an argument that takes no per-member tensor names the ones that do, and Muon's
members pass the first-step check (under ``vmap`` its bfloat16 Newton-Schulz rounds as in a
single run) and train with their own lr, eps and momentum."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from minitrain.precision import get_backend
from minitrain.train import fit, load_experiment
from minitrain.train.members import MemberMismatch
from minitrain.train.sweep import fit_sweep, load_sweep

ADAM = """
import torch
import minitrain as mt

CONFIG = {"dim": 6, "beta1": 0.9, "steps": 3}


def experiment(config):
    return mt.Experiment(
        name="toy",
        init=lambda g: mt.models.cruncher_init(dim=config["dim"], num_layers=1, generator=g),
        loss=lambda params, x: (mt.models.cruncher(params, x) ** 2).mean(),
        next_batch=lambda g: torch.randn(4, config["dim"], generator=g),
        optimizer=mt.optim.adam(lr=0.01, betas=(config["beta1"], 0.999)),
        steps=config["steps"],
    )
"""


def test_a_refused_swept_argument_names_the_arguments_that_take_tensors(tmp_path):
    path = tmp_path / "adam.py"
    path.write_text(ADAM)
    with pytest.raises(MemberMismatch) as info:  # betas: a float and a tensor do not mix
        load_sweep(str(path), ["beta1=0.5,0.9"], steps=3)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("experiment(config) with beta1 as per-member tensors failed")
    assert "invalid betas" in message
    for named in ("max_grad_norm", "lr", "weight_decay", "eps", "momentum", "alpha",
                  "both betas or neither"):
        assert named in message, named


MUON = """
import torch
import minitrain as mt

CONFIG = {"lr": 0.02, "eps": 1e-7, "momentum": 0.95, "steps": 5}


def experiment(config):
    true_w = torch.linspace(-1.0, 1.0, 18).reshape(6, 3)

    def next_batch(generator):
        x = torch.randn(4, 6, generator=generator)
        return x, x @ true_w

    return mt.Experiment(
        name="toy",
        init=lambda g: {"w": 0.1 * torch.randn(6, 3, generator=g)},
        loss=lambda params, batch: ((batch[0] @ params["w"] - batch[1]) ** 2).mean(),
        next_batch=next_batch,
        optimizer=mt.optim.muon(lr=config["lr"], eps=config["eps"],
                                momentum=config["momentum"]),
        steps=config["steps"],
    )
"""


# eps = 0.5 and 2 bind (above the updates' norms)
@pytest.mark.parametrize("swept", ["lr=0.01,0.05", "eps=0.5,2.0", "momentum=0.5,0.9"])
def test_muon_members_pass_the_check_and_train_with_their_own_values(tmp_path, swept):
    path = tmp_path / "muon.py"
    path.write_text(MUON)
    cpu = get_backend("cpu")
    ensemble = load_sweep(str(path), [swept], seeds=[3], steps=5)
    result = fit_sweep(ensemble, cpu, progress=False)  # failed the check before
    swept_params = [p["w"] for p in mt.tree.unstack(result.params)]
    runs = []
    for member in ensemble.members:
        overrides = {key: str(value) for key, value in member.config.items()}
        experiment, config = load_experiment(str(path), overrides, steps=5)
        runs.append(fit(experiment, cpu, seed=member.seed, progress=False,
                        config=config).params["w"])
    for got, want in zip(swept_params, runs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(swept_params[0], swept_params[1], rtol=1e-3)


@pytest.mark.parametrize("shape", [(6, 3), (3, 6), (17, 17), (64, 33)])
def test_newton_schulz_under_vmap_gives_each_matrix_its_own_bits(shape):
    # a batched addmm is a bfloat16 bmm, a rounded scale and a rounded add: 4-33% of an
    # update apart before, where the single-matrix path sums in float32 and rounds once
    from minitrain.optim._muon import newton_schulz
    stack = torch.randn(3, *shape, generator=torch.Generator().manual_seed(sum(shape)))
    batched = torch.func.vmap(newton_schulz)(stack)
    for k in range(3):
        assert torch.equal(batched[k], newton_schulz(stack[k])), k


BETAS = ADAM.replace('"beta1": 0.9,', '"beta1": 0.9, "beta2": 0.999, "alpha": 0.99,')


@pytest.mark.parametrize("optimizer, swept", [
    ("adam(lr=0.01, betas=(config['beta1'], config['beta2']))", ["beta1=0.5,0.9",
                                                                 "beta2=0.99,0.999"]),
    ("rmsprop(lr=0.01, alpha=config['alpha'], centered=True)", ["alpha=0.9,0.99"]),
])
def test_both_betas_and_a_centered_alpha_sweep_past_the_first_step_check(
        tmp_path, optimizer, swept):
    # float64 per-member values as lerp weights on float32 params raised a dtype error
    path = tmp_path / "swept.py"
    path.write_text(BETAS.replace("adam(lr=0.01, betas=(config[\"beta1\"], 0.999))", optimizer))
    assert optimizer in path.read_text()
    ensemble = load_sweep(str(path), swept, steps=3)
    result = fit_sweep(ensemble, get_backend("cpu"), progress=False)
    assert result is not None
