"""Data parallelism on torch.distributed: sharding, the all-reduce, the ring formula, real runs.

The end-to-end tests start real gloo workers (``minitrain run --nproc 2`` and ``torchrun``) and
compare their final params with a one-process run of the same global batch and seed.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from minitrain import checkpoint, distributed
from minitrain.accounting import allreduce_bytes, allreduce_seconds, communication_time
from minitrain.cli import launch
from minitrain.precision import get_backend
from minitrain.train import fit, load_experiment
from minitrain.train.setup import run_generators

ROOT = Path(__file__).resolve().parents[2]
LINREG = str(ROOT / "examples" / "linreg.py")
BYTELM = str(ROOT / "examples" / "bytelm.py")
BYTELM_SETS = {
    "d_model": "32",
    "n_layers": "1",
    "n_heads": "2",
    "seq_len": "32",
    "batch_size": "8",
    "warmup_steps": "4",
    "eval_every": "0",
    "eval_batches": "2",
}


def cli(*args):
    return [sys.executable, "-m", "minitrain", *args]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def sets(overrides: dict) -> list[str]:
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


def params_at(run_dir: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    path = checkpoint.list_checkpoints(run_dir)[-1] if step is None else (
        checkpoint.checkpoint_path(run_dir, step)
    )
    return load_file(path / "params.safetensors")


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-6, atol=1e-6), (
            name,
            float((a[name] - b[name]).abs().max()),
        )


def one_process(script, run_dir, steps, overrides=None, **kwargs):
    """The reference: the plain fit loop in this process, one rank."""
    experiment, config = load_experiment(script, overrides or {}, steps=steps)
    return fit(
        experiment, get_backend("cpu"), out_dir=run_dir, progress=False, config=config, **kwargs
    )


def copy_checkpoint(source_run: Path, step: int, target_run: Path) -> None:
    source = checkpoint.checkpoint_path(source_run, step)
    shutil.copytree(source, checkpoint.checkpoint_path(target_run, step))


@pytest.fixture(scope="module")
def bytelm_data(tmp_path_factory):
    """A small prepared corpus: a slice of the standard library."""
    from minitrain.data import prepare, source_files, stdlib_dir

    source = tmp_path_factory.mktemp("src")
    for path in source_files(stdlib_dir())[:40]:
        (source / path.name).write_bytes(path.read_bytes())
    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(out, source)
    return out


# --------------------------------------------------------------------------- sharding


@settings(deadline=None, max_examples=60)
@given(examples=st.integers(1, 40), world=st.integers(1, 8), dim=st.integers(1, 3))
def test_shards_tile_the_global_batch(examples, world, dim):
    if examples < world:
        with pytest.raises(distributed.ShardError, match="cannot be split"):
            distributed.shard_sizes(examples, world)
        return
    x = torch.arange(examples * dim).reshape(examples, dim)
    y = torch.arange(examples)
    shards = [distributed.shard((x, y), r, world) for r in range(world)]
    assert torch.equal(torch.cat([s[0] for s in shards]), x)
    assert torch.equal(torch.cat([s[1] for s in shards]), y)
    sizes = [len(s[1]) for s in shards]
    assert sizes == distributed.shard_sizes(examples, world)
    assert max(sizes) - min(sizes) <= 1
    # Same split as torch.tensor_split, the independent reference.
    assert sizes == [len(part) for part in torch.tensor_split(y, world)]


def test_shard_refuses_batches_without_a_shared_leading_dim():
    with pytest.raises(distributed.ShardError, match="leading dims 3, 4"):
        distributed.shard((torch.zeros(4, 2), torch.zeros(3)), 0, 2)
    with pytest.raises(distributed.ShardError, match="0-d"):
        distributed.shard(torch.tensor(1.0), 0, 2)


def test_weighted_shard_means_give_the_global_mean():
    """With unequal shards, each rank's mean weighted by n_r / n is the global mean."""
    data_parallel = distributed.DataParallel(rank=0, world_size=3, device=torch.device("cpu"))
    batch = torch.randn(7, generator=torch.Generator().manual_seed(0))
    total = 0.0
    for r in range(3):
        data_parallel.rank = r
        piece = data_parallel.shard(batch)
        total += data_parallel.weight * piece.mean()
    assert torch.allclose(total, batch.mean(), atol=1e-6)


# --------------------------------------------------------------------------- all-reduce


def test_allreduce_without_a_process_group_is_a_copy():
    tensors = [torch.ones(3), torch.arange(4.0).reshape(2, 2)]
    out = distributed.allreduce_sum(tensors)
    assert all(torch.equal(a, b) and a is not b for a, b in zip(out, tensors, strict=True))


# --------------------------------------------------------------------------- ring formula


