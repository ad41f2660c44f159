"""A value derived from a swept key while the experiment is built (``config["muon_lr"] /
config["lr"]``) is each member's own in the vmapped step; the first-step check looks at the
first step that moves the params (a warmup from lr 0 hid a frozen value) and measures each
member against the size of its update (a small lr hid one too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import minitrain as mt
from minitrain.train.members import MemberMismatch
from minitrain.train.sweep import fit_sweep, load_sweep
from tests.sweep_harness import CPU, separate_runs

# Muon for the matrix and Adam for the bias, one warmup from lr 0, and Muon's lr as a ratio to
# the shared one (as examples/bytelm_muon.py does).
MUON_AND_ADAM = """
import torch
import minitrain as mt

CONFIG = {"lr": 0.05, "muon_lr": 0.02, "coerce": False, "steps": 4}


def experiment(config):
    true_w = torch.linspace(-1.0, 1.0, 18).reshape(6, 3)
    ratio = config["muon_lr"] / config["lr"]
    if config["coerce"]:
        ratio = float(ratio)
    hidden = mt.optim.chain(mt.optim.scale_by_muon(), mt.optim.scale(ratio))
    routed = mt.optim.multi_transform({"muon": hidden, "adam": mt.optim.scale_by_adam()},
                                      lambda name, p: "muon" if p.ndim == 2 else "adam")
    warmup = mt.optim.cosine_schedule(config["lr"], decay_steps=config["steps"], warmup_steps=2)

    def next_batch(generator):
        x = torch.randn(8, 6, generator=generator)
        return x, x @ true_w

    def loss(params, batch):
        x, y = batch
        return ((x @ params["w"] + params["b"] - y) ** 2).mean()

    return mt.Experiment(
        name="routed",
        init=lambda g: {"w": 0.1 * torch.randn(6, 3, generator=g), "b": torch.zeros(3)},
        loss=loss,
        next_batch=next_batch,
        optimizer=mt.optim.as_optimizer(mt.optim.chain(
            routed, mt.optim.scale_by_learning_rate(warmup))),
        steps=config["steps"],
    )
"""

# SGD whose lr the script turns into a Python float
COERCED_SGD = """
import torch
import minitrain as mt

CONFIG = {"lr": 1e-5, "steps": 2}


def experiment(config):
    def next_batch(generator):
        return torch.randn(8, 4, generator=generator)

    return mt.Experiment(
        name="coerced",
        init=lambda g: {"w": torch.randn(4, generator=g)},
        loss=lambda params, x: ((x @ params["w"] - 1.0) ** 2).mean(),
        next_batch=next_batch,
        optimizer=mt.optim.sgd(lr=float(config["lr"])),
        steps=config["steps"],
    )
"""


def test_a_value_derived_at_build_time_is_each_members_own(tmp_path):
    path = tmp_path / "routed.py"
    path.write_text(MUON_AND_ADAM)
    ensemble = load_sweep(str(path), ["muon_lr=0.01,0.05"], steps=4)
    result = fit_sweep(ensemble, CPU, progress=False)  # the check is on
    swept = mt.tree.unstack(result.params)
    runs = separate_runs(path, ensemble, steps=4)
    for got, want in zip(swept, runs, strict=True):
        for name in ("w", "b"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(swept[0]["w"], swept[1]["w"], rtol=1e-3)


@pytest.mark.parametrize("script, swept", [
    (MUON_AND_ADAM.replace('"coerce": False', '"coerce": True'), "muon_lr=0.01,0.05"),
    (COERCED_SGD, "lr=1e-5,3e-5"),  # updates 1e-5 of params of size 1
], ids=["after-a-warmup-from-zero", "small-lr"])
def test_a_swept_value_turned_into_a_float_is_caught(tmp_path, script, swept):
    path = tmp_path / "coerced.py"
    path.write_text(script)
    ensemble = load_sweep(str(path), [swept], steps=4)
    with pytest.raises(MemberMismatch, match=r"member 1 \(.* seed=0\) after one vmapped step "
                                             r"differs from its own run") as info:
        fit_sweep(ensemble, CPU, progress=False)
    assert "\n" not in str(info.value)
    assert "in norm, its update by" in str(info.value)


def test_bytelm_muon_sweeps_muon_lr_past_the_check():
    # muon_lr reaches Muon's updates as muon_lr / lr, derived at build time: every member
    # trained with member 0's before, and the check, at a warmup's lr 0, could not tell
    path = str(Path(__file__).resolve().parents[2] / "examples" / "bytelm_muon.py")
    ensemble = load_sweep(path, ["muon_lr=0.01,0.05"], steps=3)
    result = fit_sweep(ensemble, CPU, progress=False)  # checks step 1, the first that moves
    swept = mt.tree.unstack(result.params)
    name = "blocks.0.attn.qkv.weight"
    leaves = [dict(mt.tree.named_leaves(p))[name] for p in swept]
    assert not torch.allclose(leaves[0], leaves[1], rtol=1e-3)


WEIGHT_DECAY = """
import torch
import minitrain as mt

CONFIG = {"weight_decay": 0.0, "steps": 2}


def experiment(config):
    return mt.Experiment(
        name="decayed",
        init=lambda g: {"w": torch.randn(4, 3, generator=g)},
        loss=lambda p, x: ((x @ p["w"]) ** 2).mean(),
        next_batch=lambda g: torch.randn(8, 4, generator=g),
        optimizer=mt.optim.NAME(weight_decay=config["weight_decay"]),
        steps=config["steps"],
    )
"""


@pytest.mark.parametrize("name", ["adadelta", "adamax", "lion", "nadam", "radam"])
def test_a_weight_decay_of_zero_beside_others_names_the_members_and_a_way_out(tmp_path, name):
    # these leave the decay step out at 0, as torch.optim does; the states cannot stack
    path = tmp_path / "decayed.py"
    path.write_text(WEIGHT_DECAY.replace("NAME", name))
    ensemble = load_sweep(str(path), ["weight_decay=0.0,0.1"], steps=2)
    with pytest.raises(MemberMismatch) as info:
        fit_sweep(ensemble, CPU, progress=False)
    message = str(info.value)
    assert "\n" not in message and "optimizer states cannot be stacked" in message
    assert "trees[0] and trees[1] differ" in message and "sweep 1e-8 for none" in message
    ensemble = load_sweep(str(path), ["weight_decay=1e-8,0.1"], steps=2)  # the way out trains
    assert fit_sweep(ensemble, CPU, progress=False).params["w"].shape == (2, 4, 3)
