"""Functional dynamic loss scaling against torch.amp.GradScaler + torch.optim, step for step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import minitrain as mt
from minitrain.precision import (
    compute_context,
    dynamic_loss_scale,
    scaled_value_and_grad,
    select_tree,
)

STEPS = 14
POISONED = {4, 5, 11}  # steps whose batch overflows fp16 on purpose


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
        if step in POISONED:
            x = x * 1e5  # fp16 activations overflow: inf loss, NaN grads
        out.append((x, y))
    return out


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def loss_of(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), y)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_equals_grad_scaler_step_for_step_on_a_run_that_overflows(name):
    options = dict(init_scale=2.0**20, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    net = make_net()
    params, apply = mt.from_module(copy.deepcopy(net))
    if name == "sgd":
        torch_opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        opt = mt.optim.sgd(lr=0.05, momentum=0.9)
    else:
        torch_opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        opt = mt.optim.adam(lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **options)
    loss_scale = dynamic_loss_scale(**options)
    scale_state, opt_state = loss_scale.init(), opt.init(params)

    def loss_fn(params, x, y):
        with compute_context("fp16", "cpu"):
            return loss_of(apply(params, x), y)

    step_fn = scaled_value_and_grad(loss_fn, loss_scale)
    scales, skipped = [], []
    for x, y in batches():
        torch_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(torch_opt)
        found_inf = sum(v.item() for v in scaler._found_inf_per_device(torch_opt).values())
        scaler.update()

        value, grads, finite, scale_state = step_fn(params, scale_state, x, y)
        new_params, new_opt_state = opt.update(grads, opt_state, params)
        params = select_tree(finite, new_params, params)
        opt_state = select_tree(finite, new_opt_state, opt_state)

        assert bool(finite) == (found_inf == 0)
        assert scale_state.scale.item() == scaler.get_scale()
        assert scale_state.growth_tracker.item() == scaler._growth_tracker.item()
        assert value.item() == loss.item() or not math.isfinite(loss.item())
        for key, p in net.named_parameters():
            torch.testing.assert_close(params[key], p.detach(), rtol=1e-6, atol=1e-7)
        scales.append(scaler.get_scale())
        skipped.append(not bool(finite))
    # The run overflows naturally at first (2**20 is too high for fp16), on the poisoned
    # batches, and grows the scale again after growth_interval finite steps.
    assert skipped[:3] == [True] * 3 and all(skipped[step] for step in POISONED)
    assert sum(skipped) == 3 + len(POISONED)
    assert any(b > a for a, b in zip(scales, scales[1:], strict=False))


def test_per_member_scale_under_vmap():
    loss_scale = dynamic_loss_scale(init_scale=4.0, growth_interval=2)
    grads = {"w": torch.tensor([[1.0, 2.0], [math.inf, 1.0], [3.0, math.nan]])}
    states = mt.tree.stack([loss_scale.init()] * 3)
    out, finite, new = torch.func.vmap(loss_scale.unscale_and_check)(grads, states)
    assert finite.tolist() == [True, False, False]
    assert new.scale.tolist() == [4.0, 2.0, 2.0]
    assert out["w"][0].tolist() == [0.25, 0.5]
    for i in range(3):
        _, f_i, s_i = loss_scale.unscale_and_check({"w": grads["w"][i]}, loss_scale.init())
        assert bool(f_i) == finite[i] and s_i.scale == new.scale[i]


def test_growth_stops_where_it_would_overflow_fp32():
    loss_scale = dynamic_loss_scale(init_scale=2.0**127, growth_interval=1)
    _, finite, state = loss_scale.unscale_and_check({"w": torch.ones(1)}, loss_scale.init())
    assert bool(finite) and state.scale.item() == 2.0**127 and state.growth_tracker.item() == 0


def test_bad_hyperparameters_are_one_line_errors():
    with pytest.raises(ValueError, match="growth_factor > 1"):
        dynamic_loss_scale(growth_factor=0.5)
    with pytest.raises(ValueError, match="growth_interval"):
        dynamic_loss_scale(growth_interval=0)
