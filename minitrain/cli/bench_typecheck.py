"""``minitrain bench typecheck``: the command over :mod:`minitrain.bench.typecheck`."""

from __future__ import annotations

import json

import click

from minitrain.bench.typecheck import overhead

__all__ = ["typecheck"]


@click.command("typecheck")
@click.option("--steps", default=2000, show_default=True, help="Linreg steps per child run.")
@click.option("--json", "as_json", is_flag=True)
def typecheck(steps: int, as_json: bool) -> None:
    """Shape-check overhead: per cruncher call and per linreg train step."""
    result = overhead(steps)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(
        f"per call (cruncher, B=4, D=16): checked {result['call_checked_us']:.1f} us, "
        f"unchecked {result['call_unchecked_us']:.1f} us, "
        f"overhead {result['call_overhead_us']:.1f} us"
    )
    click.echo(
        f"per linreg step: checked {result['step_checked_us']:.1f} us, "
        f"unchecked {result['step_unchecked_us']:.1f} us, "
        f"overhead {result['step_overhead_us']:.1f} us ({result['step_ratio']:.2f}x)"
    )
