"""Delayed fp8 scaling through the whole loop (``fit`` on cpu-fp8) against a hand-written
Transformer Engine recipe: an MLP whose forward and backward GEMMs are written out in plain torch,
with per-tensor scales ``fp8_max / max(amax history)`` kept in Python deques, and
``torch.optim.AdamW``. The same params, the same histories; resume is exact."""

from __future__ import annotations

import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minitrain as mt
from minitrain.train.setup import run_generators
from minitrain.train.step import init_carry, make_train_step

FP8 = mt.get_backend("cpu-fp8")
STEPS = 12
HISTORY = 16  # the cpu-fp8 recipe's amax history
E4M3, E5M2 = 448.0, 57344.0  # largest finite values (OCP FP8, Micikevicius et al. 2022)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def next_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # The inputs' range drifts by 2**±3 from batch to batch: a delayed scale is then stale
    # (it saturates or wastes range), so delayed and current scaling give different runs.
    spread = 2.0 ** torch.randint(-3, 4, (), generator=generator).float()
    x = torch.randn(64, 16, generator=generator) * spread
    return x, torch.randn(64, 4, generator=generator)


def experiment(steps: int = STEPS) -> mt.Experiment:
    params, apply = mt.from_module(net())
    return mt.Experiment(
        init=lambda g: params, loss=lambda p, b: F.mse_loss(apply(p, b[0]), b[1]),
        next_batch=next_batch, optimizer=mt.optim.adamw(lr=1e-2, weight_decay=0.01),
        steps=steps, name="fp8",
    )


# --------------------------------------------------------------------------- the reference


def cast(x: torch.Tensor, top: float, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """What an fp8 GEMM sees: ``x * scale`` saturated and rounded to fp8, then unscaled."""
    return (x * scale).clamp(-top, top).to(dtype).float() / scale


class Tensor8:
    """One tensor's amax history and scale, as TE's ``DelayedScaling(amax_compute_algo="max",
    margin=0)`` keeps them: the scale is ``fp8_max / max(history)``, 1 while it holds none."""

    def __init__(self, top: float, dtype: torch.dtype) -> None:
        self.top, self.dtype = top, dtype
        self.history: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        amax = max(self.history)
        scale = torch.tensor(self.top / amax if amax > 0 else 1.0)
        self.history.appendleft(float(x.abs().max()))
        return cast(x, self.top, self.dtype, scale)


def reference_run(steps: int, current: bool = False):
    """The MLP trained with fp8 GEMMs written out by hand (``current``: each tensor scaled by
    its own amax instead, TE's ``Float8CurrentScaling``)."""
    model = net()
    (w1, b1), (w2, b2) = (model[0].weight, model[0].bias), (model[2].weight, model[2].bias)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    # per matmul: input, weight (forward, e4m3), output gradient (backward, e5m2)
    tensors = [[Tensor8(E4M3, torch.float8_e4m3fn), Tensor8(E4M3, torch.float8_e4m3fn),
                Tensor8(E5M2, torch.float8_e5m2)] for _ in range(2)]
    _, data = run_generators(0)
    for _ in range(steps):
        x, y = next_batch(data)
        if current:
            for row in tensors:
                for t in row:
                    t.history = deque([0.0] * HISTORY, maxlen=HISTORY)
        with torch.no_grad():
            (qx, qw1), (a1, wq1, g1) = (tensors[0][0](x), tensors[0][1](w1)), tensors[0]
            h_pre = qx @ qw1.T + b1
            h = torch.relu(h_pre)
            qh, qw2 = tensors[1][0](h), tensors[1][1](w2)
            out = qh @ qw2.T + b2
            d_out = 2 * (out - y) / out.numel()  # d mse_loss / d out
            q2 = tensors[1][2](d_out)
            w2.grad, b2.grad = q2.T @ qh, d_out.sum(0)
            d_pre = (q2 @ qw2) * (h_pre > 0)
            q1 = g1(d_pre)
            w1.grad, b1.grad = q1.T @ qx, d_pre.sum(0)
            del a1, wq1
        opt.step()
    histories = torch.tensor([[list(t.history) for t in row] for row in tensors])
    return model, histories


# --------------------------------------------------------------------------- the tests


def tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in mt.tree.leaves(tree) if leaf is not None]


