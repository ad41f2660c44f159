"""``minitrain bench sweep``: the command over :mod:`minitrain.bench.sweep` (parse, run, print)."""

from __future__ import annotations

import json

import click
import torch

from minitrain.bench.sweep import measure

__all__ = ["sweep"]


@click.command("sweep")
@click.option(
    "--members",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="K learning rates (log-spaced from 0.003 to 0.1).",
)
@click.option(
    "--steps",
    default=300,
    show_default=True,
    type=click.IntRange(min=1),
    help="Training steps per run.",
)
@click.option(
    "--rounds",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Interleaved rounds; medians are reported.",
)
@click.option(
    "--workload",
    "names",
    multiple=True,
    type=click.Choice(["linreg", "mlp"]),
    help="Measure only these (default: both).",
)
@click.option(
    "--threads",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="torch intra-op threads for both sides (0: leave torch's default).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def sweep(
    members: int, steps: int, rounds: int, names: tuple[str, ...], threads: int, as_json: bool
) -> None:
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
