"""Each sweep member trained alone, for comparing a vmapped sweep with its single runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import minitrain as mt
from minitrain.precision import get_backend
from minitrain.train import fit, load_experiment
from minitrain.train.members import Ensemble, MemberMismatch
from minitrain.train.sweep import fit_sweep, load_sweep

CPU = get_backend("cpu")


def separate_runs(path: Any, ensemble: Ensemble, steps: int) -> list[Any]:
    """The final params of ``minitrain run path --set ... --seed s`` for each member."""
    runs = []
    for member in ensemble.members:
        overrides = {key: str(value) for key, value in member.config.items()}
        experiment, config = load_experiment(str(path), overrides, steps=steps)
        runs.append(fit(experiment, CPU, seed=member.seed, progress=False, config=config).params)
    return runs


def refused(path: Any, items: list[str], steps: int = 4) -> str:
    """The one-line :class:`MemberMismatch` that a sweep of ``items`` fails with."""
    with pytest.raises(MemberMismatch) as info:
        fit_sweep(load_sweep(path, items, steps=steps), CPU, progress=False)
    assert "\n" not in str(info.value)
    return str(info.value)


def assert_members_equal_single_runs(path: Any, items: list[str], steps: int = 4) -> list[Any]:
    """Sweep ``items`` (the first-step check on); each member's ``w`` equals its own run's.
    Returns the members' params."""
    ensemble = load_sweep(path, items, steps=steps)
    swept = mt.tree.unstack(fit_sweep(ensemble, CPU, progress=False).params)
    for got, want in zip(swept, separate_runs(path, ensemble, steps), strict=True):
        torch.testing.assert_close(got["w"], want["w"], rtol=1e-5, atol=1e-6)
    return swept
