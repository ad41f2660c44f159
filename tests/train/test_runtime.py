"""The runtime as users meet it: kill -9 and resume bit for bit, Ctrl-C, NaN guard, corruption."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minitrain import checkpoint
from minitrain.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
LINREG = str(ROOT / "examples" / "linreg.py")
BYTELM = str(ROOT / "examples" / "bytelm.py")

LINREG_ARGS = ["--steps", "1000", "--checkpoint-every", "50", "--log-every", "5", "--no-report"]
# A small byte-level model on a small prepared corpus: slow enough to kill mid-run, fast in CI.
BYTELM_SETS = [
    "d_model=32",
    "n_layers=1",
    "n_heads=2",
    "seq_len=32",
    "batch_size=8",
    "eval_every=0",
    "eval_batches=2",
]
BYTELM_ARGS = ["--steps", "60", "--checkpoint-every", "4", "--log-every", "2", "--no-report"]


# The ops are tiny: one intra-op thread is fastest, and far faster on a busy machine.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args, cwd=None):
    return [sys.executable, "-m", "minitrain", *args]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = checkpoint.list_checkpoints(run_dir)[-1]
    return load_file(latest / "params.safetensors")


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["step"] if lines else 0


def kill_at_random_points(args, run_dir: Path, total: int, kills: int, seed: int) -> int:
    """Start, SIGKILL at ``kills`` random progress points, resuming after each; finish."""
    chooser = random.Random(seed)
    killed = 0
    for _ in range(kills):
        done = logged_steps(run_dir)
        if done >= total * 0.9:
            break
        target = chooser.randint(done + 1, done + max(2, (total - done) // 3))
        proc = subprocess.Popen(
            cli(*args, "--out", str(run_dir), "--resume", "--json"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=ONE_THREAD,
        )
        deadline = time.monotonic() + 120
        while proc.poll() is None and logged_steps(run_dir) < target:
            assert time.monotonic() < deadline, "run made no progress"
            time.sleep(0.01)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.wait()
    finish = subprocess.run(
        cli(*args, "--out", str(run_dir), "--resume", "--json"), capture_output=True, text=True,
        env=ONE_THREAD,
    )
    assert finish.returncode == 0, finish.stderr
    return killed


@pytest.mark.parametrize(
    ("script", "args", "total"),
    [
        (LINREG, LINREG_ARGS, 1000),
        (BYTELM, [*BYTELM_ARGS, *sum((["--set", s] for s in BYTELM_SETS), [])], 60),
    ],
    ids=["linreg", "bytelm"],
)
def test_sigkill_and_resume_is_bit_identical(tmp_path, script, args, total, bytelm_data):
    args = [a.replace("{data}", str(bytelm_data)) for a in args]
    if script == BYTELM:
        args += ["--set", f"data_dir={bytelm_data}"]
    reference = subprocess.run(
        cli("run", script, *args, "--out", str(tmp_path / "ref"), "--json"),
        capture_output=True,
        text=True,
        env=ONE_THREAD,
    )
    assert reference.returncode == 0, reference.stderr
    killed = kill_at_random_points(["run", script, *args], tmp_path / "run", total, 3, seed=0)
    assert killed >= 2  # most kills land mid-run
    assert_bit_identical(final_params(tmp_path / "ref"), final_params(tmp_path / "run"))
    # The log reads as one uninterrupted run.
    ref_log = [(row["step"], row["loss"]) for row in read_metrics(tmp_path / "ref")]
    assert ref_log == [(row["step"], row["loss"]) for row in read_metrics(tmp_path / "run")]


@pytest.fixture(scope="module")
def bytelm_data(tmp_path_factory):
    """A small prepared corpus: a slice of the standard library, prepared once per module."""
    from minitrain.data import prepare, source_files, stdlib_dir

    source = tmp_path_factory.mktemp("src")
    for path in source_files(stdlib_dir())[:40]:
        (source / path.name).write_bytes(path.read_bytes())
    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(out, source)
    return out


def test_sigint_checkpoints_and_exits_130(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli("run", LINREG, "--steps", "100000", "--out", str(run_dir), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while logged_steps(run_dir) < 20:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "checkpoint saved" in err and "--resume" in err and "Traceback" not in err
    saved = checkpoint.latest_valid(run_dir)
    assert saved is not None and checkpoint.verify(saved)["step"] >= 20


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    from minitrain.cli import main

    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "run",
                LINREG,
                "--set",
                "lr=5",
                "--steps",
                "400",
                "--out",
                str(run_dir),
                "--checkpoint-every",
                "5",
                "--json",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "loss became" in err
    saved = checkpoint.list_checkpoints(run_dir)
    assert saved, "a checkpoint from before the divergence"
    for path in saved:
        state = checkpoint.verify(path)
        params = load_file(path / "params.safetensors")
        assert all(torch.isfinite(t).all() for t in params.values()), state["step"]


def test_corrupt_latest_checkpoint_is_skipped_on_resume(tmp_path, capsys):
    from minitrain.cli import main

    run_dir = tmp_path / "run"
    args = [
        "run",
        LINREG,
        "--steps",
        "40",
        "--out",
        str(run_dir),
        "--checkpoint-every",
        "10",
        "--json",
    ]
    with pytest.raises(SystemExit):
        main(args)
    capsys.readouterr()
    paths = checkpoint.list_checkpoints(run_dir)
    newest = paths[-1]
    data = bytearray((newest / "params.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "params.safetensors").write_bytes(bytes(data))
    with pytest.raises(SystemExit) as exit_info:
        main([*args[:3], "50", *args[4:], "--resume"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 0
    assert f"skipping checkpoint {newest.name}" in err
    assert f"resuming from {paths[-2]}" in err


def test_resident_memory_stays_flat_over_20000_steps(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        cli(
            "run",
            LINREG,
            "--steps",
            "20000",
            "--log-every",
            "500",
            "--out",
            str(run_dir),
            "--no-report",
            "--json",
        ),
        capture_output=True,
        text=True,
        env=ONE_THREAD,
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(run_dir)
    rss = [row["rss_bytes"] for row in rows if row["step"] >= 2000]  # after warm-up
    assert len(rss) >= 30
    assert max(rss) <= 1.05 * min(rss), [r // 1024 for r in rss]


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli("run", LINREG, "--steps", "100000", "--out", str(run_dir), "--json"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while logged_steps(run_dir) < 10:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "checkpoint saved" in err
