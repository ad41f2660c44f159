"""``minitrain run`` and ``minitrain sweep`` give one mistake the same exit code and error line."""

import textwrap

import pytest

from minitrain.cli import main

SCRIPT = """
import torch
import minitrain as mt
{top}
CONFIG = {{"lr": 0.1, "steps": 4, "dim": 3{config}}}
DRAWS = {{}}
LAST = [0]  # the step of the last batch drawn


def experiment(config):
    {build}
    def init(generator):
        {init}
        return {{"w": torch.zeros(config["dim"])}}

    def next_batch(generator):
        step = DRAWS[id(generator)] = DRAWS.get(id(generator), 0) + 1
        {next_batch}
        return torch.randn(4, config["dim"], generator=generator)

    def loss(params, batch):
        {loss}
        return ((batch @ params["w"] - 1) ** 2).mean()

    def evaluate(params):
        {evaluate}
        return {{"val_loss": float(params["w"].square().sum())}}

    return mt.Experiment(init=init, loss=loss, next_batch=next_batch, evaluate=evaluate,
                         eval_every=2, optimizer=mt.optim.sgd(lr=config["lr"]),
                         steps=config["steps"])
"""

# mistake -> (what the script does, extra arguments of both commands, what the line names)
MISTAKES = {
    "raises at import": ({"top": "raise RuntimeError('broken at import')"}, [],
                         "failed to import: RuntimeError: broken at import"),
    "raises in experiment()": ({"build": "raise ValueError('no experiment')"}, [],
                               "experiment(config) failed: ValueError: no experiment"),
    "raises in init": ({"init": "raise KeyError('no init')"}, [],
                       "init(generator) raised KeyError: 'no init'"),
    "raises in next_batch": ({"next_batch": "raise OSError('no data')"}, [],
                             "next_batch(generator) raised OSError: no data at step 1"),
    "shape error in the loss at step 1": (
        {"loss": "batch = batch[:, :2] @ torch.ones(3, 3)"}, [],
        "the first train step failed in the loss"),
    "shape error in the loss at step 3": (
        {"next_batch": "if step == 3:\n            return torch.ones(4, 2)"}, [],
        "the train step (loss) raised RuntimeError"),
    "raises in the loss at step 3": (
        {"next_batch": "LAST[0] = step",
         "loss": "if LAST[0] == 3:\n            raise KeyError('seven')"}, [],
        "the train step (loss) raised KeyError: 'seven' at step 3"),
    "raises in evaluate": ({"evaluate": "raise ZeroDivisionError('eval')"}, [],
                           "evaluate(params) raised ZeroDivisionError: eval at step 2"),
    "unknown --set key": ({}, ["--set", "depth=2"], "unknown config key 'depth'"),
    "bad --set value": ({}, ["--set", "dim=three"], "--set dim=three: expected an int"),
    "bad CONFIG value": ({"config": ', "eps": float("nan")'}, [], "CONFIG['eps'] is nan"),
}


def outcome(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    return exit_info.value.code, lines[-1] if lines else err


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_run_and_sweep_agree_on_the_exit_code_and_the_line(tmp_path, capsys, mistake):
    parts, extra, named = MISTAKES[mistake]
    fields = {"top": "", "config": "", "build": "pass", "init": "pass", "next_batch": "pass",
              "loss": "pass", "evaluate": "pass", **parts}
    path = tmp_path / "mistake.py"
    path.write_text(textwrap.dedent(SCRIPT).format(**fields))
    common = [*extra, "--no-report", "--json"]
    run = outcome(capsys, ["run", str(path), *common])
    sweep = outcome(capsys, ["sweep", str(path), "--seeds", "0,1", "--no-plot", *common])
    assert run[0] in (1, 2) and named in run[1], run
    assert sweep == run
