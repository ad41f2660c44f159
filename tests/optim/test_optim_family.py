"""Adadelta, Adafactor, Adamax, ASGD, NAdam, RAdam, Rprop and Muon against torch.optim, step for
step over torch's own test configurations (``optim_db``), and torch's error inputs."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from tests.optim_db_harness import (
    ATOL,
    PARAM_GROUP_ERRORS,
    RTOL,
    check_matches_torch,
    check_rejects,
    configs,
    error_cases,
    grads_sequence,
    left_out_errors,
    run_minitrain,
    run_torch,
)

FAMILY = {
    "Adadelta": mt.optim.adadelta,
    "Adafactor": mt.optim.adafactor,
    "Adamax": mt.optim.adamax,
    "ASGD": mt.optim.asgd,
    "NAdam": mt.optim.nadam,
    "RAdam": mt.optim.radam,
    "Rprop": mt.optim.rprop,
    "Muon": mt.optim.muon,
}
CASES = [case for name in FAMILY for case in configs(name)]


def make_params(name: str, seed: int = 0) -> dict:
    """A mix of 0-d to 3-d leaves (Adafactor factors the last two dims); matrices for Muon."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "v": (3, 5)} if name == "Muon" else {
        "w": (4, 3), "b": (5,), "s": (), "t": (2, 3, 4)}
    return {key: torch.randn(shape, generator=g) for key, shape in shapes.items()}


@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
@pytest.mark.parametrize(("case", "kwargs"), CASES, ids=[case for case, _ in CASES])
def test_matches_torch_step_for_step_over_optim_db(case, kwargs, plain):
    name = case.split("-")[0]
    check_matches_torch(name, FAMILY[name], kwargs, plain=plain, params=make_params(name))


ERROR_CASES = error_cases(list(FAMILY))


def test_param_group_errors_are_the_only_ones_left_out():
    assert left_out_errors(list(FAMILY)) == PARAM_GROUP_ERRORS


@pytest.mark.parametrize(("name", "error"), ERROR_CASES,
                         ids=[f"{n}-{e.optimizer_error_input.desc}" for n, e in ERROR_CASES])
def test_rejects_torchs_error_inputs_with_a_value_error_naming_the_argument(name, error):
    check_rejects(name, FAMILY[name], error)


def run_family(name, kwargs, params, grads_seq):
    return run_minitrain(FAMILY[name], kwargs, params, grads_seq, plain=False)


def test_muon_rejects_a_non_matrix_naming_the_leaf():
    opt = mt.optim.muon()
    with pytest.raises(ValueError, match="'bias' has shape \\(3,\\)"):
        opt.init({"weight": torch.zeros(3, 3), "bias": torch.zeros(3)})


@pytest.mark.parametrize("factory", [mt.optim.nadam, mt.optim.radam, mt.optim.adamax])
def test_betas_mixing_a_float_and_a_tensor_are_refused(factory):
    with pytest.raises(ValueError, match="betas"):
        factory(betas=(0.9, torch.tensor(0.99)))


@pytest.mark.parametrize("name", ["NAdam", "RAdam", "Adamax", "Adadelta", "Adafactor"])
def test_tensor_hyperparameters_squeeze_like_torch(name):
    params = make_params(name)
    grads_seq = grads_sequence(params, 4)
    kwargs = {"lr": torch.tensor([[0.01]])}
    if name in ("NAdam", "RAdam", "Adamax"):
        kwargs["betas"] = (torch.tensor([[[0.9]]]), torch.tensor([[0.99]]))
    got, _ = run_family(name, kwargs, params, grads_seq)
    torch_kwargs = {"lr": 0.01, **({"betas": (0.9, 0.99)} if "betas" in kwargs else {})}
    want, _ = run_torch(name, torch_kwargs, params, grads_seq)
    for key in params:
        assert got[key].shape == params[key].shape
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(FAMILY))
def test_update_never_mutates_its_inputs(name):
    params = make_params(name)
    opt = FAMILY[name]()
    state = opt.init(params)
    grads = grads_sequence(params, 1)[0]
    before = [t.clone() for t in mt.tree.leaves((params, state, grads))]
    for _ in range(2):
        opt.update(grads, state, params)
    after = mt.tree.leaves((params, state, grads))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(("factory", "kwargs", "lrs"), [
    (mt.optim.nadam, dict(lr=0.01), [0.01, 0.01]),
    (mt.optim.asgd, dict(lr=0.1, lambd=1.0, alpha=1.0), [0.1, 0.1 / 1.1]),  # lr / (1 + lr t)
    (mt.optim.rprop, dict(lr=0.2), [0.2, 0.2]),
    (mt.optim.schedule_free_adamw, dict(lr=0.1, warmup_steps=4), [0.025, 0.05]),
    (mt.optim.adafactor, dict(lr=mt.optim.step_schedule(0.05, 1, gamma=0.5)), [0.05, 0.025]),
])
def test_learning_rate_reads_the_lr_of_the_last_update(factory, kwargs, lrs):
    opt = factory(**kwargs)
    params = {"w": torch.ones(2, 2)}
    state = opt.init(params)
    seen = []
    for _ in range(2):
        params, state = opt.update({"w": torch.ones(2, 2)}, state, params)
        seen.append(mt.optim.learning_rate(state))
    assert seen == pytest.approx(lrs, rel=1e-6)


@pytest.mark.parametrize("name", [*FAMILY, "Lion", "ScheduleFreeAdamW"])
def test_a_state_of_another_model_is_a_value_error_naming_the_leaf(name):
    factory = {"Lion": mt.optim.lion, "ScheduleFreeAdamW": mt.optim.schedule_free_adamw}.get(
        name) or FAMILY[name]
    opt = factory()
    small = opt.init({"w": torch.zeros(8, 4), "v": torch.zeros(2, 2)})
    params = {"w": torch.zeros(64, 33), "v": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"state\.\w+ leaf .*'w'.*\(8, [14]\)"):
        opt.update(mt.tree.map(torch.ones_like, params), small, params)
