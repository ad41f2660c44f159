"""What ``minitrain sweep`` says about a script the vmapped step cannot train as its members'
single runs: one line that names the script's line and how to write it instead, or the
members' own results. Sizes and counts taken from a swept value through ``float()``, an ``if``
on a swept value that only picks a name, in-place writes and Python control flow on per-member
tensors inside the step, and ``json.dumps(config)``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import minitrain as mt
from minitrain.cli import main
from minitrain.train.members import MemberMismatch, build_ensemble, member_grid
from minitrain.train.sweep import load_sweep
from tests.sweep_harness import assert_members_equal_single_runs, refused

# A least-squares problem; ``setup`` runs inside experiment(config) (after ``lr``, ``width``,
# ``name``, ``schedule`` and ``weights`` are set), ``in_loss`` at the start of the loss.
SCRIPT = '''
import json

import torch
import minitrain as mt

CONFIG = {{"lr": 0.05, "x": 2.0, "steps": 4}}


def experiment(config):
    true_w = torch.linspace(-1.0, 1.0, 6)
    lr = config["lr"]
    width = 3
    name = "messages"
    schedule = None
    seen = {{"n": 0}}

{setup}
    def next_batch(generator):
        seen["n"] += 1
        x = torch.randn(8, 6, generator=generator)
        return x, x @ true_w, torch.tensor(seen["n"])

    def loss(params, batch):
        x, y, step = batch
{in_loss}
        return ((x @ params["w"] - y) ** 2).mean() + 0.0 * params["h"].sum()

    return mt.Experiment(
        name=name,
        init=lambda g: {{"w": 0.1 * torch.randn(6, generator=g), "h": torch.zeros(width)}},
        loss=loss,
        next_batch=next_batch,
        optimizer=mt.optim.sgd(lr=lr if schedule is None else schedule),
        steps=config["steps"],
    )
'''


def write(tmp_path, setup="", in_loss=""):
    path = tmp_path / "messages.py"
    path.write_text(SCRIPT.format(setup=textwrap.indent(textwrap.dedent(setup), "    "),
                                  in_loss=textwrap.indent(textwrap.dedent(in_loss), "        ")))
    return str(path)


def line_of(path, text):
    """The line number of the first line of ``path`` that holds ``text``."""
    lines = Path(path).read_text().splitlines()
    return next(number for number, line in enumerate(lines, start=1) if text in line)


def cli(capsys, path, *items):
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", path, *(f"--set={item}" for item in items), "--steps", "4", "--no-report",
              "--json"])
    return exit_info.value.code, capsys.readouterr().err


# --------------------------------------------------------------------------- sizes and counts


def test_a_tensor_length_from_float_of_a_swept_value_is_refused_when_stacked(tmp_path):
    path = write(tmp_path, 'width = int(float(config["x"]) * 2)')
    message = refused(path, ["x=2.0,3.0"])
    assert message.startswith("the members' params cannot be stacked")
    assert "differ only in float hyperparameters" in message
    # a size every member shares trains
    shared = write(tmp_path, """
        width = int(float(config["x"]))
        lr = lr * config["x"]
        """)
    assert_members_equal_single_runs(shared, ["x=2.0,2.5"])


@pytest.mark.parametrize("every, evaluates, shown", [
    (lambda lr: int(lr * 10), lambda lr: True, "eval_every is 2 where member 0's is 1"),
    (lambda lr: 0, lambda lr: lr < 0.15, "evaluates is False where member 0's is True"),
])
def test_a_count_or_switch_of_the_run_from_float_of_a_swept_value_is_refused(every, evaluates,
                                                                           shown):
    # the loop reads eval_every and evaluate of the template (member 0's) for every member
    def build(config):
        lr = float(config["lr"])  # member 0's value in the template
        return mt.Experiment(
            init=lambda g: {"w": torch.zeros(2)}, loss=lambda p, x: (x @ p["w"]).square().mean(),
            next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=config["lr"]),
            steps=4, eval_every=every(lr), evaluate=(lambda p: {}) if evaluates(lr) else None)

    with pytest.raises(MemberMismatch) as info:
        build_ensemble(build, member_grid({"lr": 0.1}, {}, {"lr": ["0.1", "0.2"]}))
    assert str(info.value).startswith(f"member 1 (lr=0.2 seed=0) builds a run whose {shown}; ")


# --------------------------------------------------------------------------- branches


def test_an_if_that_only_picks_the_name_is_refused_with_what_to_write(tmp_path, capsys):
    path = write(tmp_path, """
        if config["lr"] > 0.1:
            name = "fast"
        """)
    message = refused(path, ["lr=0.05,0.2"])
    assert "False for member 0 (lr=0.05 seed=0), True for member 1 (lr=0.2 seed=0)" in message
    assert "even a branch that only sets a name" in message
    assert 'f"lr={lr:g}" for a name' in message
    assert message.endswith(f"(messages.py line {line_of(path, 'if config')})")
    code, err = cli(capsys, path, "lr=0.05,0.2")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1


# --------------------------------------------------------------------------- inside the step


@pytest.mark.parametrize("in_loss, expected", [
    ('scaled = torch.as_tensor(config["lr"]).mul_(2)',
     "writes in place into a tensor the loss did not make"),
    ("if step > 2:\n    y = y * 2", "torch.where(step > 10, a, b)"),
    ('if float(config["lr"]) > 0.1:\n    y = y * 2', "not float() or .item()"),
], ids=["in-place-on-a-swept-value", "if-on-the-step-count", "float-of-a-swept-value"])
def test_what_the_vmapped_step_cannot_run_is_one_line_naming_the_script(
        tmp_path, capsys, in_loss, expected):
    path = write(tmp_path, in_loss=in_loss)
    line = line_of(path, in_loss.splitlines()[0])
    message = refused(path, ["lr=0.05,0.2"])
    assert message.startswith(f"the vmapped train step at step 1 (messages.py line {line}, in "
                              "loss) ")
    assert expected in message and "vmap" not in message.replace("vmapped", "")
    code, err = cli(capsys, path, "lr=0.05,0.2")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1


def test_an_if_on_the_step_count_in_a_schedule_is_one_line(tmp_path):
    path = write(tmp_path, """
        peak = lr
        schedule = lambda count: peak * (0.5 if count > 2 else 1.0)
        """)
    message = refused(path, ["lr=0.05,0.2"])
    assert message.startswith(f"the vmapped train step at step 1 (messages.py line "
                              f"{line_of(path, 'count > 2')}, in <lambda>) turns a tensor "
                              "that differs")


# --------------------------------------------------------------------------- json


def test_json_dumps_of_the_config_with_default_float_trains_as_single_runs(tmp_path):
    path = write(tmp_path, 'name = "messages " + json.dumps(config, sort_keys=True, default=float)')
    assert_members_equal_single_runs(path, ["lr=0.05,0.2"])


def test_plain_json_dumps_of_a_swept_value_is_one_line_naming_the_script(tmp_path, capsys):
    path = write(tmp_path, 'name = "messages " + json.dumps(config)')
    with pytest.raises(MemberMismatch) as info:
        load_sweep(path, ["lr=0.05,0.2"])
    message = str(info.value)
    assert message.startswith("experiment(config) with lr as per-member tensors failed "
                              "(TypeError: Object of type SweptValue is not JSON serializable "
                              f"(messages.py line {line_of(path, 'json.dumps')}))")
    assert "\n" not in message
    code, err = cli(capsys, path, "lr=0.05,0.2")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1


def test_json_dumps_with_default_float_writes_member_zeros_values_while_the_template_is_built(
        tmp_path):
    path = write(tmp_path, """
        with open(config["log"], "a") as log:
            record = {"lr": config["lr"], "half": config["lr"] / 2,
                      "encoder": json.JSONEncoder.default.__module__}
            log.write(json.dumps(record, default=float) + "\\n")
        """)
    log = tmp_path / "config.jsonl"
    script = Path(path)
    logged = f'"steps": 4, "log": {str(log)!r}}}'
    script.write_text(script.read_text().replace('"steps": 4}', logged))
    original = json.JSONEncoder.default
    load_sweep(path, ["lr=0.05,0.2"], steps=2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # member 0, member 1, then the shared experiment, which writes member 0's values; json's
    # encoder is json's own throughout
    assert lines == [{"lr": 0.05, "half": 0.025, "encoder": "json.encoder"},
                     {"lr": 0.2, "half": 0.1, "encoder": "json.encoder"},
                     {"lr": 0.05, "half": 0.025, "encoder": "json.encoder"}]
    assert json.JSONEncoder.default is original
