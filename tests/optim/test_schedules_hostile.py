"""Hostile inputs for the lr schedules and ``reduce_on_plateau``, against torch's lr_scheduler.

Reference values come from ``torch.optim.lr_scheduler`` driven by a real ``torch.optim.SGD``:
``lrs[k]`` is ``get_last_lr()[0]`` after ``k`` calls of ``scheduler.step()``, each after an
``optimizer.step()``, up to and including the step after the last update (a training loop takes
it, so a scheduler that raises there raises in every loop of that length).

Tolerance (``RTOL``): minitrain uses torch's closed forms; torch steps most schedulers
recursively (``lr *= ratio``), which drifts by an ulp or so per step, so over the few hundred
steps here the two agree to ~1e-13 relative; 1e-9 leaves room and still catches any formula
error. ``reduce_on_plateau`` is compared exactly (the same float64 operations in the same order).

Tests marked "regression guard" pass on the code before this file's fixes and pin behaviour
that a hostile review found correct; every other test fails on that code.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.optim import lr_scheduler

import minitrain as mt

S = mt.optim
RTOL = 1e-9


def torch_lrs(make_scheduler, steps, lr=1.0):
    """``get_last_lr()[0]`` after 0, 1, ..., ``steps`` scheduler steps."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr, momentum=0.9)
    scheduler = make_scheduler(optimizer)
    lrs = [float(scheduler.get_last_lr()[0])]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        lrs.append(float(scheduler.get_last_lr()[0]))
    return lrs


