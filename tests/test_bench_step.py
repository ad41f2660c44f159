"""``minitrain bench step``: the compiled steps compute what the eager step computes."""

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
