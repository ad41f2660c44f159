"""Every command that loads a script refuses params the backend would silently recast (float64
on the fp32 backend) in the same one line naming the leaf: run, sweep, profile and estimate step
(predicted and measured) say what a run would say."""

import click
import pytest

from minitrain.cli import cli, main
from tests.cli.test_script_folder import script_commands

SCRIPT = """
import torch, minitrain as mt
CONFIG = {"lr": 0.1}
def experiment(config):
    return mt.Experiment(
        init=lambda g: {"w": torch.zeros(4, 1), "b": torch.zeros(1, dtype=torch.float64)},
                         loss=lambda p, x: (x @ p["w"] + p["b"]).square().mean(),
                         next_batch=lambda g: torch.randn(8, 4, generator=g),
                         optimizer=mt.optim.sgd(lr=config["lr"]), steps=2)
"""
EXTRA = {"sweep": ["--set", "lr=0.1,0.2"], "estimate step": []}


def commands() -> list[list[str]]:
    with click.Context(cli) as ctx:
        found = [path.split() for path in script_commands(cli, ctx)]
    return found + [["estimate", "step", "--measure"]]


def test_the_script_commands_are_all_here():
    assert {"run", "sweep", "profile", "estimate step"} <= {" ".join(c) for c in commands()}


@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_float64_params_are_refused_naming_the_leaf(command, tmp_path, capsys):
    script = tmp_path / "f64.py"
    script.write_text(SCRIPT)
    extra = EXTRA.get(" ".join(command[:2]), EXTRA.get(command[0], []))
    with pytest.raises(SystemExit) as exit_info:
        main([*command, str(script), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "torch.float64 tensor at 'b'" in errors[0], err
