"""``minitrain bench ...``: benchmarks that print ratios against a named peer."""

from __future__ import annotations

import click

from minitrain.cli import LazyGroup

# name -> "module:attribute" of a click command; loaded lazily.
BENCHMARKS: dict[str, str] = {
    "data": "minitrain.bench.data:data",
    "typecheck": "minitrain.bench.typecheck:typecheck",
    "hardware": "minitrain.bench.hardware:hardware",
    "optim": "minitrain.bench.optim:optim",
    "step": "minitrain.bench.step:step",
    "sweep": "minitrain.bench.sweep:sweep",
    "distributed": "minitrain.bench.distributed:distributed",
}


@click.group(cls=LazyGroup, lazy_commands=BENCHMARKS)
def bench() -> None:
    """Benchmarks: time ratios against a named peer, measured side by side in one run."""
