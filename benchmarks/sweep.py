"""``python benchmarks/sweep.py``: K learning rates in one vmapped sweep against K sequential
runs.

Two small models, the regime where a vmapped sweep pays most (each run alone leaves the CPU
idle between tiny kernels): the chapter's linear regression (examples/linreg.py, D=16, B=4)
and a two-hidden-layer tanh MLP regressing a fixed random teacher (32 → 64 → 64 → 1, B=16).
Each round times, end to end on the same backend, K separate :func:`minitrain.train.fit`
calls (one per learning rate, as ``minitrain run`` would) and one
:func:`minitrain.train.sweep.fit_sweep` of the same K learning rates (building the ensemble and
its first-step check included); the two alternate in order from round to round. The final
params of each sweep member are compared with its sequential run's.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
from _pages import page
from _timing import main

import minitrain as mt
from minitrain.errors import UserError
from minitrain.train import Experiment, fit
from minitrain.train.experiment import import_script
from minitrain.train.sweep import build_ensemble, fit_sweep, member_grid
from minitrain.tree import leaves, unstack

LINREG = Path(__file__).resolve().parents[1] / "examples" / "linreg.py"

MLP_CONFIG = {"dim": 32, "hidden": 64, "batch_size": 16, "lr": 0.01, "steps": 300}


def mlp_experiment(config: dict) -> Experiment:
    """A tanh MLP (dim → hidden → hidden → 1) regressing a fixed random teacher MLP, with SGD."""
    dim, hidden = config["dim"], config["hidden"]
    sizes = [(dim, hidden), (hidden, hidden), (hidden, 1)]

    def init(generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
        return [mt.models.linear_init(a, b, generator=generator) for a, b in sizes]

    teacher = init(torch.Generator().manual_seed(1234))

    def forward(params: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        for layer in params[:-1]:
            x = torch.tanh(mt.models.linear(layer, x))
        return mt.models.linear(params[-1], x).squeeze(-1)

    def next_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(config["batch_size"], dim, generator=generator)
        return x, forward(teacher, x)

    def loss(params: list[dict[str, torch.Tensor]], batch: tuple) -> torch.Tensor:
        x, y = batch
        return mt.losses.mse(forward(params, x), y)

    return Experiment(name="mlp", init=init, loss=loss, next_batch=next_batch,
                      optimizer=mt.optim.sgd(lr=config["lr"]), steps=config["steps"])


def workloads() -> dict[str, tuple[dict[str, Any], Callable[[dict], Experiment]]]:
    """``name -> (CONFIG, experiment)`` of the benchmarked models."""
    if not LINREG.is_file():
        raise UserError(f"{LINREG} not found; run from a source checkout of minitrain")
    linreg = import_script(LINREG)
    return {"linreg": (linreg.CONFIG, linreg.experiment), "mlp": (MLP_CONFIG, mlp_experiment)}


def learning_rates(count: int, low: float = 0.003, high: float = 0.1) -> list[float]:
    """``count`` learning rates evenly spaced in log scale from ``low`` to ``high``.

    >>> learning_rates(3, 0.01, 1.0)
    [0.01, 0.1, 1.0]
    """
    if count == 1:
        return [low]
    ratio = (high / low) ** (1 / (count - 1))
    return [float(f"{low * ratio**i:.6g}") for i in range(count)]


def _sequential(config: dict[str, Any], build: Callable[[dict], Experiment], lrs: list[float],
                steps: int) -> tuple[float, list[Any]]:
    backend = mt.get_backend("cpu")
    start = time.perf_counter()
    finals = [fit(build({**config, "lr": lr, "steps": steps}), backend, progress=False).params
              for lr in lrs]
    return time.perf_counter() - start, finals


def _swept(config: dict[str, Any], build: Callable[[dict], Experiment], lrs: list[float],
           steps: int) -> tuple[float, list[Any]]:
    backend = mt.get_backend("cpu")
    start = time.perf_counter()
    members = member_grid({**config, "steps": steps}, {}, {"lr": lrs}, [0])
    result = fit_sweep(build_ensemble(build, members), backend, progress=False)
    return time.perf_counter() - start, unstack(result.params)


def _max_relative_difference(a: list[Any], b: list[Any]) -> float:
    """Largest |a - b| over all leaves of all members, relative to the leaf's largest |a|."""
    worst = 0.0
    for tree_a, tree_b in zip(a, b, strict=True):
        for leaf_a, leaf_b in zip(leaves(tree_a), leaves(tree_b), strict=True):
            scale = float(leaf_a.abs().max()) or 1.0
            worst = max(worst, float((leaf_a - leaf_b).abs().max()) / scale)
    return worst


