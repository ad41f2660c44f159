"""Hostile inputs: Ctrl-C and SIGTERM at awkward moments (in init, a batch, the loss, an
evaluation, a checkpoint save, a metrics write, the report), in bursts, at random moments of a
real process, and under ``--nproc 2``.

Expected: exit 130, one ``error:`` line saying what was saved, no traceback, and a valid
checkpoint of the last finished step (when one finished and ``--out`` was given); a resumed
run then reads as one run. In-process cases send the signal from inside the run (the script or
a wrapped library call), so the moment is exact.
"""

from __future__ import annotations

import os
import signal

import pytest
from test_hostile_harness import (
    check_clean,
    latest_step,
    run,
    steps_logged,
)

from minitrain import checkpoint, metrics

EVAL2 = ("--set", "evaluate=true", "--set", "eval_every=2")
EVAL_END = ("--set", "evaluate=true")

# "<where>:<signal><count>:<call>": (extra args, the steps the newest checkpoint may be at)
IN_SCRIPT = {
    "loss:sigterm:3": ((), "2,3"),
    "loss:sigterm5:3": ((), "2,3"),
    "loss:sigint:3": ((), "2,3"),
    "next_batch:sigterm:1": ((), "n,1"),
    "evaluate:sigterm:1": (EVAL2, "2"),
    "evaluate:sigterm3:2": (EVAL2, "4"),
}


def run_in_script_case(capsys, script_path, tmp_path, case_id, case):
    extra, saved = case
    out = tmp_path / "run"
    code, stdout, err = run(capsys, script_path, out, "--set", f"fail={case_id.split('/')[0]}",
                            *extra)
    assert code == 130, f"exit {code}:\n{err}"
    check_clean(err, "step", script=script_path)
    allowed = {None if s == "n" else int(s) for s in saved.split(",")}
    assert latest_step(out) in allowed, f"checkpoint at {latest_step(out)}, not {allowed}"
    if latest_step(out) is not None:
        assert str(latest_step(out)) in err.splitlines()[-1] or "saved" in err
    logged = steps_logged(out)
    assert logged == list(range(1, len(logged) + 1))


@pytest.mark.parametrize("case", sorted(IN_SCRIPT))
def test_a_signal_from_the_script(capsys, script, tmp_path, safe_signals, case):
    run_in_script_case(capsys, script, tmp_path, case, IN_SCRIPT[case])


def _signalling(function, sig, count=1, when=lambda *args, **kwargs: True):
    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            for _ in range(count):
                os.kill(os.getpid(), sig)
        return function(*args, **kwargs)

    return wrapped


LIBRARY = {  # id: (object, attribute, signal, count, when, extra args, checkpoint steps)
    "during a checkpoint save": (checkpoint, "save", signal.SIGTERM, 1, "2", "2"),
    "burst during a checkpoint save": (checkpoint, "save", signal.SIGTERM, 5, "2", "2"),
    "during a metrics write": (metrics.MetricsWriter, "write", signal.SIGTERM, 1, "3", "3"),
}


def _when(step):
    if not step:
        return lambda *args, **kwargs: True

    def at(*args, **kwargs):
        numbers = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        return int(step) in numbers

    return at


def run_library_case(capsys, script, tmp_path, monkeypatch, case):
    owner, name, sig, count, step, saved = case
    monkeypatch.setattr(owner, name, _signalling(getattr(owner, name), sig, count, _when(step)))
    out = tmp_path / "run"
    report = ("--report",) if name == "resource_report" else ()
    code, stdout, err = run(capsys, script, out, "--checkpoint-every", "2", "--keep", "10",
                            *report)
    monkeypatch.undo()
    assert code == 130, f"exit {code}:\n{err}"
    check_clean(err, "step", script=script)
    assert latest_step(out) == int(saved)
    for path in checkpoint.list_checkpoints(out):
        checkpoint.verify(path)


@pytest.mark.parametrize("case", sorted(LIBRARY))
def test_a_signal_inside_the_library(capsys, script, tmp_path, monkeypatch, safe_signals, case):
    run_library_case(capsys, script, tmp_path, monkeypatch, LIBRARY[case])


def test_a_stopped_run_resumes_as_one_run(capsys, script, tmp_path, monkeypatch, safe_signals):
    out = tmp_path / "run"
    write = metrics.MetricsWriter.write
    monkeypatch.setattr(metrics.MetricsWriter, "write", _signalling(write, signal.SIGTERM,
                                                                     when=_when("3")))
    code, _, err = run(capsys, script, out)
    monkeypatch.undo()
    assert code == 130, err
    code, stdout, err = run(capsys, script, out, "--resume")
    assert code == 0, err
    check_clean(err, script=script, error=False)
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6] and latest_step(out) == 6


# --------------------------------------------------------------------------- real processes


