"""fp16 training with dynamic loss scaling through the whole loop (``fit`` on cpu-fp16) against a
hand-written torch loop with ``torch.amp.GradScaler``: the same scale trajectory, the same
skipped steps, the same params; skipped steps are logged, not failures; resume is exact."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minitrain as mt
from minitrain.errors import ExperimentError, NonFiniteLoss
from minitrain.precision import dynamic_loss_scale
from minitrain.train.ensemble_step import make_member_step
from minitrain.train.setup import run_generators
from minitrain.train.step import init_carry, make_train_step

FP16 = mt.get_backend("cpu-fp16")
STEPS = 16
SCALE = {"init_scale": 2.0**16, "growth_interval": 3}  # grows within the run


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def next_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(32, 16, generator=generator), torch.randn(32, 1, generator=generator)
    if torch.rand((), generator=generator) < 0.25:  # about one batch in four overflows fp16
        x = x * 1e5
    return x, y


def fp16_experiment(steps: int = STEPS, optimizer: str = "sgd", clip: float | None = None,
                    **scale) -> mt.Experiment:
    params, apply = mt.from_module(net())
    opt = mt.optim.sgd(lr=0.05, momentum=0.9) if optimizer == "sgd" else mt.optim.adam(lr=1e-2)
    return mt.Experiment(
        init=lambda g: params, loss=lambda p, b: F.mse_loss(apply(p, b[0]), b[1]),
        next_batch=next_batch, optimizer=opt, steps=steps, max_grad_norm=clip,
        loss_scale=dynamic_loss_scale(**(scale or SCALE)), name="fp16",
    )


def torch_gradscaler_run(steps: int, optimizer: str, clip: float | None):
    """The classic loop: fp16 autocast, GradScaler, unscale_ before clipping."""
    model = net()
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu", **SCALE)
    _, data = run_generators(0)
    scales, skipped = [], 0
    skipped_per_step = []
    for _ in range(steps):
        x, y = next_batch(data)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        skipped += int(sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped_per_step.append(skipped)
    return model, scales, skipped_per_step


def tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in mt.tree.leaves(tree) if leaf is not None]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("optimizer,clip", [("sgd", None), ("adam", 1.0)])
def test_fit_on_cpu_fp16_equals_torch_gradscaler(tmp_path, optimizer, clip):
    result = mt.fit(fp16_experiment(optimizer=optimizer, clip=clip), FP16, progress=False,
                    out_dir=tmp_path)
    model, scales, skipped = torch_gradscaler_run(STEPS, optimizer, clip)
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert [r["loss_scale"] for r in logged] == scales
    assert [r["skipped"] for r in logged] == skipped
    grew = any(b > a for a, b in zip(scales, scales[1:], strict=False))
    assert 0 < skipped[-1] < STEPS and grew, (scales, skipped)  # both paths taken
    assert result.summary["skipped_steps"] == skipped[-1]
    assert result.summary["loss_scale"] == scales[-1]
    for name, p in model.named_parameters():
        torch.testing.assert_close(result.params[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_the_pure_step_equals_the_donating_one():
    experiment = fp16_experiment()
    pure = make_train_step(experiment, FP16)
    donating = make_train_step(experiment, FP16, donate=True)
    params = experiment.init(torch.Generator())
    state = experiment.optimizer.init(params)
    carry = init_carry(experiment, FP16, torch.Generator())
    twin = (mt.tree.map(torch.clone, params), mt.tree.map(torch.clone, state), carry)
    _, data = run_generators(0)
    applied = []
    for _ in range(8):
        batch = next_batch(data)
        a = pure(params, state, batch, carry)
        b = donating(*twin[:2], batch, twin[2])
        params, state, carry = a.params, a.opt_state, a.carry
        twin = (b.params, b.opt_state, b.carry)
        applied.append(bool(a.applied))
        assert bool(a.applied) == bool(b.applied)
        for x, y in zip(tensors((params, state, carry)), tensors(twin), strict=True):
            assert torch.equal(x, y)
    assert False in applied and True in applied


def test_a_resumed_fp16_run_equals_an_uninterrupted_one(tmp_path):
    whole = mt.fit(fp16_experiment(12), FP16, progress=False, out_dir=tmp_path / "whole")
    run = tmp_path / "run"
    mt.fit(fp16_experiment(5), FP16, progress=False, out_dir=run)
    resumed = mt.fit(fp16_experiment(12), FP16, progress=False, out_dir=run, resume=True)
    for a, b in zip(tensors((whole.params, whole.opt_state, whole.state)),
                    tensors((resumed.params, resumed.opt_state, resumed.state)), strict=True):
        assert torch.equal(a, b)
    assert records(tmp_path / "whole")[5:] == [
        {**r, "step_time": w["step_time"], "examples_per_s": w["examples_per_s"],
         "rss_bytes": w["rss_bytes"]}
        for r, w in zip(records(run)[5:], records(tmp_path / "whole")[5:], strict=True)
    ]


def test_a_loss_that_never_turns_finite_still_fails(tmp_path):
    params, apply = mt.from_module(net())
    experiment = mt.Experiment(
        init=lambda g: params, loss=lambda p, b: apply(p, b).sum() * float("inf"),
        next_batch=lambda g: torch.randn(4, 16, generator=g), optimizer=mt.optim.sgd(lr=0.1),
        steps=10, loss_scale=dynamic_loss_scale(init_scale=2.0**-148),  # 0 after two backoffs
    )
    with pytest.raises(NonFiniteLoss, match="at step 2"):
        mt.fit(experiment, FP16, progress=False)


def test_sweeps_refuse_loss_scaling_in_one_line():
    with pytest.raises(ExperimentError, match="does not carry a loss scale"):
        make_member_step(fp16_experiment(), FP16)
