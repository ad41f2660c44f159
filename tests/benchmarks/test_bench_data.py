"""``python benchmarks/data.py``: get_batch against the chapter's and nanoGPT's loaders."""

from __future__ import annotations

import json

from benchmarks_harness import load_benchmark
from click.testing import CliRunner

bench = load_benchmark("data")


def test_bench_data_runs_all_three_loaders():
    result = bench.measure(num_tokens=20_000, batch_size=4, seq_len=64, rounds=2, inner=2)
    assert set(result["seconds_per_batch"]) == {"chapter", "nanogpt", "minitrain"}
    assert all(seconds > 0 for seconds in result["seconds_per_batch"].values())
    assert result["speedup_vs_chapter"] > 0


def test_bench_data_prints_json_and_refuses_a_window_longer_than_the_tokens():
    args = ["--tokens", "5000", "--batch-size", "2", "--seq-len", "16", "--rounds", "1"]
    result = CliRunner().invoke(bench.data, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["speedup_vs_nanogpt"] > 0
    refused = CliRunner().invoke(bench.data, ["--tokens", "10", "--seq-len", "10"])
    assert refused.exit_code != 0 and "must be shorter than --tokens 10" in str(refused.exception)
