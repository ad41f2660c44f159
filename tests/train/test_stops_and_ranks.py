"""Stops that the script's code does not let happen, failing saves, forked writers and
``--nproc 2`` ranks that hang, each in a real subprocess.

Expected: exit 130 with one ``error:`` line naming the last good checkpoint for every mix of
SIGINT, SIGTERM and SIGHUP (a second signal, or a hang past the grace period), whether the
script sleeps in C, spins in Python or swallows ``KeyboardInterrupt``; a save that runs out of
memory or disk keeps the previous checkpoint and leaves no staging folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_hostile_harness import ROOT, check_clean, latest_step

SCRIPT = textwrap.dedent(
    '''
    import os, time, torch
    import minitrain as mt

    CONFIG = {"steps": 50, "hang_at": 4, "how": "sleep", "rank": ""}

    def experiment(config):
        calls = {"n": 0}

        def next_batch(generator):
            calls["n"] += 1
            if calls["n"] == config["hang_at"] and config["rank"] in ("", os.environ.get("RANK")):
                open(__file__ + ".hung", "w").close()
                while config["how"] in ("sleep", "spin", "stubborn"):
                    try:
                        if config["how"] == "spin":
                            while True:
                                pass
                        time.sleep(10**6)
                    except BaseException:
                        if config["how"] != "stubborn":
                            raise
                if config["how"] == "fork" and os.fork() == 0:  # the child trains on
                    return torch.randn(4, 4, generator=generator)
            return torch.randn(4, 4, generator=generator)

        return mt.Experiment(
            name="stuck", init=lambda g: {"w": torch.zeros(4)},
            loss=lambda p, x: ((x @ p["w"] - x.sum(1)) ** 2).mean(), next_batch=next_batch,
            optimizer=mt.optim.sgd(lr=0.05), steps=config["steps"])
    '''
)


def start(tmp_path, *args, env=None):
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "minitrain", "run", script, "--out", tmp_path / "run", "--json",
         "--no-report", "--checkpoint-every", "2", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "MINITRAIN_STOP_GRACE": "1", "OMP_NUM_THREADS": "1", **(env or {})},
    )
    deadline = time.monotonic() + 60
    while not Path(f"{script}.hung").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.05)
    time.sleep(0.3)  # inside the sleep or the spin
    return proc, script


def finish(proc, limit):
    start_time = time.monotonic()
    try:
        _, err = proc.communicate(timeout=limit)
    finally:
        proc.kill()
        proc.communicate()
    return proc.returncode, err, time.monotonic() - start_time


SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "HUP": signal.SIGHUP}
SECOND = [  # (how the script hangs, the signals sent, 0.1 s apart)
    ("sleep", "TERM,INT"), ("sleep", "INT,INT"), ("sleep", "HUP,TERM"), ("sleep", "INT,HUP"),
    ("spin", "TERM,TERM"), ("spin", "HUP,INT"), ("sleep", "TERM,INT,INT,HUP,TERM,INT"),
    ("spin", "INT,TERM,HUP,INT,TERM"), ("stubborn", "INT,TERM"), ("stubborn", "HUP,HUP,INT"),
    ("sleep", "TERM"), ("spin", "INT"), ("stubborn", "HUP"),  # one signal: the grace period
]


@pytest.mark.parametrize(("how", "sent"), SECOND, ids=[f"{h}-{s}" for h, s in SECOND])
def test_a_stuck_step_ends_with_130_naming_the_last_checkpoint(tmp_path, how, sent):
    proc, script = start(tmp_path, "--set", f"how={how}")
    for name in sent.split(","):
        proc.send_signal(SIGNALS[name])
        time.sleep(0.1)
    code, err, took = finish(proc, 60)
    assert code == 130, err
    check_clean(err, "checkpoint", script=script)
    line = next(line for line in err.splitlines() if line.startswith("error:"))
    assert latest_step(tmp_path / "run") in (2, 3)
    assert f"step-{latest_step(tmp_path / 'run'):08d}" in line, line
    assert took < 1 + 5 + 10, f"took {took:.1f} s"  # grace + force delay + slack
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_a_stopped_job_whose_rank_does_not_stop_says_so_once(tmp_path):
    """Ctrl-C or SIGTERM to a ``--nproc 2`` job whose rank 1 sleeps in its script: that rank
    is forced out after the grace period, and the launcher prints its one line (no worker
    writes its own beside it)."""
    proc, script = start(tmp_path, "--nproc", "2", "--set", "rank=1")
    proc.send_signal(signal.SIGTERM)
    code, err, took = finish(proc, 60)
    assert code == 130, err
    check_clean(err, "did not stop", "checkpoint", script=script)
    assert took < 1 + 5 + 10, f"took {took:.1f} s"


def test_a_forked_child_of_the_script_never_writes_to_the_run(tmp_path):
    proc, script = start(tmp_path, "--set", "how=fork", "--set", "steps=6")
    code, err, _ = finish(proc, 60)
    assert code == 0, err
    assert "only the run's own process writes there" in err  # the child's one line
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == ["step-00000002", "step-00000004", "step-00000006"]


SAVE_FAILS = textwrap.dedent(
    '''
    import errno, sys, torch
    from minitrain import checkpoint, checkpoint_state

    run, how = sys.argv[1], sys.argv[2]
    checkpoint.save(run, 1, {"w": torch.ones(3)}, {})
    real = checkpoint_state.save_tensors

    def failing(tensors, path, pytree):
        real(tensors, path, pytree)  # a part of the file is written, then memory or disk ends
        if how == "memory":
            raise MemoryError("out of memory")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    checkpoint.save_tensors = failing
    try:
        checkpoint.save(run, 2, {"w": torch.zeros(3)}, {})
    except (MemoryError, Exception) as exc:
        print(type(exc).__name__, exc)
    '''
)


@pytest.mark.parametrize("how", ["memory", "disk"])
def test_a_save_that_runs_out_of_memory_or_disk_keeps_the_previous_checkpoint(tmp_path, how):
    import torch

    from minitrain import checkpoint

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", SAVE_FAILS, run, how], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("memoryerror" if how == "memory" else "no space left") in done.stdout.lower()
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-00000001"]
    loaded = checkpoint.load(checkpoint.latest_valid(run), {"w": torch.empty(3)}, {})
    assert loaded.params["w"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001"]


@pytest.mark.parametrize("how", ["sleep", "spin"])
def test_a_hung_rank_is_named_with_what_it_was_doing(tmp_path, how):
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "minitrain", "run", script, "--nproc", "2", "--set", "rank=1",
         "--set", f"how={how}", "--set", "steps=20", "--no-report", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "MINITRAIN_DIST_TIMEOUT": "5", "MINITRAIN_STOP_GRACE": "1"},
    )
    assert done.returncode == 1, done.stderr
    check_clean(done.stderr, "rank 1 made no progress for", "in next_batch", script=script)
    assert "SIGKILL" not in done.stderr
