# ruff: noqa: F811
"""Hostile-input cases that the one fit loop holds (run, sweep and --nproc share it).

Script errors at any step (init, next_batch, the loss, evaluate, aux values: exceptions and
junk return values), a resume whose config changes a shape, non-finite and out-of-range numbers,
--steps 0 as strict JSON, signals raised from inside the script or the library (during a save, a
metrics write, the report), bursts of real signals, SIGTERM under --nproc 2, an --out that cannot
take the run's files (checked before the first step), an unlistable checkpoints folder, a resume
where every checkpoint fails its checks, and real file-size limits (RLIMIT_FSIZE). Each case
asserts the exit code, a clean message (no traceback through minitrain's frames) and that no
earlier checkpoint or log line was lost.
"""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import signal
import time
from pathlib import Path

import pytest
from test_hostile_edited_files import run_mismatch_case, trained, used  # noqa: F401
from test_hostile_harness import (
    SCRIPT,
    check_clean,
    check_kept,
    latest_step,
    run,
    snapshot,
    spawn,
    steps_logged,
    strict_json,
    wait_for_lines,
)
from test_hostile_limits import run_refused_case
from test_hostile_oserrors import CAUSE, _dir, _file, fail_writes, no_staging_left, run_shape_case
from test_hostile_ownership import finished  # noqa: F401
from test_hostile_script_errors import AUX, EVAL, EVERY2, NO_OUT, OUT, run_script_case
from test_hostile_stops import EVAL_END, run_in_script_case, run_library_case

import minitrain.accounting
from minitrain import checkpoint, metrics

# --------------------------------------------------------------------------- script errors

LOOP_SCRIPT_ERRORS = {
    "next_batch:KeyError:1": ((), OUT, "1", "next_batch|step 1|KeyError", "n"),
    "next_batch:KeyError:5": ((), OUT, "1", "next_batch|step 5|KeyError", "4"),
    "next_batch:ZeroDivisionError:1": ((), OUT, "1", "next_batch|step 1|ZeroDivisionError", "n"),
    "next_batch:ZeroDivisionError:5": ((), OUT, "1", "next_batch|step 5|ZeroDivisionError", "4"),
    "next_batch:UserBug:1": ((), OUT, "1", "next_batch|step 1|UserBug", "n"),
    "next_batch:UserBug:5": ((), OUT, "1", "next_batch|step 5|UserBug", "4"),
    "loss:KeyError:1": ((), OUT, "1", "loss|step 1|KeyError", "n"),
    "loss:KeyError:5": ((), OUT, "1", "loss|step 5|KeyError", "4"),
    "loss:ZeroDivisionError:1": ((), OUT, "1", "loss|step 1|ZeroDivisionError", "n"),
    "loss:ZeroDivisionError:5": ((), OUT, "1", "loss|step 5|ZeroDivisionError", "4"),
    "loss:UserBug:1": ((), OUT, "1", "loss|step 1|UserBug", "n"),
    "loss:UserBug:5": ((), OUT, "1", "loss|step 5|UserBug", "4"),
    "evaluate:KeyError:1": (EVAL, OUT, "1", "evaluate|step 1|KeyError", "n,0,1"),
    "evaluate:KeyError:5": (EVAL, OUT, "1", "evaluate|step 5|KeyError", "4,5"),
    "evaluate:ZeroDivisionError:1": (EVAL, OUT, "1", "evaluate|step 1|ZeroDivisionError", "n,0,1"),
    "evaluate:ZeroDivisionError:5": (EVAL, OUT, "1", "evaluate|step 5|ZeroDivisionError", "4,5"),
    "evaluate:UserBug:1": (EVAL, OUT, "1", "evaluate|step 1|UserBug", "n,0,1"),
    "evaluate:UserBug:5": (EVAL, OUT, "1", "evaluate|step 5|UserBug", "4,5"),
    "init:KeyError:1": ((), OUT, "1", "init|KeyError", "n"),
    "init:ZeroDivisionError:1": ((), OUT, "1", "init|ZeroDivisionError", "n"),
    "init:UserBug:1": ((), OUT, "1", "init|UserBug", "n"),
    "aux:KeyError:1": (AUX, OUT, "1", "step|KeyError", "n"),
    "aux:KeyError:5": (AUX, OUT, "1", "step|KeyError", "4"),
    "init:str:1": ((), OUT, "12", "init", "n"),
    "init:none:1": ((), OUT, "12", "init", "n"),
    "init:list:1": ((), OUT, "12", "init", "n"),
    "init:int64:1": ((), OUT, "12", "init", "n"),
    "next_batch:none:1": ((), OUT, "12", "step", ""),
    "next_batch:str:5": ((), OUT, "12", "step 5", ""),
    "next_batch:list:3": ((), OUT, "12", "step", ""),
    "loss:str:1": ((), OUT, "12", "loss", ""),
    "loss:vector:1": ((), OUT, "12", "loss", ""),
    "loss:vector:5": ((), OUT, "12", "loss", ""),
    "loss:none:5": ((), OUT, "12", "loss", ""),
    "evaluate:list:1": (EVAL, OUT, "12", "evaluate", ""),
    "evaluate:str:1": (EVAL, OUT, "12", "evaluate", ""),
    "evaluate:dictstr:3": (EVAL, OUT, "12", "evaluate", ""),
    "evaluate:none:2": (EVAL, OUT, "12", "evaluate", ""),
    "aux:str:1": (AUX, OUT, "12", "aux", ""),
    "aux:dictstr:1": (AUX, OUT, "12", "aux", ""),
    "aux:dictvec:5": (AUX, OUT, "12", "aux", ""),
    "aux:list:5": (AUX, OUT, "12", "aux", ""),
    "loss:KeyError:5/no-out": ((), NO_OUT, "1", "loss|step 5|KeyError", ""),
    "next_batch:UserBug:1/no-out": ((), NO_OUT, "1", "next_batch|step 1", ""),
    "loss:KeyError:5/every2": ((), EVERY2, "1", "loss|step 5", "4"),
    "next_batch:UserBug:3/every2": ((), EVERY2, "1", "next_batch|step 3", "2"),
}


