"""Hostile cases at the edges of a run: config values a checkpoint cannot record, a script
that calls ``sys.exit()``, raises a ``BaseException`` or ``KeyboardInterrupt`` mid-run, a
ValueError in the first step, stdout that cannot take the summary (a full device, a closed
pipe), SIGTERM before training starts, and NaN written into ``metrics.jsonl`` by hand.

Each asserts the exit code, one clean ``error:`` line (a traceback may show the user's script
only) and that nothing written before was lost.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_hostile_harness import (
    ROOT,
    SCRIPT,
    check_clean,
    check_kept,
    latest_step,
    run,
    snapshot,
    spawn,
    steps_logged,
    strict_json,
)

UNRECORDABLE = {
    "a generator": "(i for i in range(3))",
    "a set": "{1, 2}",
    "bytes": "b'x'",
    "a tensor": "torch.ones(2)",
    "nan": "float('nan')",
    "a nested inf": "{'scales': [1.0, float('inf')]}",
}


def script_with_extra(tmp_path: Path, expression: str) -> Path:
    """The hostile script with one more CONFIG default, ``extra = expression``."""
    text = SCRIPT.replace('"setup_sleep": 0.0}', f'"setup_sleep": 0.0, "extra": {expression}}}')
    assert text != SCRIPT
    path = tmp_path / "hostile_script.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(UNRECORDABLE))
def test_a_config_value_no_checkpoint_can_record_is_refused_before_training(
    capsys, tmp_path, safe_signals, case
):
    path = script_with_extra(tmp_path, UNRECORDABLE[case])
    for as_json in ((), ("--json",)):
        code, stdout, err = run(capsys, path, tmp_path / "run", *as_json)
        assert code == 2, err
        check_clean(err, "CONFIG['extra']", script=path)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tuple_default_resumes(capsys, tmp_path, safe_signals):
    path = script_with_extra(tmp_path, "(1, 2)")  # recorded as a list in state.json
    out = tmp_path / "run"
    code, _, err = run(capsys, path, out, "--checkpoint-every", "2", steps=4)
    assert code == 0, err
    code, _, err = run(capsys, path, out, "--resume", "--checkpoint-every", "2", steps=6)
    assert code == 0, err
    check_clean(err, script=path, error=False)
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]


SCRIPT_EXITS = {
    "sys.exit(0)": ("exit0", "SystemExit"),
    "sys.exit(5)": ("exit5", "SystemExit"),
    "a BaseException subclass": ("BaseBug", "BaseBug"),
}


@pytest.mark.parametrize("case", sorted(SCRIPT_EXITS))
@pytest.mark.parametrize("where", ["loss", "next_batch"])
def test_a_script_that_exits_or_raises_a_base_exception_is_a_failed_run(
    capsys, script, tmp_path, safe_signals, case, where
):
    what, name = SCRIPT_EXITS[case]
    out = tmp_path / "run"
    code, _, err = run(capsys, script, out, "--set", f"fail={where}:{what}:4")
    assert code == 1, err  # never the script's own exit code, never a success
    check_clean(err, where, name, "step 4", script=script)
    assert latest_step(out) == 3 and steps_logged(out) == [1, 2, 3]


def test_keyboard_interrupt_raised_by_the_script_is_a_saved_stop(
    capsys, script, tmp_path, safe_signals
):
    out = tmp_path / "run"
    code, _, err = run(capsys, script, out, "--set", "fail=next_batch:KeyboardInterrupt:4")
    assert code == 130, err
    check_clean(err, "step 3", "step-00000003", script=script)
    assert latest_step(out) == 3


def test_a_value_error_in_the_first_step_names_the_loss_and_the_line(
    capsys, script, tmp_path, safe_signals
):
    out = tmp_path / "run"
    code, _, err = run(capsys, script, out, "--set", "fail=loss:ValueError:1")
    assert code == 2, err
    check_clean(err, "loss", "hostile_script.py line", "got a bad value")
    assert latest_step(out) is None


def _run_to(tmp_path: Path, stdout, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "hostile_script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "minitrain", "run", str(script), "--no-report",
               "--steps", "6", "--out", str(tmp_path / "run"), *args]
    return subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          timeout=120)


@pytest.mark.parametrize("as_json", [(), ("--json",)])
def test_a_full_stdout_is_one_line_and_the_summary_is_saved(tmp_path, as_json):
    with open("/dev/full", "w") as full:
        done = _run_to(tmp_path, full, *as_json)
    assert done.returncode == 1, done.stderr
    check_clean(done.stderr, "standard output", "no space left on device", "summary.json")
    strict_json((tmp_path / "run" / "summary.json").read_text())
    assert latest_step(tmp_path / "run") == 6


def test_a_closed_pipe_is_one_line_and_the_summary_is_saved(tmp_path):
    script = tmp_path / "hostile_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    proc = spawn("run", script, "--no-report", "--steps", "6", "--out", out)
    proc.stdout.close()  # nobody reads the summary
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 1, err
    check_clean(err, "standard output", "broken pipe", "summary.json")
    strict_json((out / "summary.json").read_text())


def test_sigterm_before_training_starts_exits_130_with_a_line(tmp_path):
    script = tmp_path / "hostile_script.py"
    script.write_text(SCRIPT)
    marker = Path(f"{script}.started")
    proc = spawn("run", script, "--no-report", "--out", tmp_path / "run", "--set",
                 "setup_sleep=60")
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    check_clean(err, "interrupted", script=script)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_nan_written_into_metrics_by_hand_names_the_file_and_line(
    capsys, script, tmp_path, safe_signals
):
    out = tmp_path / "run"
    code, _, err = run(capsys, script, out, "--checkpoint-every", "2", "--keep", "10")
    assert code == 0, err
    lines = (out / "metrics.jsonl").read_text().splitlines()
    record = lines[2]
    start = record.index('"loss": ') + len('"loss": ')
    lines[2] = record[:start] + "NaN" + record[record.index(",", start):]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = snapshot(out)
    code, _, err = run(capsys, script, out, "--resume", "--keep", "10", steps=8)
    assert code == 2, err
    check_clean(err, "metrics.jsonl", "line 3", script=script)
    check_kept(before, out)


def test_an_error_in_a_module_the_script_imports_names_both_lines(capsys, tmp_path, safe_signals):
    (tmp_path / "user_helpers.py").write_text("def build(config):\n    return config['missing']\n")
    path = tmp_path / "uses_helpers.py"
    path.write_text(
        "import sys\nsys.path.insert(0, __file__.rsplit('/', 1)[0])\nimport user_helpers\n"
        "CONFIG = {'lr': 0.1}\n\ndef experiment(config):\n    return user_helpers.build(config)\n"
    )
    code, _, err = run(capsys, path, tmp_path / "run")
    assert code == 2, err
    check_clean(err, "KeyError", "user_helpers.py line 2, called from line 7")


def test_a_set_key_given_twice_with_two_values_is_refused(capsys, tmp_path, script,
                                                         safe_signals):
    run_dir = tmp_path / "run"
    code, _, err = run(capsys, script, run_dir, "--set", "lr=0.1", "--set", "lr=0.2")
    assert code == 2, err
    check_clean(err, "--set lr is given twice", "0.1, then 0.2")
    assert not run_dir.exists()
    code, _, err = run(capsys, script, run_dir, "--set", "lr=0.1", "--set", "lr=0.1")
    assert code == 0, err