def measure(name: str, members: int = 8, steps: int = 300, rounds: int = 3) -> dict[str, Any]:
    """Median end-to-end seconds of ``members`` sequential runs and of one sweep of them."""
    config, build = workloads()[name]
    lrs = learning_rates(members)
    sequential, swept, difference = [], [], 0.0
    for method in (_sequential, _swept):  # untimed: first calls pay one-time setup costs
        method(dict(config), build, lrs, 2)
    for round_index in range(rounds):
        order = (_sequential, _swept) if round_index % 2 == 0 else (_swept, _sequential)
        timings = {method: method(dict(config), build, lrs, steps) for method in order}
        (seq_seconds, seq_finals), (sweep_seconds, sweep_finals) = map(
            timings.get, (_sequential, _swept))
        sequential.append(seq_seconds)
        swept.append(sweep_seconds)
        difference = max(difference, _max_relative_difference(seq_finals, sweep_finals))

    seq, sweep_ = statistics.median(sequential), statistics.median(swept)
    return {
        "workload": name,
        "members": members,
        "steps": steps,
        "learning_rates": lrs,
        "sequential_seconds": seq,
        "sweep_seconds": sweep_,
        "speedup": seq / sweep_ if sweep_ > 0 else math.inf,
        "sequential_ms_per_step": seq / (members * steps) * 1e3,
        "sweep_ms_per_step": sweep_ / steps * 1e3,
        "max_relative_param_difference": difference,
        "threads": torch.get_num_threads(),
    }


@click.command("sweep")
@page("sweep", "Sweeps: one vmapped step for K members against K sequential runs")
@click.option("--members", default=8, show_default=True, type=click.IntRange(min=1),
              help="K learning rates (log-spaced from 0.003 to 0.1).")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1),
              help="Training steps per run.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Interleaved rounds; medians are reported.")
@click.option("--workload", "names", multiple=True, type=click.Choice(["linreg", "mlp"]),
              help="Measure only these (default: both).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="torch intra-op threads for both sides (0: leave torch's default).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def sweep(members: int, steps: int, rounds: int, names: tuple[str, ...], threads: int,
          as_json: bool) -> None:
    """K learning rates in one vmapped sweep vs K sequential runs (linreg and a small MLP)."""
    if threads:
        torch.set_num_threads(threads)
    results = [measure(name, members, steps, rounds) for name in names or ("linreg", "mlp")]
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    click.echo(
        f"{'workload':8s} {'K':>3s} {'steps':>6s} {'K runs (s)':>11s} {'sweep (s)':>10s} "
        f"{'speedup':>8s} {'ms/step run':>12s} {'ms/step sweep':>14s} {'max rel diff':>13s}"
    )
    for r in results:
        click.echo(
            f"{r['workload']:8s} {r['members']:3d} {r['steps']:6d} "
            f"{r['sequential_seconds']:11.3f} {r['sweep_seconds']:10.3f} {r['speedup']:7.2f}x "
            f"{r['sequential_ms_per_step']:12.3f} {r['sweep_ms_per_step']:14.3f} "
            f"{r['max_relative_param_difference']:13.2e}"
        )
    click.echo(
        f"(medians of {rounds} interleaved rounds, end to end; {results[0]['threads']} torch "
        "threads; ms/step run is per step of one run, ms/step sweep per step of all K)"
    )


if __name__ == "__main__":
    main(sweep)