def assert_matches(schedule, expected, rtol=RTOL):
    """The int path equals ``expected``; the tensor path, under vmap, equals the int path."""
    ours = [schedule(step) for step in range(len(expected))]
    for step, (a, b) in enumerate(zip(ours, expected, strict=True)):
        assert type(a) is float, (step, type(a))
        assert a == b or math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12), (step, a, b)
    traced = torch.func.vmap(schedule)(torch.arange(len(expected)))
    assert traced.dtype == torch.float64
    torch.testing.assert_close(traced, torch.tensor(ours, dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)


def assert_one_line_error(build, name):
    with pytest.raises(ValueError, match=name) as info:
        build()
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------
# OneCycleLR: torch divides by zero where a phase has no steps; minitrain refuses those


ZERO_PHASE = [  # (total_steps, pct_start, three_phase): pct * total == 1, or an empty last phase
    (10, 0.1, False), (10, 0.1, True), (1, 1.0, False), (1, 1.0, True), (7, 1.0, False),
    (9, 5 / 9, True), (3, 2 / 3, True), (40, 0.025, False),
]


@pytest.mark.parametrize(("total", "pct", "three_phase"), ZERO_PHASE)
def test_one_cycle_refuses_a_pct_start_that_leaves_a_phase_without_steps(total, pct,
                                                                         three_phase):
    def make(o):
        return lr_scheduler.OneCycleLR(o, 1.0, total_steps=total, pct_start=pct,
                                       three_phase=three_phase)

    with pytest.raises(ZeroDivisionError):
        torch_lrs(make, total)
    assert_one_line_error(
        lambda: S.one_cycle_schedule(1.0, total, pct, three_phase=three_phase), "pct_start")


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_one_cycle_equals_torch_or_is_refused_like_it_over_a_grid(strategy, three_phase):
    """Every configuration of the grid: torch raises within the run exactly where minitrain
    refuses, and otherwise the values agree up to and including step ``total_steps``."""
    for total in (1, 2, 3, 4, 7, 10, 40):
        for pct in (0.0, 0.05, 0.1, 0.25, 0.3, 0.5, 0.55, 0.99, 1.0):
            for div, final_div in ((25.0, 1e4), (1.0, 1.0), (3.0, 0.5)):
                def make(o, total=total, pct=pct, div=div, final_div=final_div):
                    return lr_scheduler.OneCycleLR(
                        o, 2.0, total_steps=total, pct_start=pct, anneal_strategy=strategy,
                        div_factor=div, final_div_factor=final_div, three_phase=three_phase,
                        cycle_momentum=False)

                def build(total=total, pct=pct, div=div, final_div=final_div):
                    return S.one_cycle_schedule(2.0, total, pct, strategy, div, final_div,
                                                three_phase)

                try:
                    expected = torch_lrs(make, total)
                except ZeroDivisionError:
                    assert_one_line_error(build, "pct_start")
                    continue
                assert_matches(build(), expected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(total=st.integers(1, 120), eighths=st.integers(0, 8), near=st.integers(-1, 1),
       three_phase=st.booleans())
def test_one_cycle_refuses_exactly_what_torch_cannot_run(total, eighths, near, three_phase):
    """Property: ``pct_start`` near the boundaries (k / total, (total + 1) / (2 total)) where
    torch's phases have no steps."""
    candidates = [eighths / 8, min(1.0, max(0.0, 1 / total + near * 1e-3)),
                  min(1.0, (total + 1) / (2 * total))]
    for pct in candidates:
        def make(o, pct=pct):
            return lr_scheduler.OneCycleLR(o, 1.0, total_steps=total, pct_start=pct,
                                           three_phase=three_phase, cycle_momentum=False)

        try:
            expected = torch_lrs(make, total)
        except ZeroDivisionError:
            assert_one_line_error(
                lambda pct=pct: S.one_cycle_schedule(1.0, total, pct, three_phase=three_phase),
                "pct_start")
            continue
        assert_matches(S.one_cycle_schedule(1.0, total, pct, three_phase=three_phase),
                       expected)


# ------------------------------------------------------------------------------------------------
# ConstantLR with factor 0, decay past the float range, triangular2 after 1025 cycles


def test_constant_factor_refuses_factor_zero_which_torch_divides_by():
    with pytest.raises(ZeroDivisionError):
        torch_lrs(lambda o: lr_scheduler.ConstantLR(o, factor=0.0, total_iters=3), 5)
    assert_one_line_error(lambda: S.constant_factor_schedule(1.0, factor=0.0), "factor")


@pytest.mark.parametrize(("make", "schedule"), [
    (lambda o: lr_scheduler.ExponentialLR(o, gamma=1.5), S.step_schedule(0.5, 1, 1.5)),
    (lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=3.0), S.step_schedule(0.5, 2, 3.0)),
], ids=["ExponentialLR", "StepLR"])
def test_growth_past_the_float_range_gives_inf_like_torch(make, schedule):
    """gamma > 1 over a long run: torch's recursive lr reaches inf; Python's ``gamma ** t``
    raised OverflowError."""
    expected = torch_lrs(make, 2000, lr=0.5)
    assert expected[-1] == math.inf
    assert_matches(schedule, expected)


def test_triangular2_runs_past_1025_cycles_where_torch_overflows():
    """torch's ``1 / 2.0 ** (cycle - 1)`` raises OverflowError from cycle 1025 (step 2048 with
    cycles of 2 steps); the amplitude is below the smallest double long before, so the lr is
    ``base_lr`` there (as on the tensor path). Up to that point the values equal torch's."""
    def make(o):
        return lr_scheduler.CyclicLR(o, 0.1, 1.0, step_size_up=1, mode="triangular2",
                                     cycle_momentum=False)

    with pytest.raises(OverflowError):
        torch_lrs(make, 2048)
    schedule = S.cyclic_schedule(0.1, 1.0, step_size_up=1, mode="triangular2")
    assert_matches(schedule, torch_lrs(make, 2047))
    assert_matches(schedule, [schedule(step) for step in range(2 * 1200)])  # int == tensor
    assert schedule(2 * 1025) == schedule(2 * 1025 + 1) == 0.1


# ------------------------------------------------------------------------------------------------
# The step a schedule is called with


TORCH_FAMILY = {
    "step": lambda: S.step_schedule(0.5, 3, 0.5),
    "multistep": lambda: S.multistep_schedule(0.5, [2, 5], 0.5),
    "exponential": lambda: S.step_schedule(0.5, 1, 0.9),
    "cosine_annealing": lambda: S.cosine_annealing_schedule(0.5, 7),
    "warm_restarts": lambda: S.cosine_warm_restarts_schedule(0.5, 3, 2),
    "linear": lambda: S.linear_schedule(0.5, 0.2, 1.0, 6),
    "polynomial": lambda: S.polynomial_schedule(0.5, 9, 2.0),
    "constant_factor": lambda: S.constant_factor_schedule(0.5, 0.5, 4),
    "one_cycle": lambda: S.one_cycle_schedule(0.5, 40, three_phase=True),
    "cyclic": lambda: S.cyclic_schedule(0.01, 0.5, 4, mode="exp_range", gamma=0.9),
    "sequential": lambda: S.sequential_schedule(
        [S.constant_schedule(0.5), S.step_schedule(0.5, 1, 0.9)], [4]),
}


@pytest.mark.parametrize("step", ["3", None, 2.5, math.nan, math.inf, True, 3.0, [3]],
                         ids=repr)
@pytest.mark.parametrize("name", sorted(TORCH_FAMILY))
def test_a_step_that_is_no_count_of_updates_is_refused(name, step):
    """Was a TypeError from a comparison (str, None, list) or a value for a step torch never
    takes (floats, NaN, inf, True). Regression guard for one_cycle at inf alone (refused
    already: past total_steps)."""
    assert_one_line_error(lambda: TORCH_FAMILY[name]()(step), "step")


@pytest.mark.parametrize("name", sorted(TORCH_FAMILY))
def test_a_negative_step_is_refused(name):
    """Regression guard, except for ``sequential`` (its first stage, a constant, answered)."""
    assert_one_line_error(lambda: TORCH_FAMILY[name]()(-1), "step")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.complex64])
