"""Every value read from an experiment is checked before the first step, in one line naming it."""

import dataclasses
import math
import textwrap

import pytest
import torch

import minitrain as mt
from minitrain.cli import main
from minitrain.errors import ExperimentError
from minitrain.precision import get_backend
from minitrain.train import Experiment, fit
from minitrain.train.experiment import load_script
from minitrain.train.members import member_grid

GOOD = dict(init=lambda g: {"w": torch.zeros(2)}, loss=lambda p, x: (x @ p["w"]).square().mean(),
            next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1), steps=3)

# every field of Experiment -> values it refuses
BAD = {
    "init": [None, 3], "loss": ["loss"], "next_batch": [None],
    "optimizer": [torch.optim.SGD, "sgd", None],
    "steps": [-1, 2.0, True, "10", 2**63],
    "has_aux": [1, "yes", None],
    "evaluate": [{"val_loss": 1.0}, "evaluate"],
    "eval_every": [-1, 1.5, True, "2"],
    "tokens_per_batch": [0, -4, 2.5, "8", True],
    "flops_per_step": [math.nan, math.inf, -1, "1e9", True],
    "max_grad_norm": [0, -1.0, math.nan, math.inf, "1.0", torch.tensor(-1.0)],
    "name": ["", "  ", 3, None],
    "extras": [None, [("a", 1)]],
    "init_state": ["state", 0],
    "loss_scale": [2.0**16, "dynamic"],
    "uses_key": [1, None, "yes"],
}


def test_the_table_covers_every_field():
    assert set(BAD) == {field.name for field in dataclasses.fields(Experiment)}


def checked(**fields):
    """An Experiment of ``fields`` through its own check alone (the suite's import hook checks
    the type hints of ``__init__`` before it, which a user's run does not)."""
    experiment = object.__new__(Experiment)
    for field in dataclasses.fields(Experiment):
        default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
                   else field.default)
        object.__setattr__(experiment, field.name, fields.get(field.name, default))
    experiment.__post_init__()
    return experiment


@pytest.mark.parametrize("field, value", [(f, v) for f, values in BAD.items() for v in values])
def test_a_bad_value_of_any_field_is_one_line_naming_it(field, value):
    with pytest.raises(ExperimentError) as info:
        checked(**{**GOOD, field: value})
    message = str(info.value)
    assert message.startswith(f"Experiment.{field} must be") and "\n" not in message


@pytest.mark.parametrize("field, value", [
    ("flops_per_step", 1.5e9), ("flops_per_step", 0), ("tokens_per_batch", 8),
    ("max_grad_norm", 1), ("max_grad_norm", torch.tensor(0.5)), ("evaluate", lambda p: {}),
    ("loss_scale", mt.precision.dynamic_loss_scale()), ("uses_key", False),
    ("extras", {"a": 1}), ("steps", 0),
])
def test_good_values_pass(field, value):
    assert getattr(Experiment(**{**GOOD, field: value}), field) is value


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_bad_seeds_are_refused_before_anything_runs(seed):
    with pytest.raises(ExperimentError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        fit(Experiment(**GOOD), get_backend("cpu"), seed=seed, progress=False)
    with pytest.raises(ExperimentError, match="seed"):
        member_grid({"lr": 0.1}, {}, {}, seeds=[seed])


@pytest.mark.parametrize("value, shown", [
    ('float("nan")', "is nan"), ('float("-inf")', "is -inf"), ("object()", "is a object"),
    ("{1: 2}", "has the key 1"), ('[1.0, float("nan")]', "[1] is nan"), ("{0.5}", "is a set"),
    ('{"a": (float("inf"),)}', "['a'][0] is inf"), ("b'raw'", "is a bytes"),
])
def test_every_bad_config_value_is_one_line_naming_the_key(tmp_path, value, shown):
    path = tmp_path / "config.py"
    path.write_text(f"CONFIG = {{'lr': 0.1, 'bad': {value}}}\n"
                    "def experiment(config):\n    pass\n")
    with pytest.raises(ExperimentError) as info:
        load_script(path)
    assert f"CONFIG['bad']{shown}" in str(info.value).replace("CONFIG['bad'] ", "CONFIG['bad']")


SCRIPT = """
import torch
import minitrain as mt

CONFIG = {{"lr": 0.1, "steps": 3}}
CALLS = []


def experiment(config):
    def next_batch(generator):
        raise AssertionError("a step ran")

    return mt.Experiment(init=lambda g: {{"w": torch.zeros(2)}}, next_batch=next_batch,
                         loss=lambda p, x: (x @ p["w"]).mean(), steps=config["steps"],
                         optimizer=mt.optim.sgd(lr=config["lr"]), {field}={value})
"""


@pytest.mark.parametrize("field, value", [
    ("flops_per_step", 'float("nan")'), ("flops_per_step", "-1"), ("tokens_per_batch", "-8"),
    ("eval_every", "-1"), ("max_grad_norm", 'float("inf")'), ("name", '""'),
])
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_the_cli_refuses_a_bad_field_in_one_line_exit_2(tmp_path, capsys, command, field, value):
    path = tmp_path / "fields.py"
    path.write_text(textwrap.dedent(SCRIPT).format(field=field, value=value))
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(path), "--json", "--no-report"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"error: Experiment.{field} must be")
    assert "a step ran" not in err and "Traceback" not in err
