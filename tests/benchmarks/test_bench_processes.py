"""``python benchmarks/optim.py --processes N``: the measurement repeated in fresh processes
(children that run ``python benchmarks/optim.py ... --json``), each figure summarized by its median
across them."""

from __future__ import annotations

import json
import subprocess

import click
import pytest
from benchmarks_harness import BENCHMARKS, load_benchmark
from click.testing import CliRunner

from minitrain.cli.errors import EXIT_FAILED, EXIT_USAGE, run_cli

bench_optim = load_benchmark("optim")
timing = load_benchmark("_timing")
optim = bench_optim.optim
ALIAS_TARGETS = bench_optim.ALIAS_TARGETS
NOT_FORWARDED = bench_optim.NOT_FORWARDED
FAMILY_TARGET = load_benchmark("_optim_family").FAMILY_TARGET
ChildFailed = timing.ChildFailed
child_command = timing.child_command
run_children = timing.run_children
median_interval = timing.median_interval
summarize = timing.summarize
SCRIPT = BENCHMARKS / "optim.py"


def _result(pure: float, donate: float, chain: float, lion: float) -> dict:
    return {
        "params": "8 x 1024x1024 fp32", "device": "cpu",
        "results": {"adam": {"peer": "torch_fused", "targets": dict(ALIAS_TARGETS),
                             "paired_median_ratios": {"pure": pure, "donate": donate}}},
        "chains": {"chain": {"peer": "adamw torch_fused", "target": 1.5,
                             "paired_median_ratio": chain, "paired_median_donate_ratio": 1.2}},
        "family": {"lion": {"reference": "lion_pytorch:Lion", "target": FAMILY_TARGET,
                            "paired_median_ratio": lion},
                   "schedule_free_adamw": {"skipped": "schedulefree is not installed"}},
    }


def test_each_figure_is_summarized_by_its_median_interval_and_count_over_target():
    pures = [1.1, 1.4, 1.2, 1.3, 1.36, 1.0, 1.25]
    donates = [1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06]
    chains = [1.4, 1.45, 1.5, 1.55, 1.6, 1.65, 1.7]
    results = [_result(*figures, 0.8) for figures in zip(pures, donates, chains, strict=True)]
    rows = {row["figure"]: row for row in summarize(results)}
    assert list(rows) == ["adam pure / torch_fused", "adam donate / torch_fused",
                          "chain pure / adamw torch_fused", "chain donate / adamw torch_fused",
                          "lion pure / lion_pytorch:Lion"]  # the skipped member has none
    pure = rows["adam pure / torch_fused"]
    assert pure["ratios"] == pures and pure["median"] == 1.25
    assert pure["interval"] == median_interval(pures) == (1.0, 1.4)
    assert pure["over_target"] == 2 and pure["target"] == 1.35  # 1.4 and 1.36
    assert rows["adam donate / torch_fused"]["over_target"] == 1  # 1.06 only
    chain = rows["chain pure / adamw torch_fused"]
    assert chain["over_target"] == 4 and chain["target"] == 1.5  # equal to it is within it
    assert rows["chain donate / adamw torch_fused"]["over_target"] is None
    assert rows["lion pure / lion_pytorch:Lion"]["over_target"] == 0
    assert summarize(results[:5])[0]["interval"] is None  # under six processes


def test_processes_that_measured_other_figures_are_not_pooled():
    other = _result(1.1, 1.0, 1.3, 0.9)
    del other["family"]["lion"]
    with pytest.raises(ValueError, match=r"process 2 .*lion pure / lion_pytorch:Lion"):
        summarize([_result(1.1, 1.0, 1.3, 0.9), other])


def _completed(returncode: int, stdout: str = "", stderr: str = ""):
    return lambda command, **kwargs: subprocess.CompletedProcess(command, returncode, stdout,
                                                                 stderr)


def test_children_run_one_after_another_and_each_failure_is_named():
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, json.dumps({"n": len(calls)}), "")

    assert run_children(SCRIPT, ["--count", "1"], 2, run) == [{"n": 1}, {"n": 2}]
    assert calls == [child_command(SCRIPT, ["--count", "1"])] * 2
    assert calls[0][1:] == [str(SCRIPT), "--count", "1", "--json"]  # the script, not the CLI
    failures = {
        "exited with status 2: bad": _completed(2, stderr="Traceback\nerror: bad\n"),
        "was killed by SIGKILL: no output on stderr": _completed(-9),
        "printed no JSON result; its output began: a warning": _completed(0, "a warning\n{}"),
        "printed no JSON result; its output began: nothing": _completed(0, ""),
    }
    for message, run in failures.items():
        with pytest.raises(ChildFailed, match=f"^benchmark process 1 of 1 {message}$"):
            run_children(SCRIPT, [], 1, run)


def test_a_failed_child_is_one_line_and_exit_code_1(monkeypatch, capsys):
    monkeypatch.setattr(timing, "run_children",
                        lambda script, options, processes, progress=None: run_children(
                            script, options, processes,
                            _completed(1, stderr="error: out of memory")))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(optim, ["--processes", "2"])
    assert exit_info.value.code == EXIT_FAILED
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "error: benchmark process 1 of 2 exited with status 1: out of memory"], err


def test_a_child_gets_every_option_of_the_command_but_processes_and_json(monkeypatch):
    seen = []

    def fake_children(script, options, processes, progress=None):
        assert script == SCRIPT.resolve()  # the children run this very script
        seen.append(options)
        return [_result(1.1, 1.0, 1.3, 0.9)] * processes

    monkeypatch.setattr(timing, "run_children", fake_children)
    args = ["--optimizer", "adam", "--optimizer", "sgd_momentum", "--count", "3", "--size", "5",
            "--rounds", "7", "--inner", "2", "--chain", "chain_clip_adam_decay_schedule",
            "--family", "--member", "lion", "--cold", "--budget", "9.5"]
    out = CliRunner().invoke(optim, [*args, "--processes", "6", "--json"])
    assert out.exit_code == 0, out.output
    asked = optim.make_context("optim", list(args)).params
    assert optim.make_context("optim", list(seen[0])).params == asked
    assert len(json.loads(out.output)["processes"]) == 6
    # Every option of the command reaches a child unless it is listed as not forwarded: an
    # option added later cannot be dropped silently.
    names = {param.name for param in optim.params if isinstance(param, click.Option)}
    assert NOT_FORWARDED < names
    for param in optim.params:
        if param.name not in NOT_FORWARDED and not param.is_flag:
            assert param.opts[0] in seen[0], param.opts[0]
    text = CliRunner().invoke(optim, ["--processes", "6", "--cold"]).output
    assert "the cache flushed before every update" in text, text
    assert "1.10x [1.10, 1.10]  target <= 1.35x: 0 of 6 over  (1.100 " in text, text


def test_a_figure_not_summarized_with_processes_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(optim, ["--breakdown", "--processes", "2"])
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "error: --breakdown is not summarized across processes; drop --breakdown or "
        "--processes"], err


def test_real_children_measure_and_are_summarized(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error")  # the children's warnings are errors too
    args = ["--optimizer", "sgd_momentum", "--count", "1", "--size", "8", "--rounds", "2",
            "--inner", "1", "--processes", "2", "--json"]
    out = CliRunner().invoke(optim, args)
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)  # the progress lines go to stderr
    assert [r["params"] for r in result["processes"]] == ["1 x 8x8 fp32"] * 2
    pure = result["summary"][0]
    assert pure["figure"] == "sgd_momentum pure / torch_fused"
    assert len(pure["ratios"]) == 2 and all(r > 0 for r in pure["ratios"])