@pytest.mark.parametrize("case", sorted(LOOP_SCRIPT_ERRORS))
def test_loop_script_error(capsys, script, tmp_path, safe_signals, case):
    run_script_case(capsys, script, tmp_path, case, LOOP_SCRIPT_ERRORS[case])


# --------------------------------------------------------------------------- edited files

LOOP_RESUME_MISMATCH = {
    "another dim": (("--set", "dim=5"), "dim"),
}


@pytest.mark.parametrize("case", sorted(LOOP_RESUME_MISMATCH))
def test_loop_resume_mismatch(capsys, used, case):
    run_mismatch_case(capsys, used, LOOP_RESUME_MISMATCH[case])


# --------------------------------------------------------------------------- limits

LOOP_REFUSED = {
    "--steps 2**63": (("--steps", str(2**63)), "--steps"),
    "--steps 10**19": (("--steps", str(10**19)), "--steps"),
    "--seed 2**64": (("--seed", str(2**64)), "--seed"),
    "--seed 2**63": (("--seed", str(2**63)), "--seed"),
    "--set lr=inf": (("--set", "lr=inf"), "lr"),
    "--set lr=1e400": (("--set", "lr=1e400"), "lr"),
    "--set dim=10**20": (("--set", f"dim={10**20}"), "dim"),
    "--set dim=-2**63-1": (("--set", f"dim={-2**63 - 1}"), "dim"),
}


@pytest.mark.parametrize("case", sorted(LOOP_REFUSED))
def test_loop_refused(capsys, script, tmp_path, safe_signals, case):
    run_refused_case(capsys, script, tmp_path, LOOP_REFUSED[case])


