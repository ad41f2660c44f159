"""Hostile inputs: who owns a run directory. Two runs on one ``--out``, a resume while another
run writes, a fresh run into a used directory, the resume of a finished run, a stale lock.

Expected: a second run on a live ``--out`` fails at once with one line naming the holder's
pid; a fresh run into a directory holding checkpoints or metrics refuses (exit 2) unless
``--resume`` or ``--overwrite``; ``--resume`` of a finished run says so and changes nothing;
a lock left by a killed run does not block the next one.
"""

from __future__ import annotations

import signal

import pytest
from test_hostile_harness import (
    check_clean,
    latest_step,
    run,
    snapshot,
    spawn,
    steps_logged,
    wait_for_lines,
    write_script,
)


@pytest.fixture
def finished(capsys, script, tmp_path):
    """A finished 6-step run with checkpoints at 2, 4 and 6."""
    out = tmp_path / "run"
    code, _, err = run(capsys, script, out, "--checkpoint-every", "2", "--keep", "10")
    assert code == 0, err
    return out


def test_resume_with_more_steps_continues(capsys, script, finished, safe_signals):
    before = snapshot(finished)
    code, stdout, err = run(capsys, script, finished, "--resume", "--keep", "10", steps=8)
    assert code == 0, err
    check_clean(err, script=script, error=False)
    assert steps_logged(finished) == list(range(1, 9)) and latest_step(finished) == 8
    assert all(snapshot(finished)[rel] == content for rel, content in before.items()
               if rel.startswith("checkpoints/"))


def test_a_fresh_run_into_an_empty_directory(capsys, script, tmp_path, safe_signals):
    (tmp_path / "run").mkdir()
    code, stdout, err = run(capsys, script, tmp_path / "run")
    assert code == 0, err
    assert steps_logged(tmp_path / "run") == [1, 2, 3, 4, 5, 6]


def test_a_fresh_run_next_to_unrelated_files(capsys, script, tmp_path, safe_signals):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    code, stdout, err = run(capsys, script, tmp_path / "run")
    assert code == 0, err
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- a live holder


def test_a_killed_run_leaves_no_lock_behind(capsys, tmp_path, safe_signals):
    path = write_script(tmp_path)
    out = tmp_path / "run"
    proc = spawn("run", path, "--steps", "1000000", "--no-report", "--json", "--out", out,
                 "--checkpoint-every", "10", "--set", "sleep=0.002")
    wait_for_lines(out / "metrics.jsonl", 25, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    saved = latest_step(out)
    code, stdout, err = run(capsys, path, out, "--resume", "--set", "sleep=0.002",
                            "--checkpoint-every", "10", steps=saved + 3)
    assert code == 0, err
    check_clean(err, script=path, error=False)
    assert steps_logged(out) == list(range(1, saved + 4))
