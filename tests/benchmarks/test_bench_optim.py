"""``python benchmarks/optim.py``: the rows, the chain's torch side, ``--family`` and ``--cold``."""

from __future__ import annotations

import json

import torch
from benchmarks_harness import load_benchmark
from click.testing import CliRunner

bench = load_benchmark("optim")
timing = load_benchmark("_timing")
optim = bench.optim


def test_bench_optim_family_flag_adds_the_family_rows():
    tiny = ["--optimizer", "adamw", "--count", "1", "--size", "16", "--rounds", "1",
            "--inner", "1", "--json"]
    result = CliRunner().invoke(optim, [*tiny, "--family", "--member", "lion",
                                        "--member", "adamax"])
    assert result.exit_code == 0, result.output
    family = json.loads(result.output)["family"]
    assert sorted(family) == ["adamax", "lion"]
    assert family["adamax"]["reference"] == "torch.optim:Adamax"
    assert family["lion"]["pure_over_reference"] > 0
    assert family["lion"]["paired_median_ratio"] > 0
    plain = json.loads(CliRunner().invoke(optim, tiny).output)
    assert "family" not in plain
    assert set(plain["results"]["adamw"]["paired_median_ratios"]) == {"pure", "donate"}
    # one round: too few for a 95% interval of the median
    assert plain["results"]["adamw"]["paired_intervals"] == {"pure": None, "donate": None}
    assert family["lion"]["paired_interval"] is None
    assert all(entry["paired_median_ratio"] > 0 and entry["donate_over_peer"] > 0
               and entry["pure_over_torch_chain"] > 0 for entry in plain["chains"].values())
    text = CliRunner().invoke(optim, [*tiny[:-1], "--family", "--member", "lion"]).output
    ratio_lines = [line for line in text.splitlines() if "x" in line and "/" in line]
    assert len(ratio_lines) == 3 and all("paired" in line for line in ratio_lines), text
    assert plain["cold"] is False


def test_the_chain_rows_torch_stepper_runs_the_same_chain():
    """The chain row's torch side (clip_grad_norm_, the fused step, an LRScheduler) makes the
    update the hand-built chain makes, over two steps (its grads clipped in place the first
    time, so the second clip leaves them within 1e-6 of the first's)."""
    params = bench.make_params(3, (8, 8), "cpu")
    grads = bench.make_params(3, (8, 8), "cpu", seed=1)
    _, cls, kwargs, flag = bench.OPTIMIZERS["adamw"]
    ours = bench.MinitrainStepper(bench.hand_built_adamw, {}, params, grads, donate=False)
    theirs = bench.TorchClipStepper(cls, kwargs, flag, params, grads, 1.0,
                                    bench.hand_built_schedule(kwargs["lr"]))
    for _ in range(2):
        ours()
        theirs()
    assert not torch.equal(ours.params[0], params[0])
    for a, b in zip(ours.params, theirs.params, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7)


def test_bench_optim_cold_flushes_the_cache_before_every_timed_update(monkeypatch):
    flushes = []
    monkeypatch.setattr(timing, "last_level_cache_bytes", lambda: 2**20)  # a small flush
    real = timing.cache_flusher

    def counted():
        flush = real()
        return lambda: flushes.append(1) or flush()

    monkeypatch.setattr(bench, "cache_flusher", counted)
    args = ["--optimizer", "sgd_momentum", "--count", "1", "--size", "16", "--rounds", "2",
            "--inner", "1", "--cold", "--json"]
    result = CliRunner().invoke(optim, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["cold"] is True
    # 2 rounds x 1 call: sgd's 4 steppers, then the chain's 4 (torch, pure, donated, torch's
    # clip + step)
    assert len(flushes) == 2 * 4 + 2 * 4
    refused = CliRunner().invoke(optim, [*args[:-1], "--device", "cuda"])
    assert refused.exit_code != 0


def test_bench_optim_breakdown_times_the_kernel_call_beside_the_whole_update():
    args = ["--optimizer", "sgd_momentum", "--count", "2", "--size", "16", "--rounds", "1",
            "--inner", "1", "--breakdown", "--json"]
    result = CliRunner().invoke(optim, args)
    assert result.exit_code == 0, result.output
    parts = json.loads(result.output)["breakdown"]
    expected = {"fused_kernel_in_place", "copies_of_params_and_state",
                "aten_out_of_place_fused", "python_overhead_8_scalars", "minitrain_pure_update"}
    if bench.streaming.available():
        expected |= {"kernel_call_alone", "one_pass_plain_stores",
                     "one_pass_streaming_stores"}
    assert set(parts["seconds"]) == expected
    assert set(parts["minor_page_faults_per_call"]) == expected
    assert all(seconds > 0 for seconds in parts["seconds"].values())
