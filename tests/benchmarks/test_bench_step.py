"""``python benchmarks/step.py``: the compiled steps compute what the eager step computes; the
GPT rows compare the same model."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from benchmarks_harness import BENCHMARKS, load_benchmark
from click.testing import CliRunner

COMPILED_STEPS = """
import sys
sys.path.insert(0, sys.argv[1])  # benchmarks/, as `python benchmarks/step.py` has it
import torch, minitrain as mt
from step import ADAMW, CompiledStepper, cruncher_loss, make_problem

params, batch = make_problem(dim=64, num_layers=3, batch=16, device="cpu")
opt = mt.optim.adamw(**ADAMW)
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


def test_compiled_steps_match_the_eager_step():
    # A fresh interpreter: under pytest the jaxtyping import hook wraps every function in
    # checks that dynamo cannot trace. minitrain's own checks (on, as by default) step aside
    # while dynamo traces.
    result = subprocess.run(
        [sys.executable, "-c", COMPILED_STEPS, str(BENCHMARKS)], capture_output=True, text=True,
        timeout=300,
        env={**os.environ, "MINITRAIN_TYPECHECK": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_bench_step_gpt_prints_the_ratios_of_its_rows():
    step = load_benchmark("step").step
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
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "step.py"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == message + "\n", proc.stderr


def test_gpt_benchmark_compares_the_same_model():
    gpt_step = load_benchmark("_gpt_step")
    bytelm = gpt_step.load_bytelm()
    config = {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32, "batch_size": 2}
    params = bytelm.init_params(config, torch.Generator().manual_seed(0))
    module = gpt_step.NanoGPT(config)
    gpt_step._copy_bytelm_params(module, params)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(module(x), bytelm.forward(params, x, 4))
    small = {"d_model": 32, "n_layers": 1, "seq_len": 32, "batch_size": 2}
    result = gpt_step.gpt_step_ratios(small, rounds=1, inner=1)
    assert set(result["ratios"]) == {"fp32", "bf16", "fp8/fp32"}
    # timing stays out of pass/fail: one round on a busy machine can put a ratio anywhere
    assert all(r > 0 and math.isfinite(r) for r in result["ratios"].values())
    assert set(result["paired_median_ratios"]) == set(result["ratios"])
    assert all(r > 0 and math.isfinite(r) for r in result["paired_median_ratios"].values())
