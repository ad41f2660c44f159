"""Roofline math against the chapter's figures and the published H100 spec."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain.accounting import roofline as R
from minitrain.cli.roofline import roofline as roofline_command
from tests.references import require

positive = st.floats(1e-3, 1e18, allow_nan=False, allow_infinity=False)
non_negative = st.floats(0, 1e18, allow_nan=False, allow_infinity=False)


def test_h100_accelerator_intensity_is_the_chapters_295():
    # 989.4 TFLOP/s dense bf16 over 3.35 TB/s (NVIDIA H100 SXM datasheet; chapter 3.6.3).
    h100 = R.roof("h100", "bf16")
    assert h100.ridge == pytest.approx(295, abs=1)
    assert R.accelerator_intensity(989.5e12, 3.35e12) == pytest.approx(295.4, abs=0.1)


@pytest.mark.parametrize("n", [1024, 4096])
def test_chapter_table(n):
    # Chapter 3.6.4: ReLU 0.25, GeLU 5, dot 0.5, mat-vec 1, matmul n/3 (bf16 operands).
    ops = {op.name: op for op in R.chapter_ops(n)}
    assert ops["relu"].intensity == 0.25
    assert ops["gelu"].intensity == 5.0
    assert ops["dot"].intensity == pytest.approx(0.5, rel=1e-3)
    assert ops["matvec"].intensity == pytest.approx(1.0, rel=3e-3)
    assert ops["matmul"].intensity == pytest.approx(n / 3, rel=1e-3)
    # The exact formulas of the table.
    assert (ops["dot"].flops, ops["dot"].bytes) == (2 * n - 1, 4 * n + 2)
    assert (ops["matvec"].flops, ops["matvec"].bytes) == (n * (2 * n - 1), 2 * n * n + 4 * n)
    assert (ops["matmul"].flops, ops["matmul"].bytes) == (n * n * (2 * n - 1), 6 * n * n)


def test_chapter_bounds_on_h100():
    bounds = {p.name: p.bound for p in (R.place(op, R.roof("h100")) for op in R.chapter_ops())}
    assert bounds == {
        "relu": "memory",
        "gelu": "memory",
        "dot": "memory",
        "matvec": "memory",
        "matmul": "compute",
    }


def test_chapter_relu_times():
    # Chapter 3.6.2: 4n / 3.35e12 ~ 1.2e-6 s of transfers against n / 989.5e12 ~ 1e-9 s.
    n = 1024 * 1024
    assert 4 * n / 3.35e12 == pytest.approx(1.25e-6, rel=0.01)
    seconds = R.predicted_seconds(n, 4 * n, 989.5e12, 3.35e12)
    assert seconds == 4 * n / 3.35e12


@settings(deadline=None, max_examples=200)
@given(flops=positive, moved=positive, peak=positive, bandwidth=positive)
def test_roofline_identities(flops, moved, peak, bandwidth):
    intensity = R.arithmetic_intensity(flops, moved)
    attainable = R.attainable_flops(intensity, peak, bandwidth)
    seconds = R.predicted_seconds(flops, moved, peak, bandwidth)
    ridge = R.accelerator_intensity(peak, bandwidth)
    assert attainable <= peak * (1 + 1e-12)
    # Doing the op at the attainable rate takes exactly the predicted time.
    assert flops / seconds == pytest.approx(attainable, rel=1e-9)
    # MFU bound is attainable over peak; the bound flips at the ridge.
    assert R.mfu_bound(intensity, ridge) == pytest.approx(attainable / peak, rel=1e-9)
    assert (R.bound(intensity, ridge) == "compute") == (intensity >= ridge)


@settings(deadline=None, max_examples=100)
@given(a=non_negative, b=non_negative, moved=positive)
def test_more_flops_per_byte_never_attains_less(a, b, moved):
    lo, hi = sorted((a, b))
    h100 = R.roof("h100")
    slow = R.attainable_flops(R.arithmetic_intensity(lo, moved), h100.peak_flops, h100.bandwidth)
    fast = R.attainable_flops(R.arithmetic_intensity(hi, moved), h100.peak_flops, h100.bandwidth)
    assert slow <= fast


def test_ops_that_move_nothing():
    assert R.arithmetic_intensity(5, 0) == math.inf
    assert math.isnan(R.arithmetic_intensity(0, 0))
    view = R.place(R.Op("view", 0, 0), R.roof("h100"))
    assert (view.bound, view.seconds) == ("none", 0.0)


def test_bad_numbers_are_value_errors():
    with pytest.raises(ValueError, match="flops must be a non-negative"):
        R.arithmetic_intensity(-1, 4)
    with pytest.raises(ValueError, match="bandwidth must be a positive"):
        R.accelerator_intensity(1e12, 0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        R.chapter_ops(0)


def test_phases_split_forward_backward_update():
    assert R.phases([False, False, True, False, True, False]) == [
        "forward",
        "forward",
        "backward",
        "backward",
        "backward",
        "update",
    ]
    assert R.phases([False, False]) == ["forward", "forward"]


def test_plot_writes_a_png(tmp_path):
    require("matplotlib")
    h100 = R.roof("h100")
    placements = [R.place(op, h100) for op in R.chapter_ops()]
    path = R.plot(h100, placements, str(tmp_path / "roof.png"))
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# The command


def test_roofline_command_json():
    result = CliRunner().invoke(roofline_command, ["--hardware", "h100", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["accelerator_intensity"] == pytest.approx(295, abs=1)
    assert {op["name"]: op["bound"] for op in record["ops"]} == {
        "relu": "memory",
        "gelu": "memory",
        "dot": "memory",
        "matvec": "memory",
        "matmul": "compute",
    }
    assert [round(op["intensity"], 2) for op in record["ops"]] == [0.25, 5.0, 0.5, 1.0, 341.17]


def test_roofline_command_table_and_plot(tmp_path):
    require("matplotlib")
    png = tmp_path / "h100.png"
    result = CliRunner().invoke(roofline_command, ["--hardware", "h100", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "accelerator intensity 295.3 FLOP/byte" in result.stdout
    assert "matmul" in result.stdout and png.read_bytes()[:4] == b"\x89PNG"


def test_roofline_command_unknown_hardware_is_a_one_line_error():
    result = CliRunner().invoke(roofline_command, ["--hardware", "tpu"])
    assert result.exit_code == 2
    assert result.output.startswith("error: unknown hardware 'tpu'")
    assert result.output.count("\n") == 1