@pytest.mark.parametrize("out", [False, True])
def test_zero_steps_prints_json_without_nan(capsys, script, tmp_path, safe_signals, out):
    run_dir = tmp_path / "run" if out else None
    code, stdout, err = run(capsys, script, run_dir, steps=0)
    assert code in (0, 2), err
    if code == 2:
        check_clean(err, "--steps", script=script)
        return
    strict_json(stdout)
    if out:
        strict_json((run_dir / "summary.json").read_text())


# --------------------------------------------------------------------------- stops

LOOP_IN_SCRIPT = {
    "loss:sigint2:3": ((), "2,3"),
    "loss:sigint3:3": ((), "2,3"),
    "next_batch:sigterm:6": ((), "5,6"),
    "next_batch:sigint2:4": ((), "3,4"),
    "init:sigterm:1": ((), "n"),
    "init:sigint:1": ((), "n"),
    "evaluate:sigterm:1/at the end": (EVAL_END, "6"),
}


@pytest.mark.parametrize("case", sorted(LOOP_IN_SCRIPT))
def test_loop_signal_from_the_script(capsys, script, tmp_path, safe_signals, case):
    run_in_script_case(capsys, script, tmp_path, case, LOOP_IN_SCRIPT[case])


LOOP_LIBRARY = {
    "ctrl-c twice during a checkpoint save": (checkpoint, "save", signal.SIGINT, 2, "2", "2"),
    "during the final save": (checkpoint, "save", signal.SIGTERM, 1, "6", "6"),
    "burst during a metrics write": (metrics.MetricsWriter, "write", signal.SIGINT, 3, "3", "3"),
    "during the report": (minitrain.accounting, "resource_report", signal.SIGTERM, 1, "", "6"),
}


@pytest.mark.parametrize("case", sorted(LOOP_LIBRARY))
def test_loop_signal_inside_the_library(capsys, script, tmp_path, monkeypatch, safe_signals,
                                           case):
    run_library_case(capsys, script, tmp_path, monkeypatch, LOOP_LIBRARY[case])


@pytest.mark.parametrize(("seed", "sig"),
                         [(1, signal.SIGTERM), (3, signal.SIGINT), (5, signal.SIGHUP)])
def test_a_burst_of_signals_at_a_random_moment(script, tmp_path, seed, sig):
    chance = random.Random(seed)
    out = tmp_path / "run"
    proc = spawn("run", script, "--steps", "100000", "--no-report", "--json", "--out", out,
                 "--checkpoint-every", "25", "--set", "sleep=0.002")
    wait_for_lines(out / "metrics.jsonl", chance.randint(5, 60), proc)
    for _ in range(chance.randint(1, 5)):
        proc.send_signal(sig)
        time.sleep(chance.uniform(0.0, 0.02))
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    check_clean(err, "step", script=script)
    last = steps_logged(out)[-1]
    assert latest_step(out) == last, (latest_step(out), last)


def test_sigterm_under_nproc_2_exits_130(script, tmp_path):
    out = tmp_path / "run"
    proc = spawn("run", script, "--nproc", "2", "--steps", "100000", "--no-report", "--json",
                 "--out", out, "--set", "sleep=0.002", "--set", "batch_size=4")
    wait_for_lines(out / "metrics.jsonl", 10, proc, timeout=120)
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert latest_step(out) is not None


# --------------------------------------------------------------------------- OS errors

LOOP_SHAPES = {
    "--out under a regular file": (_file, "file", (1, 2), ("file", "not a directory")),
    "--out deep under a regular file": (_file, "file", (1, 2), ("file", "not a directory")),
    "checkpoints is a file": (_file, "run/checkpoints", (1,), ("checkpoints", "not a directory")),
    "summary.json is a directory": (_dir, "run/summary.json", (1,), ("summary.json", "directory")),
    "metrics.jsonl is a directory": (_dir, "run/metrics.jsonl", (1,), ("metrics.jsonl", "dir")),
}


@pytest.mark.parametrize("case", sorted(LOOP_SHAPES))
def test_loop_misshapen_run_directory(capsys, script, tmp_path, safe_signals, case):
    run_shape_case(capsys, script, tmp_path, case, LOOP_SHAPES[case])


