"""Hostile inputs: numbers at and past their limits on the command line.

Expected: ``--steps`` and ``--seed`` are integers in range (steps below the checkpoint naming
limit of 2**63, seeds below 2**63), ``--set`` values are finite, anything else is exit 2 with
one ``error:`` line naming the option; JSON output never holds NaN or Infinity; steps past
10**8 get checkpoint names that still sort and load.
"""

from __future__ import annotations

import json

import pytest
from test_hostile_harness import (
    check_clean,
    invoke,
    latest_step,
    run,
    strict_json,
)

from minitrain import checkpoint

REFUSED = {  # id: (args, words of the error line)
    "--steps 1e19": (("--steps", "1e19"), "--steps"),
    "--steps -1": (("--steps", "-1"), "--steps"),
    "--steps nan": (("--steps", "nan"), "--steps"),
    "--seed 1e400": (("--seed", "1e400"), "--seed"),
    "--seed nan": (("--seed", "nan"), "--seed"),
    "--seed inf": (("--seed", "inf"), "--seed"),
    "--seed -1": (("--seed", "-1"), "--seed"),
    "--set lr=-inf": (("--set", "lr=-inf"), "lr"),
    "--set lr=nan": (("--set", "lr=nan"), "lr"),
    "--set dim=1e400": (("--set", "dim=1e400"), "dim"),
    "--set steps=1e19": (("--set", "steps=1e19"), "steps"),
    "--set unknown key": (("--set", "nope=1"), "nope"),
    "--log-every 0": (("--log-every", "0"), "--log-every"),
    "--checkpoint-every -1": (("--checkpoint-every", "-1"), "--checkpoint-every"),
    "--keep 0": (("--keep", "0"), "--keep"),
    "--keep -1": (("--keep", "-1"), "--keep"),
    "--steps 1.5": (("--steps", "1.5"), "--steps"),
    "--steps empty": (("--steps", ""), "--steps"),
    "--log-every 1.5": (("--log-every", "1.5"), "--log-every"),
    "--nproc 0": (("--nproc", "0"), "--nproc"),
    "--backend nope": (("--backend", "nope"), "nope"),
    "--set has_aux=maybe": (("--set", "has_aux=maybe"), "has_aux"),
    "--set dim=abc": (("--set", "dim=abc"), "dim"),
    "--set without =": (("--set", "lr"), "--set"),
}


def run_refused_case(capsys, script, tmp_path, case):
    args, words = case
    out = tmp_path / "run"
    code, stdout, err = invoke(capsys, "run", script, "--json", "--no-report", "--out", out,
                               *args, limit=5)
    assert code == 2, err
    check_clean(err, words, script=script)
    assert not out.exists() and stdout == ""


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_out_of_range_number_is_refused(capsys, script, tmp_path, safe_signals, case):
    run_refused_case(capsys, script, tmp_path, REFUSED[case])


@pytest.mark.parametrize("steps", [10**8, 10**9, 2**63 - 1])
def test_steps_past_10_to_the_8_checkpoint_and_resume(capsys, script, tmp_path, safe_signals,
                                                      steps):
    out = tmp_path / "run"
    code, stdout, err = run(capsys, script, out, "--set", "fail=next_batch:sigterm:2",
                            steps=steps)
    assert code == 130, err
    check_clean(err, "step 2", script=script)
    assert latest_step(out) == 2
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step-00000002"]


def test_the_largest_seed(capsys, script, tmp_path, safe_signals):
    code, stdout, err = run(capsys, script, tmp_path / "run", "--seed", str(2**63 - 1))
    assert code == 0, err
    assert strict_json(stdout)["seed"] == 2**63 - 1
    meta = checkpoint.verify(checkpoint.latest_valid(tmp_path / "run"))["meta"]
    assert meta["seed"] == 2**63 - 1


def test_a_learning_rate_that_overflows_is_a_failed_run(capsys, script, tmp_path, safe_signals):
    code, stdout, err = run(capsys, script, tmp_path / "run", "--set", "lr=1e30")
    assert code == 1, err
    check_clean(err, "step", script=script)
    assert stdout == "" or json.loads(stdout, parse_constant=None) is not None
