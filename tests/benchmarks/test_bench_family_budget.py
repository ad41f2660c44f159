"""``python benchmarks/optim.py --family --budget``: a member row too slow to time in full."""

from __future__ import annotations

import json

from benchmarks_harness import load_benchmark
from click.testing import CliRunner

optim = load_benchmark("optim").optim
fitted_rounds = load_benchmark("_optim_family").fitted_rounds


def test_bench_optim_family_cuts_a_row_that_would_outrun_its_budget():
    """A member whose first updates show its row would take more than --budget seconds times
    fewer updates (down to 6 rounds of 1), and the row says so."""
    args = ["--optimizer", "sgd_momentum", "--count", "1", "--size", "16", "--rounds", "8",
            "--inner", "2", "--family", "--member", "adamax"]
    cut = json.loads(CliRunner().invoke(optim, [*args, "--budget", "0", "--json"]).output)
    assert (cut["family"]["adamax"]["rounds"], cut["family"]["adamax"]["inner"]) == (6, 1)
    kept = json.loads(CliRunner().invoke(optim, [*args, "--json"]).output)
    assert (kept["family"]["adamax"]["rounds"], kept["family"]["adamax"]["inner"]) == (8, 2)
    text = CliRunner().invoke(optim, [*args, "--budget", "0"]).output
    assert "6 rounds x 1: a slow update, cut to --budget" in text, text


def test_fitted_rounds_never_goes_under_six_rounds_of_one():
    assert fitted_rounds(1e9, 2, 15, 5, 1.0) == (6, 1)
    assert fitted_rounds(1e9, 2, 3, 5, 1.0) == (3, 1)  # fewer asked: kept
    assert fitted_rounds(0.0, 2, 15, 5, 0.0) == (15, 5)
