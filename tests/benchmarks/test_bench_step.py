"""``minitrain bench step``: the compiled steps compute what the eager step computes."""

import json
import os
import subprocess
import sys

import pytest

COMPILED_STEPS = """
import torch, minitrain as mt
from minitrain.bench.step import ADAMW, CompiledStepper, cruncher_loss, make_problem

params, batch = make_problem(dim=64, num_layers=3, batch=16, device="cpu")
opt = mt.optim.adamw(**ADAMW, impl="plain")
loss_and_grads = mt.value_and_grad(cruncher_loss)
expected, state = mt.tree.map(torch.clone, params), opt.init(params)
pure = CompiledStepper(params, batch, donate=False)
donated = CompiledStepper(params, batch, donate=True)
for _ in range(3):
    _, grads = loss_and_grads(expected, batch)
    expected, state = opt.update(grads, state, expected)
    inputs = (pure.params, pure.state)
    before = [t.clone() for t in mt.tree.leaves(inputs)]
    pure()
    assert all(torch.equal(a, b) for a, b in zip(before, mt.tree.leaves(inputs), strict=True))
    donated_inputs = mt.tree.leaves((donated.params, donated.state))
    donated()
    donated_outputs = mt.tree.leaves((donated.params, donated.state))
    assert all(a is b for a, b in zip(donated_inputs, donated_outputs, strict=True))
for stepper in (pure, donated):
    got = mt.tree.leaves((stepper.params, stepper.state))
    for x, y in zip(mt.tree.leaves((expected, state)), got, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
print("ok")
"""


@pytest.mark.parametrize("typecheck", ["0", "1"])
def test_compiled_steps_match_the_eager_step(typecheck):
    # A fresh interpreter: under pytest the jaxtyping import hook wraps every function in
    # checks that dynamo cannot trace. minitrain's own checks step aside while dynamo traces.
    result = subprocess.run(
        [sys.executable, "-c", COMPILED_STEPS], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MINITRAIN_TYPECHECK": typecheck},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_every_benchmark_answers_help():
    from click.testing import CliRunner

    from minitrain.cli import cli
    from minitrain.cli.bench import BENCHMARKS

    runner = CliRunner()
    listing = runner.invoke(cli, ["bench", "--help"])
    assert listing.exit_code == 0, listing.output
    for name, target in BENCHMARKS.items():
        assert target.startswith("minitrain.cli.bench_")  # library code stays free of click
        assert name in listing.output
        result = runner.invoke(cli, ["bench", name, "--help"])
        assert result.exit_code == 0 and "Usage: cli bench " + name in result.output, name


def test_bench_step_gpt_prints_the_ratios_of_its_rows():
    from click.testing import CliRunner

    from minitrain.cli.bench_step import step

    args = ["--model", "gpt", "--dim", "32", "--layers", "1", "--batch", "2", "--seq-len", "16",
            "--rounds", "1", "--inner", "1", "--no-compile"]
    result = CliRunner().invoke(step, [*args, "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert set(record["ratios"]) == {"fp32", "bf16", "fp8/fp32"}
    assert record["config"] == {"d_model": 32, "n_layers": 1, "n_heads": 4, "seq_len": 16,
                                "batch_size": 2}
    seconds = record["seconds"]
    assert record["ratios"]["fp32"] == seconds["minitrain-fp32"] / seconds["nanogpt-fp32"]
    assert record["ratios"]["fp8/fp32"] == seconds["minitrain-fp8"] / seconds["minitrain-fp32"]
    text = CliRunner().invoke(step, [*args, "--no-fp8"])
    assert text.exit_code == 0, text.output
    assert "minitrain bf16 / nanoGPT nn.Module:" in text.output and "fp8" not in text.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt", "--dim", "30"], "error: --dim 30 must be a multiple of --heads 4"),
        (["--device", "tpu"], "error: --device 'tpu' is not supported; use cpu or cuda"),
    ],
)
def test_bench_step_mistakes_are_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "minitrain", "bench", "step", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == message + "\n", proc.stderr