def test_fit_on_cpu_fp8_equals_a_hand_written_delayed_scaling_recipe(tmp_path):
    result = mt.fit(experiment(), FP8, progress=False, out_dir=tmp_path)
    model, histories = reference_run(STEPS)
    torch.testing.assert_close(result.state.fp8_history, histories, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(result.params[name], p.detach(), rtol=1e-5, atol=1e-6)
    assert result.summary["fp8_scaling"] == {"amax_history": HISTORY, "matmuls": 2}
    # The check can fail: current scaling trains to other params.
    current, _ = reference_run(STEPS, current=True)
    assert not torch.allclose(current[0].weight, model[0].weight, rtol=1e-4, atol=1e-5)


def test_the_first_step_scales_by_one_and_records_every_matmul():
    exp = experiment()
    step = make_train_step(exp, FP8)
    params = exp.init(torch.Generator())
    _, data = run_generators(0)
    x, y = next_batch(data)
    out = step(params, exp.optimizer.init(params), (x, y))
    history = out.carry.fp8_history
    assert history.shape == (2, 3, HISTORY) and not history[:, :, 1:].any()
    assert history[0, 0, 0] == x.abs().max() and history[0, 1, 0] == params["0.weight"].abs().max()
    assert (history[:, 2, 0] > 0).all()  # the backward pass recorded both output gradients


def test_the_pure_step_equals_the_donating_one():
    exp = experiment()
    pure, donating = make_train_step(exp, FP8), make_train_step(exp, FP8, donate=True)
    params = exp.init(torch.Generator())
    state = exp.optimizer.init(params)
    twin = (mt.tree.map(torch.clone, params), mt.tree.map(torch.clone, state))
    carry = twin_carry = init_carry(exp, FP8, torch.Generator())
    _, data = run_generators(0)
    for _ in range(5):
        batch = next_batch(data)
        a, b = pure(params, state, batch, carry), donating(*twin, batch, twin_carry)
        params, state, carry = a.params, a.opt_state, a.carry
        twin, twin_carry = (b.params, b.opt_state), b.carry
        for u, v in zip(tensors((params, state, carry)), tensors((*twin, twin_carry)),
                        strict=True):
            assert torch.equal(u, v)


def test_a_resumed_fp8_run_equals_an_uninterrupted_one(tmp_path):
    whole = mt.fit(experiment(), FP8, progress=False, out_dir=tmp_path / "whole")
    run = tmp_path / "run"
    mt.fit(experiment(5), FP8, progress=False, out_dir=run)
    resumed = mt.fit(experiment(), FP8, progress=False, out_dir=run, resume=True)
    for a, b in zip(tensors((whole.params, whole.opt_state, whole.state)),
                    tensors((resumed.params, resumed.opt_state, resumed.state)), strict=True):
        assert torch.equal(a, b)
    assert resumed.state.fp8_history[:, :, :STEPS].count_nonzero() > 0


SWEPT = """
import torch
import minitrain as mt

CONFIG = {"lr": 0.01, "steps": 8}


def experiment(config):
    def next_batch(generator):
        spread = 2.0 ** torch.randint(-3, 4, (), generator=generator).float()
        x = torch.randn(16, 8, generator=generator) * spread
        return x, x.sum(dim=1)

    return mt.Experiment(
        name="swept-fp8",
        init=lambda g: mt.models.cruncher_init(dim=8, num_layers=2, generator=g),
        loss=lambda p, b: mt.losses.mse(mt.models.cruncher(p, b[0]), b[1]),
        next_batch=next_batch, optimizer=mt.optim.adamw(lr=config["lr"]),
        steps=config["steps"], eval_every=0,
    )
"""


def test_sweep_members_carry_their_own_histories_and_equal_single_runs(tmp_path):
    from minitrain.train.experiment import load_experiment
    from minitrain.train.sweep import fit_sweep, load_sweep

    script = tmp_path / "swept.py"
    script.write_text(SWEPT)
    ensemble = load_sweep(str(script), ["lr=0.003,0.1"], steps=8)
    result = fit_sweep(ensemble, FP8, progress=False, out_dir=tmp_path / "sweep")
    assert result.summary["fp8_scaling"]["matmuls"] == 3
    histories = result.state.fp8_history
    assert histories.shape == (2, 3, 3, HISTORY)
    for k, member in enumerate(ensemble.members):
        experiment, config = load_experiment(str(script), {"lr": str(member.config["lr"])},
                                             steps=8)
        single = mt.fit(experiment, FP8, seed=member.seed, progress=False, config=config)
        torch.testing.assert_close(histories[k], single.state.fp8_history, rtol=1e-5, atol=0)
        for name, p in single.params.items():
            torch.testing.assert_close(mt.tree.unstack(result.params)[k][name], p,
                                       rtol=1e-5, atol=1e-6)
    assert not torch.equal(histories[0, :, 2], histories[1, :, 2])  # the grads differ
    run = tmp_path / "resumed"
    fit_sweep(load_sweep(str(script), ["lr=0.003,0.1"], steps=3), FP8, progress=False,
              out_dir=run)
    resumed = fit_sweep(ensemble, FP8, progress=False, out_dir=run, resume=True)
    assert torch.equal(resumed.state.fp8_history, histories)


COMPILED = """
import sys
import torch
import minitrain as mt
sys.path.insert(0, {tests!r})
from test_fp8_training import experiment, next_batch
from minitrain.train.setup import run_generators
from minitrain.train.step import make_train_step
backend = mt.get_backend({backend!r})
exp = experiment()
eager, compiled = make_train_step(exp, backend), make_train_step(exp, backend, compile=True)
params = exp.init(torch.Generator())
state = exp.optimizer.init(params)
_, data = run_generators(0)
a = b = None
for _ in range(3):
    batch = next_batch(data)
    a = eager(params, state, batch, a.carry if a else None)
    b = compiled(params, state, batch, b.carry if b else None)
    params, state = a.params, a.opt_state
    if a.carry is not None:
        torch.testing.assert_close(b.carry.fp8_history, a.carry.fp8_history)
    torch.testing.assert_close(b.loss, a.loss)
    torch.testing.assert_close(b.params, a.params)
print("ok")
"""


def test_a_compiled_block_format_step_equals_the_eager_one():
    # A fresh interpreter: under pytest the jaxtyping import hook wraps functions in checks
    # that dynamo cannot trace. The simulated matmuls run eager inside the compiled graph.
    # Delayed fp8 compiled: test_compile_on_cpu_fp8_from_the_command_line_equals_eager.
    script = COMPILED.format(tests=str(Path(__file__).parent), backend="cpu-mxfp8")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_a_checkpoint_saved_with_current_scaling_is_refused_naming_the_leaf(tmp_path,
                                                                           monkeypatch):
    import minitrain.train.single
    import minitrain.train.step
    from minitrain.checkpoint_state import CheckpointError

    with monkeypatch.context() as patch:  # a run that scaled each tensor by its own amax
        for module in (minitrain.train.single, minitrain.train.step):
            patch.setattr(module, "fp8_recipe_of", lambda backend: None)
        older = mt.fit(experiment(5), FP8, progress=False, out_dir=tmp_path)
    assert older.state is None
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="leaf"):
        mt.fit(experiment(8), FP8, progress=False, out_dir=tmp_path, resume=True)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == saved


