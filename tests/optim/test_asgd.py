"""ASGD against torch.optim.ASGD's single-tensor path: its step sizes held in float32 tensors
(so float64 params match to rounding), and a schedule followed one update late, as torch's
ASGD follows an ``LRScheduler`` (it sets the next ``eta`` from the group lr of the update
just made)."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt


def run_both(dtype, steps=25, size=100, schedule=None, torch_scheduler=None, fast=True, **kw):
    """(minitrain's params, ax), (torch's params, ax) after ``steps`` updates on one leaf."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(size, dtype=dtype, generator=g)
    grads = [torch.randn(size, dtype=dtype, generator=g) for _ in range(steps)]
    reference = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.ASGD([reference], foreach=False, **kw)
    scheduler = torch_scheduler(torch_opt) if torch_scheduler else None
    opt = mt.optim.asgd(**{**kw, **({"lr": schedule} if schedule else {})})
    params = [p0.clone().requires_grad_(not fast)]
    state = opt.init(params)
    for grad in grads:
        reference.grad = grad.clone()
        torch_opt.step()
        if scheduler:
            scheduler.step()
        params, state = opt.update([grad], state, params)
    ours = (params[0].detach(), mt.optim.asgd_average(state)[0].detach())
    return ours, (reference.detach(), torch_opt.state[reference]["ax"])


CONFIGS = [
    dict(lr=0.05, lambd=1e-2),
    dict(lr=0.05, lambd=1e-2, t0=3),
    dict(lr=0.1, lambd=0.5, alpha=1.0, t0=0, weight_decay=0.1),
    dict(lr=0.02, lambd=1e-3, t0=5, maximize=True),
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("kw", CONFIGS)
def test_float64_matches_torch_to_rounding(kw, fast):
    """torch rounds eta and mu to float32 (``torch.as_tensor`` of a Python float); taking them
    in float64 left float64 params ~1e-8 off torch."""
    ours, theirs = run_both(torch.float64, fast=fast, **kw)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


# Each minitrain schedule beside the LRScheduler that torch users run for it.
SCHEDULES = {
    "lambda": (lambda k: 0.05 * (0.5**k + 0.1),
               lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.5**k + 0.1)),
    "step": (mt.optim.step_schedule(0.05, step_size=3, gamma=0.5),
             lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
    "cosine": (mt.optim.cosine_annealing_schedule(0.05, T_max=10, eta_min=0.001),
               lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.001)),
}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_schedule_follows_torch_lr_scheduler(name, dtype, fast):
    schedule, make_scheduler = SCHEDULES[name]
    ours, theirs = run_both(dtype, schedule=schedule, torch_scheduler=make_scheduler,
                            fast=fast, lr=0.05, lambd=0.1, t0=3)
    tolerance = dict(rtol=1e-13, atol=1e-14) if dtype is torch.float64 else \
        dict(rtol=1e-5, atol=1e-6)  # float32: one op order apart per step (p(1-l.eta) - eta.g)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **tolerance)


def test_a_constant_schedule_equals_the_number():
    params = {"w": torch.linspace(-1, 1, 80)}
    grads = {"w": torch.linspace(1, -1, 80)}
    results = []
    for lr in (0.05, mt.optim.constant_schedule(0.05)):
        opt = mt.optim.asgd(lr=lr, lambd=0.1, t0=1)
        p, state = params, opt.init(params)
        for _ in range(6):
            p, state = opt.update(grads, state, p)
        results.append((p["w"], mt.optim.asgd_average(state)["w"]))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_negative_scheduled_lr_is_named():
    opt = mt.optim.asgd(lr=lambda k: 0.1 - 0.1 * k, lambd=0.1)  # lr(2) < 0
    params = [torch.ones(4)]
    state = opt.init(params)
    for _ in range(3):  # eta from lr(0), lr(0), lr(1) = 0
        params, state = opt.update([torch.ones(4)], state, params)
    with pytest.raises(ValueError, match=r"lr \(from the schedule\)"):
        opt.update([torch.ones(4)], state, params)  # eta_4 from lr(2)


def test_scale_by_asgd_takes_a_schedule_in_a_chain():
    tx = mt.optim.chain(mt.optim.scale_by_asgd(lr=mt.optim.step_schedule(0.5, 1, 0.5),
                                               lambd=0.0))
    params = [torch.zeros(2)]
    state = tx.init(params)
    steps = []
    for _ in range(3):
        updates, state = tx.update([torch.ones(2)], state, params)
        steps.append(float(updates[0][0]))
    assert steps == [-0.5, -0.5, -0.25]  # eta_1 = lr(0), eta_2 = lr(0), eta_3 = lr(1)


def test_a_scheduled_asgd_under_vmap_over_states_equals_the_loop():
    """A traced count (vmap over states at different steps) calls the schedule with an integer
    tensor, as an int count does."""
    opt = mt.optim.asgd(lr=mt.optim.step_schedule(0.05, step_size=2, gamma=0.5), lambd=0.1,
                        t0=2)
    params = [torch.ones(5, dtype=torch.float64)]
    state = opt.init(params)
    seen = []
    for _ in range(4):
        seen.append((params, state))
        params, state = opt.update([params[0] * 0.3 + 1.0], state, params)
    state_type = type(state[0])

    def step(count, lr, ax, p):
        return opt.update([p * 0.3 + 1.0], (state_type(count, lr, [ax]),), [p])[0][0]

    columns = [torch.stack(c) for c in zip(*[(s[0].count, s[0].lr, s[0].ax[0], p[0])
                                             for p, s in seen], strict=True)]
    batched = torch.func.vmap(step)(*columns)
    loop = torch.stack([opt.update([p[0] * 0.3 + 1.0], s, p)[0][0] for p, s in seen])
    assert torch.equal(batched, loop)
