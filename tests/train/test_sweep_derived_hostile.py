"""Scripts a researcher writes against ``minitrain sweep``: every member trains as its own
single run, or a one-line :class:`MemberMismatch` (or script error) names what the vmapped step
cannot do. Values derived from swept keys while the experiment is built are tensors of any shape,
tuples of them, deep copies and ``lr *= 2``; in-place writes, random draws and branches or counts
that differ between members are refused while the template is built; the first-step check
reaches past a long warmup at lr 0."""

from __future__ import annotations

import textwrap

import pytest
import torch

import minitrain as mt
from minitrain.errors import ScriptError
from minitrain.train.ensemble_step import batches_ignore_swept_values
from minitrain.train.sweep import fit_sweep, load_sweep
from minitrain.tree import leaves
from tests.sweep_harness import CPU, assert_members_equal_single_runs, refused, separate_runs

# A 6x3 least-squares problem; ``setup`` runs inside experiment(config) with ``lr`` and ``wd``
# taken from config, and may set ``optimizer``, ``weights`` (the loss's per-column weights),
# ``scale`` (a factor of the loss, called inside it) or ``noise`` (of the targets).
SCRIPT = '''
import copy

import torch
import minitrain as mt

CONFIG = {{"lr": 0.05, "wd": 0.1, "cw": 1.0, "steps": 4}}


def experiment(config):
    true_w = torch.linspace(-1.0, 1.0, 18).reshape(6, 3)
    lr, wd = config["lr"], config["wd"]
    weights = torch.ones(3)
    noise = 0.0
    optimizer = None

    def scale():
        return 1.0

{setup}
    def next_batch(generator):
        x = torch.randn(8, 6, generator=generator)
        return x, x @ true_w + noise * torch.randn(8, 3, generator=generator)

    def loss(params, batch):
        x, y = batch
        return scale() * (weights * (x @ params["w"] - y) ** 2).mean()

    return mt.Experiment(
        name="hostile",
        init=lambda g: {{"w": 0.1 * torch.randn(6, 3, generator=g)}},
        loss=loss,
        next_batch=next_batch,
        optimizer=mt.optim.sgd(lr=lr) if optimizer is None else optimizer,
        steps=config["steps"],
    )
'''


def write(tmp_path, setup):
    path = tmp_path / "hostile.py"
    path.write_text(SCRIPT.format(setup=textwrap.indent(textwrap.dedent(setup), "    ")))
    return str(path)


def assert_sweep_equals_single_runs(path, items):
    swept = assert_members_equal_single_runs(path, items)
    assert not torch.allclose(swept[0]["w"], swept[1]["w"], rtol=1e-3)  # the values mattered


# --------------------------------------------------------------------------- trains as single runs

DERIVED = {
    # a loss weight vector: before, only 0-d results stayed per member (member 0's for all)
    "loss-weights-vector": ('weights = torch.tensor([1.0, 2.0, 3.0]) * config["cw"]',
                            ["cw=1.0,3.0"]),
    "stacked-hyperparameters": ("""
        both = torch.stack([torch.as_tensor(lr), torch.as_tensor(wd)])
        optimizer = mt.optim.sgd(lr=both[0], weight_decay=both[1])
        """, ["lr=0.05,0.2"]),
    "unbind-tuple": ("""
        lr_t, wd_t = torch.stack([torch.as_tensor(lr), torch.as_tensor(wd)]).unbind()
        optimizer = mt.optim.sgd(lr=lr_t, weight_decay=wd_t)
        """, ["wd=0.0,0.5"]),
    # copy.deepcopy(config) copied member 0's tensor, and failed inside vmap at step 1
    "deepcopy-config": ('optimizer = mt.optim.sgd(lr=copy.deepcopy(config)["lr"])',
                        ["lr=0.05,0.2"]),
    # lr *= 2 wrote into config["lr"]'s tensor: the step kept each member's undoubled value
    "augmented-assignment": ("lr *= 2", ["lr=0.05,0.2"]),
    # c *= 2 in the loss wrote into the bound values: refused by the gradient transform
    "augmented-in-the-loss": ("""
        def scale():
            c = config["cw"]
            c *= 2
            return c
        """, ["cw=1.0,3.0"]),
    # .data is refused under vmap
    "data-attribute": ("optimizer = mt.optim.sgd(lr=torch.as_tensor(lr).data)", ["lr=0.05,0.2"]),
    # redoing the chain recursed past Python's stack while the experiment was built
    "chain-of-500-ops": ("""
        decayed = lr
        for _ in range(500):
            decayed = decayed * 1.0001
        optimizer = mt.optim.sgd(lr=decayed)
        """, ["lr=0.05,0.2"]),
    # the check unstacked an optimizer state without tensors: ValueError from unstack()
    "stateless-optimizer": ("optimizer = mt.optim.as_optimizer(mt.optim.scale(-lr))",
                            ["lr=0.05,0.2"]),
}


