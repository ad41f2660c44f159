"""examples/ensemble.py and examples/dp_sgd.py: each against a hand-written reference (one
``torch.optim.Adam`` per member; per-example gradients by a loop, clipped by hand), and each run
as a user runs it. examples/maml_sine.py is tested in tests/train/test_maml.py."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minitrain as mt
from minitrain.train import load_experiment

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


pytestmark = pytest.mark.usefixtures("one_thread")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ensemble_step_is_one_torch_adam_per_member_at_its_own_lr():
    ensemble = load_example("ensemble")
    members, lrs = 4, torch.tensor([1e-3, 1e-2, 3e-2, 1e-1])
    params = mt.tree.stack([ensemble.init(k) for k in mt.random.split(mt.random.key(3), members)])
    adam = ensemble.adam_per_member(lrs)
    state, step = adam.init(params), ensemble.make_ensemble_step(adam)
    x, y = ensemble.data(32, seed=0)
    references = []
    for k, member in enumerate(mt.tree.unstack(params)):
        leaves = [t.clone().requires_grad_() for layer in member for t in (layer["weight"],
                                                                           layer["bias"])]
        references.append((leaves, torch.optim.Adam(leaves, lr=float(lrs[k]))))
    for _ in range(3):
        params, state, losses = step(params, state, x, y)
        for k, (leaves, opt) in enumerate(references):
            h = x
            for i in range(0, len(leaves) - 2, 2):
                h = torch.tanh(h @ leaves[i].T + leaves[i + 1])
            loss = ((h @ leaves[-2].T + leaves[-1]).squeeze(-1) - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            torch.testing.assert_close(losses[k], loss.detach())
    for k, (leaves, _) in enumerate(references):
        got = [t for layer in mt.tree.unstack(params)[k] for t in (layer["weight"],
                                                                   layer["bias"])]
        for a, b in zip(got, leaves, strict=True):
            torch.testing.assert_close(a, b.detach())


def test_ensemble_example_learns_the_task():
    result = load_example("ensemble").main(steps=150)
    _, y_test = load_example("ensemble").data(1024, seed=1)
    assert len(result["member_mse"]) == 8
    assert result["ensemble_mse"] < 0.3 * float(y_test.var()), result


def _dp_experiment(**overrides):
    return load_experiment(EXAMPLES / "dp_sgd.py", {k: str(v) for k, v in overrides.items()})


def _hand_clipped_mean(params, x, y, clip):
    """Abadi et al.'s clipped mean: each example's grads by autograd, scaled to norm <= clip."""
    total = [torch.zeros_like(t) for t in mt.tree.leaves(params)]
    for i in range(len(x)):
        leaves = [t.detach().requires_grad_() for t in mt.tree.leaves(params)]
        w1, b1, w2, b2 = leaves
        logits = torch.relu(x[i:i + 1] @ w1.T + b1) @ w2.T + b2
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y[i:i + 1]), leaves)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        for t, g in zip(total, grads, strict=True):
            t += g / max(1.0, float(norm) / clip)
    return [t / len(x) for t in total]


def test_dp_sgd_gradient_is_the_clipped_mean_plus_gaussian_noise():
    clip = 0.05  # small enough that most examples are clipped
    quiet, config = _dp_experiment(clip=clip, noise_multiplier=0.0, batch_size=16)
    noisy, _ = _dp_experiment(clip=clip, noise_multiplier=2.0, batch_size=16)
    g = torch.Generator().manual_seed(0)
    params, batch = quiet.init(g), quiet.next_batch(g)
    key = mt.random.key(5)
    grad = mt.value_and_grad(quiet.loss, has_aux=True)
    (loss, aux), clean = grad(params, batch, key=key)
    expected = _hand_clipped_mean(params, *batch, clip)
    for got, want in zip(mt.tree.leaves(clean), expected, strict=True):
        torch.testing.assert_close(got, want)
    logits = torch.stack([torch.relu(x @ params[0]["weight"].T + params[0]["bias"])
                          @ params[1]["weight"].T + params[1]["bias"] for x in batch[0]])
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, batch[1]))
    assert 0.5 < float(aux["clipped"]) <= 1.0
    grad = mt.value_and_grad(noisy.loss, has_aux=True)
    _, private = grad(params, batch, key=key)
    _, again = grad(params, batch, key=key)
    _, other = grad(params, batch, key=mt.random.key(6))
    noise = torch.cat([(a - b).flatten() for a, b in zip(mt.tree.leaves(private),
                                                         mt.tree.leaves(clean), strict=True)])
    noise = noise / (2.0 * clip / 16)  # the noise std sigma * C, over the batch size
    assert abs(float(noise.mean())) < 0.1 and 0.9 < float(noise.std()) < 1.1
    assert all(torch.equal(a, b) for a, b in zip(mt.tree.leaves(private),
                                                 mt.tree.leaves(again), strict=True))
    assert not torch.equal(mt.tree.leaves(private)[0], mt.tree.leaves(other)[0])


def test_dp_sgd_runs_under_minitrain_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "minitrain", "run", str(EXAMPLES / "dp_sgd.py"), "--steps", "3",
         "--out", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(0.0 <= row["clipped"] <= 1.0 and row["loss"] > 0 for row in rows)
