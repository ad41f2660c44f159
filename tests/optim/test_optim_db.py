"""sgd, adam, adamw, adagrad and rmsprop against torch.optim over torch's own test configurations
(``optim_db``) and error inputs, on the fast and the plain path."""

from __future__ import annotations

import pytest

import minitrain as mt
from tests.optim_db_harness import (
    PARAM_GROUP_ERRORS,
    check_matches_torch,
    check_rejects,
    configs,
    error_cases,
    left_out_errors,
)

CORE = {
    "SGD": mt.optim.sgd,
    "Adam": mt.optim.adam,
    "AdamW": mt.optim.adamw,
    "Adagrad": mt.optim.adagrad,
    "RMSprop": mt.optim.rmsprop,
}
CASES = [(name, case, kwargs) for name in CORE for case, kwargs in configs(name)]
ERRORS = error_cases(list(CORE))


@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
@pytest.mark.parametrize(("name", "case", "kwargs"), CASES, ids=[c for _, c, _ in CASES])
def test_matches_torch_over_optim_db(name, case, kwargs, plain):
    check_matches_torch(name, CORE[name], kwargs, plain=plain)


@pytest.mark.parametrize(("name", "error"), ERRORS,
                         ids=[f"{n}-{e.optimizer_error_input.desc}" for n, e in ERRORS])
def test_rejects_torchs_error_inputs_naming_the_argument(name, error):
    check_rejects(name, CORE[name], error)


def test_only_param_group_and_implementation_flag_errors_are_left_out():
    assert left_out_errors(list(CORE)) == PARAM_GROUP_ERRORS | {
        "lr as Tensor doesn't work with foreach & not capturable",
        r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
    }