@pytest.mark.parametrize("setup, items", DERIVED.values(), ids=DERIVED.keys())
def test_values_derived_at_build_time_train_as_single_runs(tmp_path, setup, items):
    assert_sweep_equals_single_runs(write(tmp_path, setup), items)


ALREADY_DERIVED = {
    "times-two": ("optimizer = mt.optim.sgd(lr=lr * 2)", ["lr=0.05,0.2"]),
    "two-times": ("optimizer = mt.optim.sgd(lr=2 * lr)", ["lr=0.05,0.2"]),
    "power": ("optimizer = mt.optim.sgd(lr=lr ** 0.5 * 0.1)", ["lr=0.05,0.2"]),
    "negated-abs": ("optimizer = mt.optim.sgd(lr=abs(-lr))", ["lr=0.05,0.2"]),
    "two-swept-keys": ('optimizer = mt.optim.sgd(lr=lr / config["cw"] * 0.1)',
                       ["lr=0.05,0.2", "cw=0.5,2.0"]),
    "sqrt-clamp-cast": (
        "optimizer = mt.optim.sgd(lr=torch.sqrt(torch.as_tensor(lr)).clamp(max=0.4).float() / 4)",
        ["lr=0.05,0.2"]),
    "weight-decay-ratio": ("optimizer = mt.optim.adamw(lr=lr, weight_decay=wd / lr * 0.01)",
                           ["lr=0.05,0.2"]),
    "formatted-and-dict": ("""
        print(f"lr {lr:.3g} {config}", end="")
        optimizer = mt.optim.sgd(lr=dict(config)["lr"])
        """, ["lr=0.05,0.2"]),
    "branch-every-member-takes": ("""
        if lr > 0.01:
            optimizer = mt.optim.sgd(lr=lr, momentum=0.5)
        """, ["lr=0.05,0.2"]),
}


@pytest.mark.parametrize("setup, items", ALREADY_DERIVED.values(), ids=ALREADY_DERIVED.keys())
def test_regression_guard_scalar_arithmetic_on_swept_values(tmp_path, capsys, setup, items):
    assert_sweep_equals_single_runs(write(tmp_path, setup), items)


def test_a_derived_tensor_sweep_resumes_bit_identically(tmp_path):
    path = write(tmp_path, 'weights = torch.tensor([1.0, 2.0, 3.0]) * config["cw"]')
    items = ["cw=1.0,3.0", "lr=0.05,0.1"]
    whole = fit_sweep(load_sweep(path, items, steps=6), CPU, out_dir=tmp_path / "a",
                      progress=False)
    fit_sweep(load_sweep(path, items, steps=3), CPU, out_dir=tmp_path / "b", progress=False,
              checkpoint_every=3)
    resumed = fit_sweep(load_sweep(path, items, steps=6), CPU, out_dir=tmp_path / "b",
                        resume=True, progress=False, say=lambda _: None)
    assert resumed.summary["resumed_from"] == 3
    for a, b in zip(leaves(whole.params), leaves(resumed.params), strict=True):
        assert torch.equal(a, b)


