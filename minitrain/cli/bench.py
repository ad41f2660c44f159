"""``minitrain bench ...``: benchmarks that print ratios against a named peer."""

from __future__ import annotations

import click

from minitrain.cli import LazyGroup

# name -> "module:attribute" of a click command; loaded lazily. Each command parses its options,
# calls the measuring functions of minitrain.bench.<name> (which return dicts) and prints.
BENCHMARKS: dict[str, str] = {
    "data": "minitrain.cli.bench_data:data",
    "typecheck": "minitrain.cli.bench_typecheck:typecheck",
    "hardware": "minitrain.cli.bench_hardware:hardware",
    "optim": "minitrain.cli.bench_optim:optim",
    "step": "minitrain.cli.bench_step:step",
    "sweep": "minitrain.cli.bench_sweep:sweep",
    "distributed": "minitrain.cli.bench_distributed:distributed",
}


@click.group(cls=LazyGroup, lazy_commands=BENCHMARKS)
def bench() -> None:
    """Benchmarks: time ratios against a named peer, measured side by side in one run."""
