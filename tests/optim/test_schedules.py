"""Schedules against ``torch.optim.lr_scheduler``, stepped once per update over a run.

``schedule(k)`` must equal the scheduler's ``get_last_lr()`` after ``k`` steps (rtol 1e-6; torch
updates most lrs recursively, minitrain uses closed forms), and the tensor path, run under
``vmap`` over all steps (which refuses host syncs and ``if`` on tensors), must give the same
values as the Python-int path.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.optim import lr_scheduler

import minitrain as mt

S = mt.optim
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def torch_lrs(make_scheduler, steps, lr=1.0, momentum=0.9):
    """``get_last_lr()[0]`` before each of ``steps`` updates, stepping as a training loop does."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr, momentum=momentum)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(float(scheduler.get_last_lr()[0]))
        optimizer.step()
        scheduler.step()
    return lrs


def assert_matches(schedule, expected, rtol=1e-6):
    steps = len(expected)
    ours = [schedule(step) for step in range(steps)]
    for step, (a, b) in enumerate(zip(ours, expected, strict=True)):
        assert isinstance(a, float), (step, type(a))
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12 * max(1.0, abs(b))), (step, a, b)
    traced = torch.func.vmap(schedule)(torch.arange(steps))
    assert traced.dtype == torch.float64
    torch.testing.assert_close(traced, torch.tensor(ours, dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)
    single = schedule(torch.tensor(steps - 1))
    assert single.shape == () and math.isclose(float(single), ours[-1], rel_tol=1e-12,
                                               abs_tol=1e-15)


# ------------------------------------------------------------------------------------------------
# Fixed configurations, one per scheduler


CASES = {
    "StepLR": (lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
               S.step_schedule(0.5, step_size=3, gamma=0.5), 0.5),
    "MultiStepLR": (lambda o: lr_scheduler.MultiStepLR(o, milestones=[3, 7, 7, 12], gamma=0.3),
                    S.multistep_schedule(0.5, milestones=[7, 3, 7, 12], gamma=0.3), 0.5),
    "ExponentialLR": (lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9),
                      S.step_schedule(0.5, 1, gamma=0.9), 0.5),
    "CosineAnnealingLR": (lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=0.01),
                          S.cosine_annealing_schedule(0.5, T_max=7, eta_min=0.01), 0.5),
    "CosineAnnealingWarmRestarts": (
        lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=0.05),
        S.cosine_warm_restarts_schedule(0.5, T_0=3, T_mult=2, eta_min=0.05), 0.5),
    "LinearLR": (lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, end_factor=0.9,
                                                 total_iters=6),
                 S.linear_schedule(0.5, start_factor=0.1, end_factor=0.9, total_iters=6), 0.5),
    "PolynomialLR": (lambda o: lr_scheduler.PolynomialLR(o, total_iters=9, power=1.7),
                     S.polynomial_schedule(0.5, total_iters=9, power=1.7), 0.5),
    "ConstantLR": (lambda o: lr_scheduler.ConstantLR(o, factor=0.25, total_iters=4),
                   S.constant_factor_schedule(0.5, factor=0.25, total_iters=4), 0.5),
    "OneCycleLR-cos": (lambda o: lr_scheduler.OneCycleLR(o, max_lr=2.0, total_steps=40),
                       S.one_cycle_schedule(2.0, total_steps=40), 0.5),
    "OneCycleLR-linear-three-phase": (
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=2.0, total_steps=40, pct_start=0.25,
                                          anneal_strategy="linear", three_phase=True),
        S.one_cycle_schedule(2.0, total_steps=40, pct_start=0.25, anneal_strategy="linear",
                             three_phase=True), 0.5),
    "CyclicLR-triangular": (
        lambda o: lr_scheduler.CyclicLR(o, base_lr=0.1, max_lr=1.0, step_size_up=4,
                                        step_size_down=3),
        S.cyclic_schedule(0.1, 1.0, step_size_up=4, step_size_down=3), 0.5),
    "CyclicLR-triangular2": (
        lambda o: lr_scheduler.CyclicLR(o, base_lr=0.1, max_lr=1.0, step_size_up=3,
                                        mode="triangular2"),
        S.cyclic_schedule(0.1, 1.0, step_size_up=3, mode="triangular2"), 0.5),
    "CyclicLR-exp_range": (
        lambda o: lr_scheduler.CyclicLR(o, base_lr=0.1, max_lr=1.0, step_size_up=5,
                                        mode="exp_range", gamma=0.97),
        S.cyclic_schedule(0.1, 1.0, step_size_up=5, mode="exp_range", gamma=0.97), 0.5),
    "SequentialLR": (
        lambda o: lr_scheduler.SequentialLR(o, [
            lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=4),
            lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.05),
            lr_scheduler.ExponentialLR(o, gamma=0.8),
        ], milestones=[5, 15]),
        S.sequential_schedule([
            S.linear_schedule(0.5, start_factor=0.2, total_iters=4),
            S.cosine_annealing_schedule(0.5, T_max=10, eta_min=0.05),
            S.step_schedule(0.5, 1, gamma=0.8),
        ], milestones=[5, 15]), 0.5),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_equals_torch_scheduler(name):
    make_scheduler, schedule, lr = CASES[name]
    assert_matches(schedule, torch_lrs(make_scheduler, 40, lr=lr))


