"""``minitrain bench hardware``: the command over :mod:`minitrain.bench.hardware`."""

from __future__ import annotations

import json

import click
import torch

from minitrain.bench.hardware import measure
from minitrain.cli.errors import UserError

__all__ = ["hardware"]


@click.command()
@click.option("--device", default="cpu", help="cpu or cuda[:i].")
@click.option("--n", type=click.IntRange(min=16), default=1024, help="Matmul size n x n.")
@click.option("--copy-mib", type=click.IntRange(min=1), default=64, help="MiB copied.")
@click.option("--rounds", type=click.IntRange(min=1), default=5, help="Interleaved rounds.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def hardware(device: str, n: int, copy_mib: int, rounds: int, as_json: bool) -> None:
    """Measure matmul FLOP/s (fp32, bf16) and copy bandwidth; print the ridge point."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("no CUDA device here; run with --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"unknown device {device!r}; use cpu or cuda[:i]")
    result = measure(device, n, copy_mib, rounds)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for name, rate in result["rates"].items():
        unit = "GB/s" if "copy" in name else "GFLOP/s"
        click.echo(f"{name:<20} {rate / 1e9:10.2f} {unit}")
    click.echo(
        f"ridge point: {result['ridge_fp32']:.2f} FLOP/byte (fp32), "
        f"{result['ridge_bf16']:.2f} FLOP/byte (bf16)"
    )
    for peer in ("ratio_vs_numpy", "ratio_vs_published"):
        for name, ratio in result.get(peer, {}).items():
            label = "numpy" if peer == "ratio_vs_numpy" else result["published"]
            click.echo(f"torch / {label} {name}: {ratio:.2f}x")