VARYING = """
import torch
import minitrain as mt

CONFIG = {"steps": 6}


def experiment(config):
    calls = {"n": 0}

    def loss(params, batch):  # one matmul, then two from the third step on
        calls["n"] += 1
        h = batch @ params["w"]
        if calls["n"] >= 4:
            h = h @ params["v"]
        return (h ** 2).mean()

    return mt.Experiment(
        init=lambda g: {"w": torch.randn(8, 8, generator=g), "v": torch.eye(8)},
        loss=loss, next_batch=lambda g: torch.randn(4, 8, generator=g),
        optimizer=mt.optim.sgd(lr=0.01), steps=config["steps"],
    )
"""


def test_a_model_that_adds_a_matmul_mid_run_fails_in_one_line_and_keeps_its_steps(
        tmp_path, capsys):
    from test_hostile_harness import invoke  # here: COMPILED imports this module from a script

    script = tmp_path / "varying.py"
    script.write_text(VARYING)
    out = tmp_path / "run"
    code, _, err = invoke(capsys, "run", script, "--backend", "cpu-fp8", "--out", out)
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "same matmuls in every forward pass" in errors[0]
    assert "at step 3" in errors[0]
    assert "Traceback (most recent call last)" not in err.replace(
        "Traceback of your code (most recent call last)", "")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
