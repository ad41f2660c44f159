"""benchmarks/research.py at tiny sizes: every row's two sides take the same first step (the
script checks that before timing) and every row reports a ratio."""

import json

import pytest
from benchmarks_harness import load_benchmark
from click.testing import CliRunner


def test_research_rows_run_and_agree_at_tiny_sizes():
    research = load_benchmark("research")
    result = CliRunner().invoke(research.research, ["--size", "tiny", "--rounds", "2",
                                                    "--inner", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert list(rows) == list(research.TARGETS)
    for row, entry in rows.items():
        assert entry["paired_median_ratio"] > 0 and entry["target"] == research.TARGETS[row]
        assert entry["ms"]["minitrain"] > 0 and entry["ms"]["peer"] > 0


def test_a_peer_that_computes_something_else_is_caught(monkeypatch):
    research = load_benchmark("research")
    build = research.gpt_steppers

    def lazy_peer(size):
        return {**build(size), "peer": lambda: None}  # the peer never steps

    monkeypatch.setattr(research, "gpt_steppers", lazy_peer)
    with pytest.raises(AssertionError, match="gpt: "):
        research.check_same_updates(research.SIZES["tiny"])
