"""Every alias of the registry that follows a ``torch.optim`` class, against it over torch's own
test configurations (``optim_db``) and error inputs: without grad (the update's fastest path) and
on leaves that require grad under grad mode (the differentiable path)."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from tests.optim.conftest import OPTIMIZERS
from tests.optim_db_harness import (
    PARAM_GROUP_ERRORS,
    check_matches_torch,
    check_rejects,
    configs,
    error_cases,
    left_out_errors,
)

# torch.optim class name -> the mt.optim function taking its arguments
ALIASES = {entry.torch_name: getattr(mt.optim, entry.alias) for entry in OPTIMIZERS
           if entry.torch_name is not None}
MATRICES_ONLY = {entry.torch_name for entry in OPTIMIZERS if entry.matrices_only}
CASES = [(name, case, kwargs) for name in ALIASES for case, kwargs in configs(name)]
ERRORS = error_cases(list(ALIASES))


def make_params(name: str, seed: int = 0) -> dict:
    """A mix of 0-d to 3-d leaves (Adafactor factors the last two dims); matrices for Muon."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "v": (3, 5)} if name in MATRICES_ONLY else {
        "w": (4, 3), "b": (5,), "s": (), "t": (2, 3, 4)}
    return {key: torch.randn(shape, generator=g) for key, shape in shapes.items()}


def test_every_torch_optim_class_of_optim_db_is_followed():
    followed = {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adafactor", "Adamax",
                "NAdam", "RAdam", "Muon"}
    assert set(ALIASES) == followed


@pytest.mark.parametrize("plain", [False, True], ids=["no-grad", "differentiable"])
@pytest.mark.parametrize(("name", "case", "kwargs"), CASES, ids=[c for _, c, _ in CASES])
def test_matches_torch_over_optim_db(name, case, kwargs, plain):
    check_matches_torch(name, ALIASES[name], kwargs, plain=plain, params=make_params(name))


@pytest.mark.parametrize(("name", "error"), ERRORS,
                         ids=[f"{n}-{e.optimizer_error_input.desc}" for n, e in ERRORS])
def test_rejects_torchs_error_inputs_naming_the_argument(name, error):
    check_rejects(name, ALIASES[name], error)


def test_only_param_group_and_implementation_flag_errors_are_left_out():
    assert left_out_errors(list(ALIASES)) == PARAM_GROUP_ERRORS | {
        "lr as Tensor doesn't work with foreach & not capturable",
        r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
    }
