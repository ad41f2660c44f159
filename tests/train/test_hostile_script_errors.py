"""Hostile inputs: the user's script raises or returns junk in init, next_batch, the loss, aux
values or evaluate, at the first step or a later one.

Expected: exit 1 for an exception (2 is also accepted for a value of the wrong type, a mistake
the README counts as the user's), the user's own frames at most, one ``error:`` line naming
the function (and the step), and with ``--out`` the last good state saved and no line lost.
"""

from __future__ import annotations

import pytest
from test_hostile_harness import (
    check_clean,
    check_kept,
    latest_step,
    run,
    steps_logged,
)

EVAL = ("--set", "evaluate=true", "--set", "eval_every=1")
AUX = ("--set", "has_aux=true")
OUT, NO_OUT, EVERY2 = "out", None, "every2"

# "<where>:<what>:<call>[/variant]": (extra args, --out mode, exit codes, words of the error
# line separated by "|", the steps the newest valid checkpoint may be at: "n" none, "" no check).
CASES = {
    "loss:nan:5": ((), OUT, "1", "step 5|nan", "n,4"),
    "loss:inf:1": ((), OUT, "1", "step 1|inf", "n"),
    "loss:nan:5/every2": ((), EVERY2, "1", "step 5|nan", "4"),
}


def run_script_case(capsys, script_path, tmp_path, case_id, case):
    fail, (extra, mode, codes, words, saved) = case_id.split("/")[0], case
    codes = tuple(int(code) for code in codes)
    words = tuple(words.split("|"))
    saved = None if not saved else {None if s == "n" else int(s) for s in saved.split(",")}
    out = None if mode is NO_OUT else tmp_path / "run"
    args = ["--set", f"fail={fail}", *extra]
    if mode == EVERY2:
        args += ["--checkpoint-every", "2", "--keep", "10"]
    code, stdout, err = run(capsys, script_path, out, *args)
    assert code in codes, f"exit {code}, expected {codes}:\n{err}"
    check_clean(err, *words, script=script_path)
    if out is None:
        return
    at = int(fail.split(":")[2])
    logged = [step for step in steps_logged(out) if step is not None]
    assert logged == sorted(set(logged)) and all(step < at + 1 for step in logged), logged
    if saved is not None:
        assert latest_step(out) in saved, f"newest checkpoint at {latest_step(out)}, not {saved}"
    check_kept({}, out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_script_error(capsys, script, tmp_path, safe_signals, case):
    run_script_case(capsys, script, tmp_path, case, CASES[case])