@pytest.fixture
def trained_run(tmp_path, capsys):
    """A finished 6-step run with checkpoints at 2, 4 and 6: (script, run directory)."""
    path = tmp_path / "hostile_script.py"
    path.write_text(SCRIPT)
    code, _, err = run(capsys, path, tmp_path / "run", "--checkpoint-every", "2", "--keep", "10")
    assert code == 0, err
    return path, tmp_path / "run"


SAVE_FAILS = {  # id: (errno, step whose save fails, --checkpoint-every)
    "ENOSPC periodic save": (errno.ENOSPC, 4, 2),
    "EFBIG periodic save": (errno.EFBIG, 4, 2),
    "EIO periodic save": (errno.EIO, 4, 2),
    "EDQUOT periodic save": (errno.EDQUOT, 2, 2),
    "ENOSPC final save": (errno.ENOSPC, 6, 0),
    "EFBIG final save": (errno.EFBIG, 6, 0),
    "EIO final save": (errno.EIO, 6, 0),
}


@pytest.mark.parametrize("case", sorted(SAVE_FAILS))
def test_a_failed_checkpoint_save(capsys, script, tmp_path, monkeypatch, safe_signals, case):
    errno_, step, every = SAVE_FAILS[case]
    out = tmp_path / "run"
    fail_writes(monkeypatch, (f"step-{step:08d}", "state.json"), errno_)
    code, stdout, err = run(capsys, script, out, "--checkpoint-every", every, "--keep", "10")
    monkeypatch.undo()
    assert code == 1, err
    check_clean(err, f"step-{step:08d}", CAUSE[errno_], script=script)
    assert no_staging_left(out) and not (out / f"checkpoints/step-{step:08d}").exists()
    assert latest_step(out) == (step - every if every and step > every else None)
    assert steps_logged(out) == list(range(1, step + 1))


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EIO])
def test_a_failed_save_after_resume_keeps_every_checkpoint(capsys, trained_run, monkeypatch,
                                                           safe_signals, errno_):
    path, out = trained_run
    before = snapshot(out)
    fail_writes(monkeypatch, ("step-00000008", "state.json"), errno_)
    code, stdout, err = run(capsys, path, out, "--resume", "--checkpoint-every", "2", "--keep",
                            "1", steps=10)
    monkeypatch.undo()
    assert code == 1, err
    check_clean(err, "step-00000008", CAUSE[errno_], script=path)
    check_kept(before, out)
    assert no_staging_left(out) and latest_step(out) == 6


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_a_failed_metrics_write(capsys, script, tmp_path, monkeypatch, safe_signals, errno_):
    out = tmp_path / "run"
    fail_writes(monkeypatch, ("metrics.jsonl",), errno_, after=2)
    code, stdout, err = run(capsys, script, out, "--checkpoint-every", "2", "--keep", "10")
    monkeypatch.undo()
    assert code == 1, err
    check_clean(err, str(out / "metrics.jsonl"), CAUSE[errno_], script=script)
    assert steps_logged(out) == [1, 2]  # whole lines only: the half line was cut off
    assert latest_step(out) == 2


def test_a_full_disk_while_resuming_the_log_changes_nothing(capsys, trained_run, monkeypatch,
                                                            safe_signals):
    path, out = trained_run
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + '{"step": 7}\n')
    before = snapshot(out)
    fail_writes(monkeypatch, (".metrics.jsonl.",), errno.ENOSPC)
    code, stdout, err = run(capsys, path, out, "--resume", steps=8)
    monkeypatch.undo()
    assert code == 1, err
    check_clean(err, "metrics.jsonl", "no space left on device", script=path)
    assert snapshot(out) == before