def simulate_ring_allreduce(values: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Reduce-scatter then all-gather around a ring (Patarasuk & Yuan 2009), counting the
    elements each rank sends: an independent check of 2·(N-1)/N × size."""
    n = len(values)
    chunks = [np.array_split(v.astype(np.float64), n) for v in values]
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for round_ in range(n - 1):
            messages = []
            for r in range(n):
                index = (r - round_ + (0 if phase == "reduce-scatter" else 1)) % n
                messages.append(((r + 1) % n, index, chunks[r][index].copy()))
                sent[r] += chunks[r][index].size
            for target, index, chunk in messages:
                if phase == "reduce-scatter":
                    chunks[target][index] = chunks[target][index] + chunk
                else:
                    chunks[target][index] = chunk
    return [np.concatenate(c) for c in chunks], sent


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_allreduce_bytes_match_a_simulated_ring(ranks):
    rng = np.random.default_rng(ranks)
    size = 24 * ranks  # divisible, so every chunk is the same size
    values = [rng.standard_normal(size) for _ in range(ranks)]
    results, sent = simulate_ring_allreduce(values)
    for result in results:
        np.testing.assert_allclose(result, np.sum(values, axis=0))
    element_bytes = 4
    for elements in sent:
        assert elements * element_bytes == allreduce_bytes(size * element_bytes, ranks)


def test_communication_time_is_steps_times_one_allreduce():
    # 1e9 params in bf16 over 8 ranks at 100 GB/s: 2·7/8·2 GB / 100 GB/s = 35 ms per step.
    assert allreduce_seconds(2e9, 8, 100e9) == pytest.approx(0.035)
    days = communication_time(1e9, tokens=1e12, batch_tokens=1e6, ranks=8, bandwidth=100e9)
    assert days == pytest.approx(1e6 * 0.035)
    with pytest.raises(ValueError, match="bandwidth"):
        allreduce_seconds(1.0, 2, 0)
    with pytest.raises(ValueError, match="ranks"):
        allreduce_bytes(1.0, 0)


def test_estimate_time_shows_communication_beside_compute():
    from click.testing import CliRunner

    from minitrain.cli import cli as root

    args = ["estimate", "time", "--params", "8B", "--tokens", "15T", "--gpus", "1024"]
    result = CliRunner().invoke(root, [*args, "--interconnect-bandwidth", "50G", "--json"])
    assert result.exit_code == 0, result.output
    comm = json.loads(result.output)["communication"]
    # 8e9 params × 2 bytes, 2·1023/1024 of it per GPU per step, 15T / 4M steps.
    assert comm["allreduce_bytes_per_gpu_per_step"] == pytest.approx(2 * 1023 / 1024 * 16e9)
    assert comm["seconds"] == pytest.approx(15e12 / 4e6 * 2 * 1023 / 1024 * 16e9 / 50e9)
    text = CliRunner().invoke(root, [*args, "--interconnect-bandwidth", "50G"]).output
    assert "all-reduce" in text and "days of communication beside" in text
    assert "communication" not in CliRunner().invoke(root, [*args, "--json"]).output


# --------------------------------------------------------------------------- plumbing


def test_forward_argv_round_trips_the_run_command():
    from minitrain.cli.run import run

    argv = [LINREG, "--steps", "5", "--set", "lr=0.1", "--set", "dim=8", "--no-report",
            "--json", "--nproc", "2"]
    ctx = run.make_context("run", list(argv))
    forwarded = launch.forward_argv(ctx, drop=("nproc",))
    again = run.make_context("run", list(forwarded))
    assert "--nproc" not in forwarded
    assert {k: v for k, v in ctx.params.items() if k != "nproc"} == {
        k: v for k, v in again.params.items() if k != "nproc"
    }
    assert isinstance(ctx, click.Context)


def failure(exitcode, pid, timestamp=0):
    return SimpleNamespace(exitcode=exitcode, pid=pid, timestamp=timestamp)


def test_failures_name_the_rank_that_died():
    killed = SimpleNamespace(failures={0: failure(-15, 10), 1: failure(-9, 11)})
    with pytest.raises(launch.DistributedError, match="rank 1 .pid 11. was killed by SIGKILL"):
        launch._raise_failure(killed)
    crashed = SimpleNamespace(failures={1: failure(3, 11, 5), 0: failure(-15, 10, 6)})
    with pytest.raises(launch.DistributedError, match="rank 1 .pid 11. exited with code 3"):
        launch._raise_failure(crashed)
    reported = SimpleNamespace(failures={0: failure(130, 10)})
    with pytest.raises(SystemExit) as exit_info:
        launch._raise_failure(reported)
    assert exit_info.value.code == 130


def test_timeout_comes_from_the_environment():
    assert distributed.timeout_seconds({"MINITRAIN_DIST_TIMEOUT": "7.5"}) == 7.5
    with pytest.raises(ValueError, match="MINITRAIN_DIST_TIMEOUT"):
        distributed.timeout_seconds({"MINITRAIN_DIST_TIMEOUT": "soon"})


def test_fp8_amax_histories_are_max_reduced_across_ranks(tmp_path):
    """Each rank sees its shard; the recorded amax is the global batch's, as TE reduces it."""
    proc = subprocess.run(
        cli("run", LINREG, "--backend", "cpu-fp8", "--steps", "1", "--out", str(tmp_path / "r"),
            "--nproc", "2", "--json"),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    history = load_file(checkpoint.list_checkpoints(tmp_path / "r")[-1] / "opt_state.safetensors")
    history = history["fp8_history"]
    experiment, _ = load_experiment(LINREG, {})
    x, _ = experiment.next_batch(run_generators(0)[1])  # the global batch of step 1
    assert history[0, 0, 0] == x.abs().max()
    assert x[:2].abs().max() < x.abs().max()  # rank 0's own shard holds a smaller amax


def test_nproc_mistakes_are_one_line_errors(tmp_path):
    small = subprocess.run(
        cli("run", LINREG, "--set", "batch_size=1", "--nproc", "2"), capture_output=True, text=True
    )
    assert small.returncode == 2
    assert small.stderr.strip().splitlines() == [
        "error: a global batch of 1 examples cannot be split over 2 ranks; use a batch of at "
        "least 2 (--set batch_size=...) or fewer ranks"
    ]
    nested = subprocess.run(
        cli("run", LINREG, "--nproc", "2"),
        capture_output=True,
        text=True,
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"},
    )
    assert nested.returncode == 2
    assert "under torchrun drop --nproc" in nested.stderr
    assert "Traceback" not in small.stderr + nested.stderr


# --------------------------------------------------------------------------- real runs


def test_linreg_two_ranks_match_one_and_resume_with_one(tmp_path):
    """--nproc 2 ends where one process ends; its checkpoint resumes with one rank."""
    two = tmp_path / "two"
    proc = subprocess.run(
        cli("run", LINREG, "--steps", "200", "--checkpoint-every", "100", "--keep", "5",
            "--out", str(two), "--nproc", "2", "--json"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)  # rank 0 alone printed one summary
    assert summary["ranks"] == 2 and summary["examples_per_step"] == 4
    comm = summary["resources"]["communication"]
    assert comm["process_group"] == "gloo" and comm["gradient_bytes"] == 16 * 4
    assert comm["allreduce_bytes_per_rank"] == 2 * (2 - 1) / 2 * 16 * 4
    assert summary["resources"]["examples_per_step"] == 2  # one rank's shard
    assert json.loads((two / "summary.json").read_text())["ranks"] == 2

    one = tmp_path / "one"
    reference = one_process(LINREG, one, 200, checkpoint_every=100, keep=5)
    assert_close(params_at(two, 100), params_at(one, 100))
    assert_close(params_at(two), params_at(one))
    assert summary["final_loss"] == pytest.approx(reference.summary["final_loss"], rel=1e-5)
    metrics_two = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics_two] == list(range(1, 201))

    resumed = tmp_path / "two-then-one"
    copy_checkpoint(two, 100, resumed)
    one_process(LINREG, resumed, 200, resume=True)
    assert_close(params_at(resumed), params_at(one))


def test_bytelm_through_torchrun_resumes_a_one_rank_checkpoint_with_two(tmp_path, bytelm_data):
    # one launch checks both: torchrun's workers (--nproc's are checked on linreg) and a
    # checkpoint that one rank wrote, trained on by two to where one rank ends
    overrides = {**BYTELM_SETS, "data_dir": str(bytelm_data)}
    one = tmp_path / "one"
    one_process(BYTELM, one, 16, overrides, checkpoint_every=8, keep=5)

    resumed = tmp_path / "one-then-two"
    copy_checkpoint(one, 8, resumed)
    proc = subprocess.run(
        torchrun("--nproc-per-node", "2", "-m", "minitrain", "run", BYTELM, *sets(overrides),
                 "--steps", "16", "--out", str(resumed), "--resume", "--no-report", "--json"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["ranks"] == 2 and summary["resumed_from"] == 8
    assert_close(params_at(resumed), params_at(one))


def worker_pid(parent: int, rank: int) -> int | None:
    """The pid of the child of ``parent`` started with ``RANK=rank`` in its environment."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def test_a_killed_worker_ends_the_job_naming_its_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli("run", LINREG, "--steps", "10000000", "--log-every", "10", "--out", str(run_dir),
            "--nproc", "2", "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "metrics.jsonl").exists() or not (
            run_dir / "metrics.jsonl"
        ).read_text().count("\n") >= 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.05)
        victim = worker_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert elapsed < 30
    assert proc.returncode == 1
    # One line, the root cause: the survivor's failed all-reduce is not printed beside it.
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: worker rank 1 (pid {victim}) was killed by SIGKILL; the other workers were "
        "stopped"
    ], err
    assert "Traceback" not in err
