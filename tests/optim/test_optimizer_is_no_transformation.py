"""An Optimizer (whose update returns new params) passed where a GradientTransformation (whose
update returns updates) goes: it was taken, and its new params were added to the params as
updates (p -> 2p - lr g) without a word. Each place now names it in one line. Under the test
suite the type checker refuses it first, so the user's path runs in a fresh interpreter with
``MINITRAIN_TYPECHECK=0``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import minitrain as mt

PLACES = {
    "as_optimizer": "optim.as_optimizer(opt)",
    "MultiSteps": "optim.MultiSteps(opt, every_k=2)",
    "apply_if_finite": "optim.apply_if_finite(opt)",
    "masked": "optim.masked(opt, lambda name, leaf: True)",
    "multi_transform": "optim.multi_transform({'all': opt}, lambda name, leaf: 'all')",
    "chain": "optim.chain(optim.clip(1.0), opt)",
    "inject_hyperparams": "optim.as_optimizer(optim.inject_hyperparams(optim.sgd)(lr=0.1))"
                          ".init({'w': torch.ones(2)})",
}
ALIASES = ["sgd", "adam", "nadam", "muon"]


def test_an_optimizer_where_a_transformation_goes_is_a_one_line_value_error():
    code = (
        "import torch, minitrain as mt\n"
        "optim = mt.optim\n"
        f"for alias in {ALIASES!r}:\n"
        f"    for place, call in {PLACES!r}.items():\n"
        "        opt = getattr(optim, alias)()\n"
        "        try:\n"
        "            eval(call)\n"
        "        except ValueError as err:\n"
        "            assert 'is an Optimizer; pass a GradientTransformation' in str(err), err\n"
        "            assert '\\n' not in str(err)\n"
        "        else:\n"
        "            raise AssertionError(f'{place} took {alias}')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MINITRAIN_TYPECHECK": "0"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_inject_hyperparams_over_a_transformation_still_steps():
    """The regression guard: a transformation factory gives torch's SGD step."""
    injected = mt.optim.inject_hyperparams(mt.optim.scale_by_learning_rate)(learning_rate=0.1)
    opt = mt.optim.as_optimizer(injected)
    params = {"w": torch.tensor([1.0, 2.0])}
    params, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    assert params["w"].tolist() == pytest.approx([0.9, 1.9])
