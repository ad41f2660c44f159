"""``minitrain profile``: every op of a real step on the roofline, checked against torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import minitrain as mt
from minitrain.cli.roofline import profile
from minitrain.train import load_experiment, make_train_step
from minitrain.train.setup import run_generators, to_backend
from tests.references import require

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LINREG = EXAMPLES / "linreg.py"
BYTELM = EXAMPLES / "bytelm.py"
# The ops FlopCounterMode has a formula for, as the profile names them ("aten.mm (forward)").
# CPU attention is not among them: FlopCounterMode gives it 0, the Counter its FLOPs.
MATMULS = tuple(f"{op} (" for op in map(str, flop_registry))


def run_profile(*args: str) -> dict:
    result = CliRunner().invoke(profile, [*args, "--json", "--repeats", "2", "--warmup", "1"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def matmul_flops_by_torch(script: Path, overrides: dict[str, str]) -> int:
    """FLOPs of one step of ``script`` as torch's own FlopCounterMode counts them."""
    experiment, _ = load_experiment(script, overrides)
    backend = mt.get_backend("cpu")
    init_generator, data_generator = run_generators(0)
    params = to_backend(experiment.init(init_generator), backend)
    batch = experiment.next_batch(data_generator)
    step = make_train_step(experiment, backend)
    with FlopCounterMode(display=False) as counter:
        step(params, experiment.optimizer.init(params), batch)
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "overrides", [{}, {"dim": "32", "num_layers": "2", "batch_size": "8"}], ids=["chapter", "deep"]
)
def test_linreg_profile_places_every_op(tmp_path, overrides):
    require("matplotlib")
    png = tmp_path / "linreg.png"
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    record = run_profile(str(LINREG), *sets, "--plot", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    calls = record["calls"]
    roof = record["roof"]
    assert roof["name"] == "cpu fp32" and roof["accelerator_intensity"] > 0
    # Matmul FLOPs of the real step equal torch's FlopCounterMode on the same step.
    matmul = sum(c["flops"] for c in calls if c["name"].startswith(MATMULS))
    assert matmul == matmul_flops_by_torch(LINREG, overrides) > 0
    # Forward, backward and the optimizer update are all there.
    phases = {c["name"].rsplit("(", 1)[1].rstrip(")") for c in calls}
    assert phases == {"forward", "backward", "update"}
    # Each call's time is max(FLOPs / peak, bytes / bandwidth); the step's is their sum.
    for c in calls:
        expected = max(c["flops"] / roof["peak_flops"], c["bytes"] / roof["bandwidth"])
        assert c["seconds"] == pytest.approx(expected)
    assert record["predicted_seconds"] == pytest.approx(sum(c["seconds"] for c in calls))
    assert record["flops"] == sum(c["flops"] for c in calls)
    assert record["measured_seconds"] > 0
    # Grouped rows add up to the calls.
    assert sum(g["count"] for g in record["ops"]) == len(calls)


def test_chapter_linreg_step_flops():
    # D=16, B=4, one D x 1 weight: forward x @ w and backward x^T @ g, 2*B*D each.
    assert matmul_flops_by_torch(LINREG, {}) == 2 * (2 * 4 * 16)


def test_bytelm_profile(tmp_path):
    require("matplotlib")
    png = tmp_path / "bytelm.png"
    small = {"d_model": "32", "n_layers": "1", "seq_len": "32", "batch_size": "4"}
    sets = [arg for key, value in small.items() for arg in ("--set", f"{key}={value}")]
    record = run_profile(str(BYTELM), *sets, "--plot", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    calls = record["calls"]
    assert {c["name"].rsplit("(", 1)[1] for c in calls} == {"forward)", "backward)", "update)"}
    matmul = sum(c["flops"] for c in calls if c["name"].startswith(MATMULS))
    assert matmul == matmul_flops_by_torch(BYTELM, small) > 0


def test_profile_table_output():
    result = CliRunner().invoke(profile, [str(LINREG), "--repeats", "1", "--warmup", "0"])
    assert result.exit_code == 0, result.output
    assert "mm (forward)" in result.stdout and "mm (backward)" in result.stdout
    assert "predicted" in result.stdout and "measured" in result.stdout


def test_profile_on_a_gpu_roof():
    record = run_profile(str(LINREG), "--hardware", "h100", "--dtype", "fp32")
    assert record["roof"]["name"] == "h100 fp32"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_script.py"], "error: "),
        ([str(LINREG), "--hardware", "tpu"], "error: unknown hardware 'tpu'"),
        ([str(LINREG), "--set", "nokey=1"], "error: "),
    ],
)
def test_profile_mistakes_are_one_line_errors(args, message):
    result = CliRunner().invoke(profile, args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(message) and result.output.count("\n") == 1


def test_counter_records_drive_the_profile():
    # The same records placed directly: the library function the command prints.
    from minitrain.accounting.counter import Counter

    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with Counter(track_memory=False) as counter:
        (a @ b).relu()
    result = mt.accounting.roofline.profile_records(
        counter.records, mt.accounting.roofline.roof("h100", "fp32")
    )
    names = [c.name for c in result.calls]
    assert names == ["aten.mm (forward)", "aten.relu (forward)"]
    assert result.calls[0].flops == 2 * 64 * 32 * 16
    assert result.calls[0].bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