@pytest.mark.parametrize("name", sorted(TORCH_FAMILY))
def test_a_tensor_step_must_hold_integers(name, dtype):
    """Was computed at a fractional step (float), as 0/1 (bool), or with a warning (complex)."""
    assert_one_line_error(lambda: TORCH_FAMILY[name]()(torch.ones((), dtype=dtype)), "step")


@pytest.mark.parametrize("name", sorted(TORCH_FAMILY))
def test_integral_steps_of_any_kind_give_the_same_float(name):
    """A numpy integer answers a Python float (was ``np.float64`` from step, exponential,
    linear, polynomial, cyclic and sequential); integer tensors of any width answer the same
    value. Regression guard for the other schedules."""
    schedule = TORCH_FAMILY[name]()
    for step in (0, 5, 13):
        value = schedule(step)
        assert type(schedule(np.int64(step))) is float and schedule(np.int64(step)) == value
        for dtype in (torch.int32, torch.int64, torch.uint8):
            traced = schedule(torch.tensor(step, dtype=dtype))
            assert traced.dtype == torch.float64
            assert math.isclose(float(traced), value, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("name", sorted(set(TORCH_FAMILY) - {"cyclic"}))
def test_grad_of_the_lr_through_a_tensor_step(name):
    """Regression guard: every schedule but cyclic is linear in its lr, so d lr / d init_value
    is lr / init_value at every step, computed under grad and vmap over the steps."""
    builders = {
        "step": lambda lr: S.step_schedule(lr, 3, 0.5),
        "multistep": lambda lr: S.multistep_schedule(lr, [2, 5], 0.5),
        "exponential": lambda lr: S.step_schedule(lr, 1, 0.9),
        "cosine_annealing": lambda lr: S.cosine_annealing_schedule(lr, 7),
        "warm_restarts": lambda lr: S.cosine_warm_restarts_schedule(lr, 3, 2),
        "linear": lambda lr: S.linear_schedule(lr, 0.2, 1.0, 6),
        "polynomial": lambda lr: S.polynomial_schedule(lr, 9, 2.0),
        "constant_factor": lambda lr: S.constant_factor_schedule(lr, 0.5, 4),
        "one_cycle": lambda lr: S.one_cycle_schedule(lr, 40, three_phase=True),
        "sequential": lambda lr: S.sequential_schedule(
            [S.linear_schedule(lr, 0.5, 1.0, 3), S.step_schedule(lr, 1, 0.9)], [4]),
    }
    lr = torch.tensor(0.5, dtype=torch.float64)
    steps = torch.arange(40)
    grads = torch.func.vmap(lambda t: torch.func.grad(lambda v: builders[name](v)(t))(lr))(steps)
    values = torch.tensor([builders[name](0.5)(int(t)) for t in steps], dtype=torch.float64)
    torch.testing.assert_close(grads, values / 0.5, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------------------
# Regression guards: configurations the brief named, equal to torch over a run


GUARDS = {
    "CyclicLR-triangular2-down-0": (
        lambda o: lr_scheduler.CyclicLR(o, 0.1, 1.0, 3, 0, "triangular2", cycle_momentum=False),
        S.cyclic_schedule(0.1, 1.0, 3, 0, "triangular2")),
    "CyclicLR-exp_range-growing": (
        lambda o: lr_scheduler.CyclicLR(o, 0.1, 1.0, 2, 5, "exp_range", 1.01,
                                        cycle_momentum=False),
        S.cyclic_schedule(0.1, 1.0, 2, 5, "exp_range", 1.01)),
    "CyclicLR-base-above-max": (
        lambda o: lr_scheduler.CyclicLR(o, 1.0, 0.1, 4, 1, cycle_momentum=False),
        S.cyclic_schedule(1.0, 0.1, 4, 1)),
    "CyclicLR-scale_fn-cycle": (
        lambda o: lr_scheduler.CyclicLR(o, 0.1, 1.0, 3, 2, scale_fn=lambda x: 0.5**x,
                                        cycle_momentum=False),
        S.cyclic_schedule(0.1, 1.0, 3, 2, scale_fn=lambda x: 0.5**x)),
    "CyclicLR-scale_fn-iterations-ignores-mode": (
        lambda o: lr_scheduler.CyclicLR(o, 0.1, 1.0, 3, 2, mode="exp_range", gamma=0.5,
                                        scale_fn=lambda x: 0.97**x, scale_mode="iterations",
                                        cycle_momentum=False),
        S.cyclic_schedule(0.1, 1.0, 3, 2, mode="exp_range", gamma=0.5,
                          scale_fn=lambda x: 0.97**x, scale_mode="iterations")),
    "CosineAnnealingWarmRestarts-T_mult-3-eta_min-above-lr": (
        lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, 2, 3, eta_min=0.9),
        S.cosine_warm_restarts_schedule(0.5, 2, 3, eta_min=0.9)),
    "CosineAnnealingWarmRestarts-T_0-1-T_mult-4": (
        lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, 1, 4, eta_min=0.01),
        S.cosine_warm_restarts_schedule(0.5, 1, 4, eta_min=0.01)),
    "CosineAnnealingLR-T_max-1-eta_min-above-lr": (
        lambda o: lr_scheduler.CosineAnnealingLR(o, 1, eta_min=0.7),
        S.cosine_annealing_schedule(0.5, 1, eta_min=0.7)),
    "PolynomialLR-power-0": (lambda o: lr_scheduler.PolynomialLR(o, 4, 0.0),
                             S.polynomial_schedule(0.5, 4, 0.0)),
    "LinearLR-to-0": (lambda o: lr_scheduler.LinearLR(o, 1.0, 0.0, 3),
                      S.linear_schedule(0.5, 1.0, 0.0, 3)),
    "ExponentialLR-gamma-0": (lambda o: lr_scheduler.ExponentialLR(o, 0.0),
                              S.step_schedule(0.5, 1, 0.0)),
    "MultiStepLR-milestone-0-repeated": (
        lambda o: lr_scheduler.MultiStepLR(o, [0, 0, 4, 4, 4], 0.5),
        S.multistep_schedule(0.5, [4, 0, 4, 0, 4], 0.5)),
    "SequentialLR-repeated-milestones": (
        lambda o: lr_scheduler.SequentialLR(o, [
            lr_scheduler.ExponentialLR(o, 0.9), lr_scheduler.StepLR(o, 2, 0.5),
            lr_scheduler.CosineAnnealingLR(o, 4, 0.1)], [5, 5]),
        S.sequential_schedule([S.step_schedule(0.5, 1, 0.9), S.step_schedule(0.5, 2, 0.5),
                               S.cosine_annealing_schedule(0.5, 4, 0.1)], [5, 5])),
    "SequentialLR-milestone-0": (
        lambda o: lr_scheduler.SequentialLR(o, [
            lr_scheduler.ExponentialLR(o, 0.9), lr_scheduler.StepLR(o, 2, 0.5)], [0]),
        S.sequential_schedule([S.step_schedule(0.5, 1, 0.9), S.step_schedule(0.5, 2, 0.5)],
                              [0])),
    "SequentialLR-warm-restarts-later": (
        lambda o: lr_scheduler.SequentialLR(o, [
            lr_scheduler.ConstantLR(o, 0.5, 10),
            lr_scheduler.CosineAnnealingWarmRestarts(o, 2, 2, 0.01)], [3]),
        S.sequential_schedule([S.constant_factor_schedule(0.5, 0.5, 10),
                               S.cosine_warm_restarts_schedule(0.5, 2, 2, 0.01)], [3])),
}