def test_cosine_annealing_matches_torch_past_t_max():
    """Torch's recursive form keeps going after T_max (period 2 T_max); so does the closed form."""
    expected = torch_lrs(lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=5), 60, lr=0.3)
    assert_matches(S.cosine_annealing_schedule(0.3, T_max=5), expected)


def test_the_existing_schedules_keep_their_values():
    assert [S.step_schedule(1.0, 2, 0.5)(k) for k in range(5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    cosine = S.cosine_schedule(1.0, decay_steps=10, warmup_steps=2)
    assert [round(cosine(k), 3) for k in (0, 1, 2, 6, 10, 20)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    sequential = S.sequential_schedule(
        [S.linear_warmup_schedule(1.0, 3), S.constant_schedule(0.1)], milestones=[3])
    assert [sequential(k) for k in range(5)] == [0.0, 1 / 3, 2 / 3, 0.1, 0.1]
    assert float(sequential(torch.tensor(1))) == pytest.approx(1 / 3)


def test_schedules_drive_an_optimizer_like_torch():
    """SGD with a OneCycle schedule takes torch's steps with torch's OneCycleLR."""
    schedule = S.one_cycle_schedule(0.5, total_steps=12, three_phase=True)
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    optimizer = torch.optim.SGD([param], lr=0.5, momentum=0.9)
    scheduler = lr_scheduler.OneCycleLR(optimizer, 0.5, total_steps=12, three_phase=True,
                                        cycle_momentum=False)
    opt = mt.optim.sgd(lr=schedule, momentum=0.9)
    params = {"w": param.detach().clone()}
    state = opt.init(params)
    for _ in range(12):
        param.grad = param.detach() * 0.7
        grads = {"w": params["w"] * 0.7}
        optimizer.step()
        scheduler.step()
        params, state = opt.update(grads, state, params)
        torch.testing.assert_close(params["w"], param.detach(), rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------------
# Property tests over the arguments

STEPS = 30
positive = st.floats(1e-3, 10.0)
factor = st.floats(0.05, 1.0)


@FEW
@given(lr=positive, step_size=st.integers(1, 8), gamma=factor,
       milestones=st.lists(st.integers(0, STEPS), max_size=4))
def test_step_family_matches_torch(lr, step_size, gamma, milestones):
    assert_matches(S.step_schedule(lr, step_size, gamma),
                   torch_lrs(lambda o: lr_scheduler.StepLR(o, step_size, gamma), STEPS, lr))
    assert_matches(S.multistep_schedule(lr, milestones, gamma),
                   torch_lrs(lambda o: lr_scheduler.MultiStepLR(o, milestones, gamma), STEPS, lr))
    assert_matches(S.step_schedule(lr, 1, gamma),
                   torch_lrs(lambda o: lr_scheduler.ExponentialLR(o, gamma), STEPS, lr))


@FEW
@given(lr=positive, eta_fraction=st.floats(0.0, 1.0), t_max=st.integers(1, 12),
       t_mult=st.integers(1, 3))
def test_cosine_family_matches_torch(lr, eta_fraction, t_max, t_mult):
    eta_min = lr * eta_fraction
    assert_matches(S.cosine_annealing_schedule(lr, t_max, eta_min),
                   torch_lrs(lambda o: lr_scheduler.CosineAnnealingLR(o, t_max, eta_min),
                             STEPS, lr))
    assert_matches(
        S.cosine_warm_restarts_schedule(lr, t_max, t_mult, eta_min),
        torch_lrs(lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, t_max, t_mult, eta_min),
                  STEPS * 3, lr))


@FEW
@given(lr=positive, start=st.floats(0.01, 1.0), end=st.floats(0.0, 1.0),
       total=st.integers(1, STEPS), power=st.floats(0.0, 3.0))
def test_factor_family_matches_torch(lr, start, end, total, power):
    assert_matches(S.linear_schedule(lr, start, end, total),
                   torch_lrs(lambda o: lr_scheduler.LinearLR(o, start, end, total), STEPS, lr))
    assert_matches(S.polynomial_schedule(lr, total, power),
                   torch_lrs(lambda o: lr_scheduler.PolynomialLR(o, total, power), STEPS, lr))
    assert_matches(S.constant_factor_schedule(lr, start, total),
                   torch_lrs(lambda o: lr_scheduler.ConstantLR(o, start, total), STEPS, lr))


@FEW
@given(max_lr=positive, total=st.integers(2, 60), pct=st.floats(0.0, 1.0),
       strategy=st.sampled_from(["cos", "linear"]), div=st.floats(1.0, 100.0),
       final_div=st.floats(1.0, 1e4), three_phase=st.booleans())
def test_one_cycle_matches_torch(max_lr, total, pct, strategy, div, final_div, three_phase):
    def make(o):
        return lr_scheduler.OneCycleLR(o, max_lr, total_steps=total, pct_start=pct,
                                       anneal_strategy=strategy, div_factor=div,
                                       final_div_factor=final_div, three_phase=three_phase)

    try:
        expected = torch_lrs(make, total)
    except ZeroDivisionError:  # a zero-length phase: minitrain refuses it at construction
        with pytest.raises(ValueError, match="pct_start"):
            S.one_cycle_schedule(max_lr, total, pct, strategy, div, final_div, three_phase)
        return
    assert_matches(S.one_cycle_schedule(max_lr, total, pct, strategy, div, final_div,
                                        three_phase), expected)


@FEW
@given(base=st.floats(0.0, 1.0), height=positive, up=st.integers(1, 6),
       down=st.none() | st.integers(0, 6),
       mode=st.sampled_from(["triangular", "triangular2", "exp_range"]),
       gamma=st.floats(0.8, 1.0))
def test_cyclic_matches_torch(base, height, up, down, mode, gamma):
    def make(o):
        return lr_scheduler.CyclicLR(o, base, base + height, step_size_up=up,
                                     step_size_down=down, mode=mode, gamma=gamma)

    assert_matches(S.cyclic_schedule(base, base + height, up, down, mode, gamma),
                   torch_lrs(make, STEPS))


@FEW
@given(lr=positive, first=st.integers(0, 10), gap=st.integers(0, 10), gamma=factor)
def test_sequential_matches_torch(lr, first, gap, gamma):
    milestones = [first, first + gap]

    def make(o):
        return lr_scheduler.SequentialLR(o, [
            lr_scheduler.ConstantLR(o, factor=gamma, total_iters=3),
            lr_scheduler.StepLR(o, step_size=2, gamma=gamma),
            lr_scheduler.PolynomialLR(o, total_iters=7, power=2.0),
        ], milestones)

    schedule = S.sequential_schedule([
        S.constant_factor_schedule(lr, gamma, 3),
        S.step_schedule(lr, 2, gamma),
        S.polynomial_schedule(lr, 7, 2.0),
    ], milestones)
    assert_matches(schedule, torch_lrs(make, STEPS, lr))


# ------------------------------------------------------------------------------------------------
# Tensor hyperparameters and bad input


def test_a_tensor_hyperparameter_gives_a_tensor_lr_with_its_gradient():
    lr = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    value = S.one_cycle_schedule(lr, total_steps=10)(4)
    (grad,) = torch.autograd.grad(value, lr)
    assert math.isclose(float(grad), float(value.detach()) / 0.5, rel_tol=1e-12)


@pytest.mark.parametrize(("build", "name"), [
    (lambda: S.multistep_schedule(1.0, [3, -1]), "milestones"),
    (lambda: S.step_schedule(1.0, 1, gamma=-0.5), "gamma"),
    (lambda: S.cosine_annealing_schedule(1.0, T_max=0), "T_max"),
    (lambda: S.cosine_warm_restarts_schedule(1.0, T_0=2, T_mult=0), "T_mult"),
    (lambda: S.linear_schedule(1.0, start_factor=0.0), "start_factor"),
    (lambda: S.linear_schedule(1.0, total_iters=0), "total_iters"),
    (lambda: S.constant_factor_schedule(1.0, factor=1.5), "factor"),
    (lambda: S.one_cycle_schedule(1.0, total_steps=10, anneal_strategy="exp"),
     "anneal_strategy"),
    (lambda: S.one_cycle_schedule(1.0, total_steps=10, pct_start=1.5), "pct_start"),
    (lambda: S.cyclic_schedule(0.1, 1.0, mode="sine"), "mode"),
    (lambda: S.cyclic_schedule(torch.ones(2), 1.0), "base_lr"),
    (lambda: S.sequential_schedule([S.constant_schedule(1.0)] * 2, [4, 5]), "milestones"),
    (lambda: S.sequential_schedule([S.constant_schedule(1.0)] * 3, [5, 4]), "milestones"),
    (lambda: S.one_cycle_schedule(1.0, total_steps=4)(5), "total_steps"),
    (lambda: S.step_schedule(1.0, 1, gamma=0.5)(-1), "step"),
])
def test_bad_arguments_are_one_line_errors_naming_the_argument(build, name):
    with pytest.raises(ValueError, match=name) as info:
        build()
    assert "\n" not in str(info.value)


def test_step_and_optax_style_cosine_schedules_match_torch_lr_schedulers():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    schedule = mt.optim.step_schedule(0.5, step_size=3, gamma=0.5)
    for step in range(10):
        assert math.isclose(schedule(step), optimizer.param_groups[0]["lr"])
        optimizer.step()
        step_lr.step()
    optimizer = torch.optim.SGD([param], lr=0.5)
    cosine_lr = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20, eta_min=0.05)
    schedule = mt.optim.cosine_schedule(0.5, decay_steps=20, end_value=0.05)
    for step in range(20):
        assert math.isclose(schedule(step), optimizer.param_groups[0]["lr"], rel_tol=1e-9)
        assert math.isclose(float(schedule(torch.tensor(step))), schedule(step), rel_tol=1e-6)
        optimizer.step()
        cosine_lr.step()
