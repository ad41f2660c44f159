"""Edges where a hyperparameter or a group is empty: SGD with a tensor momentum holding 0
(torch keeps no buffer and steps by g, whatever the dampening) on every path, and Adafactor's
transformation on a group with no leaves (what ``multi_transform`` routes nothing to)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import minitrain as mt


def sgd_against_torch(dampening, weight_decay, maximize, donate, dtype=torch.float32):
    """Max |minitrain - torch.optim.SGD| after 4 steps with ``momentum=torch.tensor(0.0)``."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(300, generator=g).to(dtype)
    grads = [torch.randn(300, generator=g).to(dtype) for _ in range(4)]
    kw = dict(lr=0.1, dampening=dampening, weight_decay=weight_decay, maximize=maximize)
    reference = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.SGD([reference], momentum=torch.tensor(0.0), **kw)
    opt = mt.optim.sgd(momentum=torch.tensor(0.0), **kw)
    params = {"w": p0.clone()}
    state = opt.init(params)
    for grad in grads:
        reference.grad = grad.clone()
        torch_opt.step()
        params, state = opt.update({"w": grad}, state, params, donate=donate)
    assert torch.equal(state.momentum_buffer["w"], torch.zeros_like(p0))  # passed on unused
    return (params["w"].float() - reference.detach().float()).abs().max().item()


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_sgd_tensor_momentum_zero_steps_by_the_grad(dampening, weight_decay, maximize, donate):
    """The streaming kernel stepped by (1 - dampening) g (0.25 off torch after 3 steps)."""
    assert sgd_against_torch(dampening, weight_decay, maximize, donate) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_sgd_tensor_momentum_zero_in_other_dtypes(dtype):
    assert sgd_against_torch(0.5, 0.1, False, False, dtype) == 0.0


def test_sgd_tensor_momentum_zero_without_the_streaming_kernels():
    """torch's fused kernel took a non-empty buffer list with momentum 0 and raised
    ``Expected momentum_buffer_list.empty()``."""
    code = (
        "import torch, minitrain as mt\n"
        "from tests.test_optim_zero_and_empty import sgd_against_torch\n"
        "for d in (0.0, 0.5):\n"
        "    for donate in (False, True):\n"
        "        assert sgd_against_torch(d, 0.1, False, donate) <= 1e-6, (d, donate)\n"
    )
    env = {**os.environ, "MINITRAIN_STREAMING": "0"}
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_scale_by_adafactor_on_a_group_with_no_leaves():
    tx = mt.optim.scale_by_adafactor()
    state = tx.init({})
    updates, state = tx.update({}, state, {})
    assert updates == {} and int(state.count) == 1


def test_multi_transform_routes_nothing_to_adafactor():
    """``init`` raised a TypeError (``ScaleByAdafactorState`` missing its buffers)."""
    tx = mt.optim.multi_transform(
        {"adam": mt.optim.scale_by_adam(), "adafactor": mt.optim.scale_by_adafactor()},
        {"w": "adam", "b": "adam"})
    params = {"w": torch.ones(4, 3), "b": torch.ones(3)}
    grads = {"w": torch.full((4, 3), 2.0), "b": torch.full((3,), -2.0)}
    updates, _ = tx.update(grads, tx.init(params), params)
    alone = mt.optim.scale_by_adam()
    expected, _ = alone.update(grads, alone.init(params), params)
    for key in params:
        assert torch.equal(updates[key], expected[key])