@pytest.mark.parametrize("name", sorted(GUARDS))
def test_regression_guard_equals_torch(name):
    make, schedule = GUARDS[name]
    assert_matches(schedule, torch_lrs(make, 300, lr=0.5))


def test_regression_guard_nested_sequential_equals_the_flat_torch_schedule():
    """A sequential schedule inside another restarts at its milestone like any stage: equal to
    torch's flat SequentialLR. (torch's own nested SequentialLR runs the inner one a step
    ahead, pytorch/pytorch#196243, and cannot be a later stage at all: NotImplementedError.)"""
    def make(o):
        return lr_scheduler.SequentialLR(o, [
            lr_scheduler.LinearLR(o, 0.5, 1.0, 2), lr_scheduler.ExponentialLR(o, 0.8),
            lr_scheduler.StepLR(o, 2, 0.5)], [3, 8])

    inner = S.sequential_schedule([S.linear_schedule(0.5, 0.5, 1.0, 2),
                                   S.step_schedule(0.5, 1, 0.8)], [3])
    assert_matches(S.sequential_schedule([inner, S.step_schedule(0.5, 2, 0.5)], [8]),
                   torch_lrs(make, 30, lr=0.5))


# ------------------------------------------------------------------------------------------------
# Wrong types, as a caller sees them: the test suite's jaxtyping import hook refuses these by
# their annotations before minitrain's checks run, so they run in a fresh interpreter.

