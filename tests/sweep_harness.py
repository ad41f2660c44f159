"""Each sweep member trained alone, for comparing a vmapped sweep with its single runs."""

from __future__ import annotations

from typing import Any

from minitrain.precision import get_backend
from minitrain.train import fit, load_experiment
from minitrain.train.members import Ensemble

CPU = get_backend("cpu")


def separate_runs(path: Any, ensemble: Ensemble, steps: int) -> list[Any]:
    """The final params of ``minitrain run path --set ... --seed s`` for each member."""
    runs = []
    for member in ensemble.members:
        overrides = {key: str(value) for key, value in member.config.items()}
        experiment, config = load_experiment(str(path), overrides, steps=steps)
        runs.append(fit(experiment, CPU, seed=member.seed, progress=False, config=config).params)
    return runs