def test_regression_guard_a_derived_value_read_by_next_batch_unshares_the_draws(tmp_path):
    path = write(tmp_path, 'noise = config["cw"] * 0.5')  # derived at build, read by next_batch
    ensemble = load_sweep(path, ["cw=0.0,1.0"], steps=4)
    assert not batches_ignore_swept_values(ensemble)
    assert_sweep_equals_single_runs(path, ["cw=0.0,1.0"])


# --------------------------------------------------------------------------- refused in one line


@pytest.mark.parametrize("setup", [
    "v = torch.zeros(2)\nv[0] = lr\noptimizer = mt.optim.sgd(lr=v[0])",
    "acc = torch.zeros((), dtype=torch.float64)\nacc.add_(lr)\noptimizer = mt.optim.sgd(lr=acc)",
    "root = torch.sqrt(torch.as_tensor(lr))\nroot.mul_(0.5)\noptimizer = mt.optim.sgd(lr=root)",
], ids=["setitem", "add_-into-a-plain-tensor", "mul_-of-a-derived-tensor"])
def test_writing_a_swept_value_in_place_at_build_is_refused(tmp_path, setup):
    message = refused(write(tmp_path, setup), ["lr=0.05,0.2"])
    assert "writes lr into a tensor in place" in message
    assert "(hostile.py line 2" in message  # the script's line (19-21)


def test_a_random_draw_from_a_swept_value_at_build_is_refused(tmp_path):
    setup = "optimizer = mt.optim.sgd(lr=torch.normal(torch.as_tensor(lr), 0.001))"
    message = refused(write(tmp_path, setup), ["lr=0.05,0.2"])
    assert "draws random numbers from lr (normal)" in message


@pytest.mark.parametrize("setup, values", [
    # member 1's decay is 20 steps long, member 0's 5: the first step agrees, the rest did not,
    # silently
    ("""
     steps_to_zero = int(lr * 100)
     optimizer = mt.optim.sgd(lr=lambda count: lr * (1 - count / steps_to_zero))
     """, "5 for member 0 (lr=0.05 seed=0), 20 for member 1 (lr=0.2 seed=0)"),
    ("""
     warmup = 3 if lr > 0.1 else 0
     optimizer = mt.optim.sgd(lr=lambda count: lr * (count >= warmup))
     """, "False for member 0 (lr=0.05 seed=0), True for member 1 (lr=0.2 seed=0)"),
], ids=["int", "if"])
def test_a_count_or_branch_that_differs_between_members_is_refused(tmp_path, setup, values):
    message = refused(write(tmp_path, setup), ["lr=0.05,0.2"])
    assert "while it is built that differs between members: " + values in message


def test_an_optimizer_init_failure_is_a_one_line_script_error(tmp_path):
    path = write(tmp_path, "optimizer = mt.optim.inject_hyperparams(mt.optim.sgd)(lr=lr)")
    with pytest.raises(ScriptError, match=r"^optimizer\.init\(params\) raised ValueError: "):
        fit_sweep(load_sweep(path, ["lr=0.05,0.2"], steps=2), CPU, progress=False)


# --------------------------------------------------------------------------- the check


def zero_then(steps_at_zero, coerce):
    lr = "float(lr)" if coerce else "lr"
    return f"""
        held = {lr}
        optimizer = mt.optim.sgd(lr=lambda count: held * (count >= {steps_at_zero}))
        """


def test_a_float_behind_an_lr_at_zero_past_the_first_checked_steps_is_caught(tmp_path):
    # six steps at lr 0 hid the frozen value from the five first-step checks
    message = refused(write(tmp_path, zero_then(6, coerce=True)), ["lr=0.05,0.2"],
                                steps=8)
    assert "member 1 (lr=0.2 seed=0) after one vmapped step differs from its own run" in message


def test_regression_guard_an_lr_at_zero_for_the_whole_sweep_trains(tmp_path):
    path = write(tmp_path, zero_then(20, coerce=False))
    ensemble = load_sweep(path, ["lr=0.05,0.2"], steps=9)  # checked at steps 1-5 and 8
    result = fit_sweep(ensemble, CPU, progress=False)
    for got, want in zip(mt.tree.unstack(result.params), separate_runs(path, ensemble, 9),
                         strict=True):
        torch.testing.assert_close(got["w"], want["w"])