def _limited(size):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def test_real_file_size_limit_on_metrics(tmp_path):
    """RLIMIT_FSIZE: the kernel refuses to grow metrics.jsonl past 48 KiB (EFBIG)."""
    path = tmp_path / "hostile_script.py"
    path.write_text(SCRIPT)
    out = tmp_path / "run"
    proc = spawn("run", path, "--steps", "2000", "--no-report", "--json", "--out", out,
                 "--checkpoint-every", "100", "--keep", "50", preexec_fn=_limited(48 * 1024))
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    check_clean(err, str(out / "metrics.jsonl"), "file too large", script=path)
    logged = steps_logged(out)
    assert logged == list(range(1, len(logged) + 1)) and 100 <= len(logged) < 2000
    assert latest_step(out) == len(logged) // 100 * 100
    for ckpt in checkpoint.list_checkpoints(out):
        checkpoint.verify(ckpt)


def test_real_file_size_limit_on_the_first_checkpoint(tmp_path):
    """RLIMIT_FSIZE of 8 KiB: state.json (about 40 KiB) cannot be written."""
    path = tmp_path / "hostile_script.py"
    path.write_text(SCRIPT)
    out = tmp_path / "run"
    proc = spawn("run", path, "--steps", "4", "--no-report", "--json", "--out", out,
                 "--checkpoint-every", "2", preexec_fn=_limited(8 * 1024))
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    check_clean(err, "step-00000002", "file too large", script=path)
    assert no_staging_left(out) and checkpoint.list_checkpoints(out) == []
    assert steps_logged(out) == [1, 2]


@pytest.mark.parametrize("case", ["checkpoints is a file", "summary.json is a directory",
                                  "metrics.jsonl is a directory"])
def test_an_unwritable_run_directory_fails_before_the_first_step(capsys, script, tmp_path,
                                                                 safe_signals, case):
    obstacle, where, codes, words = LOOP_SHAPES[case]
    obstacle(tmp_path / where)
    code, stdout, err = run(capsys, script, tmp_path / "run", "--set",
                            "fail=next_batch:UserBug:2", steps=6)
    assert code in codes, err
    check_clean(err, *words, script=script)
    assert "gave up" not in err  # it never reached step 2
    assert steps_logged(tmp_path / "run") in ([], [None]) or case.startswith("metrics")


