"""``minitrain bench distributed``: the command over :mod:`minitrain.bench.distributed`."""

from __future__ import annotations

import json

import click

from minitrain.bench.distributed import measure
from minitrain.cli.errors import UserError
from minitrain.errors import ExperimentError
from minitrain.train.experiment import parse_overrides

__all__ = ["distributed"]


@click.command()
@click.option("--ranks", default="1,2", help="Comma-separated rank counts to time.")
@click.option("--steps", type=click.IntRange(min=3), default=20, help="Steps per run.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, help="Interleaved rounds.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a CONFIG key of examples/bytelm.py (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def distributed(ranks: str, steps: int, rounds: int, overrides: tuple[str, ...],
                as_json: bool) -> None:
    """Steps/s of examples/bytelm.py at 1 and N data-parallel ranks (same global batch)."""
    try:
        counts = tuple(sorted({int(part) for part in ranks.split(",") if part.strip()}))
        parsed = parse_overrides(list(overrides))
    except (ValueError, ExperimentError) as exc:
        raise UserError(f"--ranks expects e.g. 1,2 and --set key=value: {exc}") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--ranks expects positive rank counts such as 1,2, got {ranks!r}")
    result = measure(counts, steps, rounds, parsed)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(
        f"bytelm, {result['params']:,} params, {result['tokens_per_step']:,} tokens per global "
        f"step, median of {rounds} interleaved rounds of {steps} steps"
    )
    click.echo(f"{'configuration':<24}{'ms/step':>10}{'steps/s':>10}{'vs nproc 1':>12}"
               f"{'all-reduce ms':>15}")
    for name, seconds in result["step_seconds"].items():
        reduce = result["allreduce_seconds_per_step"].get(name)
        click.echo(
            f"{name:<24}{seconds * 1e3:>10.1f}{1 / seconds:>10.2f}"
            f"{result['speedup_vs_one_rank'][name]:>11.2f}x"
            f"{'-' if reduce is None else f'{reduce * 1e3:.2f}':>15}"
        )