WRONG_TYPES = r"""
import json, math, numpy as np, torch
from torch.optim import lr_scheduler
import minitrain as mt
S = mt.optim
cases = {
    "multistep milestones=3": lambda: S.multistep_schedule(1.0, 3),
    "multistep milestones=tensor": lambda: S.multistep_schedule(1.0, torch.tensor([2, 4])),
    "sequential schedules=callable": lambda: S.sequential_schedule(S.constant_schedule(1.0), [3]),
    "sequential milestones=3": lambda: S.sequential_schedule([S.constant_schedule(1.0)] * 2, 3),
    "cyclic scale_fn=3.0": lambda: S.cyclic_schedule(0.1, 1.0, 2, scale_fn=3.0),
    "one_cycle three_phase='no'": lambda: S.one_cycle_schedule(1.0, 10, three_phase="no"),
}
out = {}
for name, build in cases.items():
    try:
        build()
        out[name] = "accepted"
    except ValueError as err:
        out[name] = "ValueError: " + str(err)
    except Exception as err:
        out[name] = type(err).__name__ + ": " + str(err)
p = torch.nn.Parameter(torch.zeros(1))
o = torch.optim.SGD([p], lr=1.0)
s = lr_scheduler.MultiStepLR(o, np.array([2, 4]), 0.5)
expected = []
for _ in range(6):
    expected.append(s.get_last_lr()[0]); o.step(); s.step()
try:
    ours = S.multistep_schedule(1.0, np.array([2, 4]), 0.5)
    out["numpy milestones"] = [ours(k) for k in range(6)] == expected
except ValueError as err:
    out["numpy milestones"] = str(err)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def wrong_types():
    result = subprocess.run(
        [sys.executable, "-c", WRONG_TYPES], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MINITRAIN_TYPECHECK": "0"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("case", "name"), [
    ("multistep milestones=3", "milestones"),
    ("multistep milestones=tensor", "milestones"),
    ("sequential schedules=callable", "schedules"),
    ("sequential milestones=3", "milestones"),
    ("cyclic scale_fn=3.0", "scale_fn"),
    ("one_cycle three_phase='no'", "three_phase"),
])
def test_a_wrong_type_is_a_one_line_value_error(wrong_types, case, name):
    """Were TypeErrors (not iterable, not callable at the first step) or, for
    ``three_phase='no'``, a silent three-phase cycle; the tensor of milestones was refused
    already (regression guard)."""
    message = wrong_types[case]
    assert message.startswith("ValueError: ") and name in message, message
    assert "\n" not in message


def test_numpy_milestones_are_taken_like_torch(wrong_types):
    """torch's MultiStepLR takes numpy integers; they were refused."""
    assert wrong_types["numpy milestones"] is True


@pytest.mark.parametrize("schedule", [
    S.cosine_schedule(1e-3, decay_steps=37, warmup_steps=5, init_value=1e-5, end_value=1e-6),
    S.cosine_schedule(0.3, decay_steps=11),
    S.linear_warmup_schedule(0.7, warmup_steps=9, init_value=0.1),
], ids=["cosine-warmup", "cosine", "linear-warmup"])
def test_optax_style_schedules_take_tensor_steps_in_float64_and_check_int_steps(schedule):
    """A tensor step was computed in float32 (values off the int path by float32 rounding)
    and a negative or fractional int step was extrapolated."""
    steps = torch.arange(60)
    traced = torch.stack([schedule(step) for step in steps])
    assert traced.dtype == torch.float64
    assert traced.tolist() == [schedule(int(step)) for step in steps]
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="invalid step"):
            schedule(bad)
