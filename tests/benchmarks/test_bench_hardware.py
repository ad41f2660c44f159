"""``python benchmarks/hardware.py``: this machine's matmul FLOP/s, copy bandwidth and ridge."""

from __future__ import annotations

import json

from benchmarks_harness import load_benchmark
from click.testing import CliRunner


def test_bench_hardware_measures_a_ridge_point():
    args = ["--n", "128", "--copy-mib", "4", "--rounds", "1", "--json"]
    result = CliRunner().invoke(load_benchmark("hardware").hardware, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    rates = record["rates"]
    assert all(rate > 0 for rate in rates.values())
    assert record["ridge_fp32"] == rates["torch fp32 matmul"] / rates["torch copy"]
    assert set(record["ratio_vs_numpy"]) == {"fp32 matmul", "copy"}
