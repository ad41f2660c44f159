"""Params on the meta device (no data) are refused before the first step, in one line naming the
leaf, under both training commands."""

import pytest

from minitrain.cli import main


def one_error_line(capsys, *args):
    """Run the CLI in-process; assert exit 2 and return its one ``error:`` line."""
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    assert exited.value.code == 2, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]

SCRIPT = """
import torch
import minitrain as mt

CONFIG = {"lr": 0.1}

def experiment(config):
    return mt.Experiment(
        init=lambda g: {"w": torch.zeros(3), "b": torch.zeros((), device="meta")},
        loss=lambda p, batch: ((batch @ p["w"] + p["b"]) ** 2).mean(),
        next_batch=lambda g: torch.randn(4, 3, generator=g),
        optimizer=mt.optim.sgd(lr=config["lr"]), steps=2)
"""


@pytest.mark.parametrize("command", [["run"], ["sweep", "--set", "lr=0.1,0.2"]],
                         ids=["run", "sweep"])
def test_meta_params_are_one_line_naming_the_leaf(command, tmp_path, capsys):
    path = tmp_path / "meta.py"
    path.write_text(SCRIPT)
    error = one_error_line(capsys, command[0], path, *command[1:], "--out", tmp_path / "out",
                           "--no-report")
    assert "meta tensor" in error and "'b'" in error, error


BATCH_SCRIPT = """
import torch
import minitrain as mt

CONFIG = {"lr": 0.1, "where": "x"}

def experiment(config):
    def next_batch(g):
        batch = {"x": torch.randn(4, 3, generator=g), "y": torch.randn(4, generator=g)}
        batch[config["where"]] = torch.empty(batch[config["where"]].shape, device="meta")
        return batch

    return mt.Experiment(
        init=lambda g: {"w": torch.zeros(3)},
        loss=lambda p, batch: ((batch["x"] @ p["w"] - batch["y"]) ** 2).mean(),
        next_batch=next_batch, optimizer=mt.optim.sgd(lr=config["lr"]), steps=2)
"""


@pytest.mark.parametrize("command, where",
                         [(["run"], "x"), (["sweep", "--set", "lr=0.1,0.2"], "y")],
                         ids=["run", "sweep"])
def test_a_meta_batch_is_one_line_naming_the_leaf(command, where, tmp_path, capsys):
    path = tmp_path / "meta_batch.py"
    path.write_text(BATCH_SCRIPT)
    error = one_error_line(capsys, command[0], path, *command[1:], "--set", f"where={where}",
                           "--no-report")
    assert "meta tensor" in error and f"'{where}'" in error, error