def _refuse_under(monkeypatch, root, errno_):
    """os.open and os.mkdir of anything under ``root`` raise ``errno_`` (a read-only mount)."""
    real_open, real_mkdir = os.open, os.mkdir

    def check(path):
        if str(os.fspath(path)).startswith(str(root)):
            raise OSError(errno_, os.strerror(errno_), str(path))

    def open_(path, *args, **kwargs):
        check(path)
        return real_open(path, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        check(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("errno_", [errno.EROFS, errno.EACCES])
def test_a_read_only_out(capsys, script, tmp_path, monkeypatch, safe_signals, errno_):
    out = tmp_path / "run"
    out.mkdir()
    _refuse_under(monkeypatch, out, errno_)
    code, stdout, err = run(capsys, script, out, "--checkpoint-every", "2")
    monkeypatch.undo()
    assert code == 1, err
    check_clean(err, str(out), CAUSE[errno_], script=script)
    assert list(out.iterdir()) == []


def test_an_unlistable_checkpoints_dir_on_resume(capsys, trained_run, monkeypatch, safe_signals):
    path, out = trained_run
    before = snapshot(out)
    real_listdir = os.listdir

    def listdir(where="."):
        if Path(where) == out / "checkpoints":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(where))
        return real_listdir(where)

    monkeypatch.setattr(os, "listdir", listdir)
    code, stdout, err = run(capsys, path, out, "--resume", steps=8)
    monkeypatch.undo()
    assert code == 1, err
    check_clean(err, "checkpoints", "permission denied", script=path)
    assert snapshot(out) == before


def test_every_checkpoint_unreadable_on_resume_changes_nothing(capsys, trained_run, monkeypatch,
                                                               safe_signals):
    path, out = trained_run
    before = snapshot(out)
    real_read = Path.read_bytes

    def read_bytes(self):
        if self.name == "state.json":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, stdout, err = run(capsys, path, out, "--resume", steps=8)
    monkeypatch.undo()
    assert code in (1, 2), err
    check_clean(err, "checkpoint", script=path)
    assert snapshot(out) == before


# --------------------------------------------------------------------------- ownership


def test_a_fresh_run_into_a_used_directory_refuses(capsys, script, finished, safe_signals):
    before = snapshot(finished)
    summary = (finished / "summary.json").read_bytes()
    code, stdout, err = run(capsys, script, finished)
    assert code == 2, err
    check_clean(err, str(finished), "--resume", "--overwrite", script=script)
    assert snapshot(finished) == before and (finished / "summary.json").read_bytes() == summary


def test_a_fresh_run_into_a_directory_with_metrics_only_refuses(capsys, script, tmp_path,
                                                                 safe_signals):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    code, stdout, err = run(capsys, script, out)
    assert code == 2, err
    check_clean(err, "--overwrite", script=script)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def test_a_fresh_run_with_another_seed_into_a_used_directory_refuses(capsys, script, finished,
                                                                     safe_signals):
    before = snapshot(finished)
    code, stdout, err = run(capsys, script, finished, "--seed", "7")
    assert code == 2, err
    check_clean(err, "--overwrite", script=script)
    assert snapshot(finished) == before


def test_overwrite_starts_clean(capsys, script, finished, safe_signals):
    code, stdout, err = run(capsys, script, finished, "--overwrite", "--seed", "5", steps=3)
    assert code == 0, err
    assert steps_logged(finished) == [1, 2, 3]
    assert [p.name for p in checkpoint.list_checkpoints(finished)] == ["step-00000003"]
    assert json.loads((finished / "summary.json").read_text())["seed"] == 5


def test_overwrite_of_a_new_directory_is_a_fresh_run(capsys, script, tmp_path, safe_signals):
    code, stdout, err = run(capsys, script, tmp_path / "new", "--overwrite")
    assert code == 0, err
    assert steps_logged(tmp_path / "new") == [1, 2, 3, 4, 5, 6]


def test_resume_of_a_finished_run_changes_nothing(capsys, script, finished, safe_signals):
    before = snapshot(finished)
    summary = (finished / "summary.json").read_bytes()
    code, stdout, err = run(capsys, script, finished, "--resume")
    assert code == 0, err
    assert "finished" in err.lower() or "finished" in stdout.lower(), err
    check_clean(err, script=script, error=False)
    assert snapshot(finished) == before and (finished / "summary.json").read_bytes() == summary


@pytest.fixture(scope="module")
def holder(tmp_path_factory):
    """A real run writing to its --out for the whole module: (process, script, run dir)."""
    root = tmp_path_factory.mktemp("holder")
    path = root / "hostile_script.py"
    path.write_text(SCRIPT)
    out = root / "run"
    proc = spawn("run", path, "--steps", "1000000", "--no-report", "--json", "--out", out,
                 "--checkpoint-every", "20", "--set", "sleep=0.005")
    wait_for_lines(out / "metrics.jsonl", 25, proc)
    yield proc, path, out
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except Exception:
        proc.kill()
        proc.communicate()


HOLDER_ARGS = {"a second fresh run": (), "a resume": ("--resume",),
               "an overwrite": ("--overwrite",)}


@pytest.mark.parametrize("case", sorted(HOLDER_ARGS))
def test_a_live_run_directory_is_locked(capsys, holder, safe_signals, case):
    proc, path, out = holder
    code, stdout, err = run(capsys, path, out, *HOLDER_ARGS[case], "--set", "sleep=0.005",
                            "--checkpoint-every", "20", steps=1000000, limit=5)
    assert code in (1, 2), err
    check_clean(err, str(proc.pid), script=path)
    assert proc.poll() is None, "the holder must keep running"
    logged = steps_logged(out)
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= 25



def test_a_run_started_under_nohup_ignores_sighup(script, tmp_path):
    out = tmp_path / "run"
    proc = spawn("run", script, "--steps", "40", "--no-report", "--json", "--out", out,
                 "--set", "sleep=0.01",
                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_for_lines(out / "metrics.jsonl", 5, proc)
    for _ in range(3):
        proc.send_signal(signal.SIGHUP)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert steps_logged(out)[-1] == 40
