"""benchmarks/research.py at tiny sizes: every row's two sides take the same first step (the
script checks that before timing) and every row reports a ratio."""

import json

import click
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


def test_processes_give_each_row_its_median_and_forward_every_other_option(monkeypatch):
    research = load_benchmark("research")
    seen = []

    def fake_children(script, options, processes, progress=None):
        seen.append(options)
        rows = {"maml": {"paired_median_ratio": 1.04, "target": 1.05},
                "maml run": {"paired_median_ratio": 1.02, "target": None}}
        return [{"rounds": 3, "inner": 2, "threads": 2,
                 "rows": {row: {**entry, "paired_median_ratio": entry["paired_median_ratio"]
                                + 0.01 * i} for row, entry in rows.items()}}
                for i in range(processes)]

    monkeypatch.setattr(load_benchmark("_timing"), "run_children", fake_children)
    args = ["--size", "tiny", "--rows", "maml", "--rows", "maml run", "--rounds", "3",
            "--inner", "2", "--threads", "2"]
    out = CliRunner().invoke(research.research, [*args, "--processes", "3"])
    assert out.exit_code == 0, out.output
    asked = research.research.make_context("research", list(args)).params
    assert research.research.make_context("research", list(seen[0])).params == asked
    names = {p.name for p in research.research.params if isinstance(p, click.Option)}
    assert research.NOT_FORWARDED < names
    assert "minitrain / plain torch.func, 3 rounds x 2 steps, 2 threads; 3 processes" in out.output
    assert "  maml      1.05x  target <= 1.05x: 1 of 3 over  (1.040 1.050 1.060)" in out.output
    assert "  maml run  1.03x  (1.020 1.030 1.040)" in out.output


def test_real_children_measure_each_row_and_are_summarized(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error")  # the children's warnings are errors too
    research = load_benchmark("research")
    out = CliRunner().invoke(research.research, [
        "--size", "tiny", "--rows", "maml", "--rounds", "2", "--inner", "1", "--processes", "2",
        "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)  # the progress lines go to stderr
    assert [list(r["rows"]) for r in result["processes"]] == [["maml"]] * 2
    (maml,) = result["summary"]
    assert maml["figure"] == "maml" and maml["target"] == research.TARGETS["maml"]
    assert len(maml["ratios"]) == 2 and all(r > 0 for r in maml["ratios"])
