"""``minitrain bench data``: the command over :mod:`minitrain.bench.data` (parse, run, print)."""

from __future__ import annotations

import json

import click

from minitrain.bench.data import measure
from minitrain.cli.errors import UserError

__all__ = ["data"]


@click.command()
@click.option("--tokens", "num_tokens", type=click.IntRange(min=2), default=100_000_000)
@click.option("--batch-size", type=click.IntRange(min=1), default=64)
@click.option("--seq-len", type=click.IntRange(min=1), default=1024)
@click.option("--rounds", type=click.IntRange(min=1), default=20, help="Interleaved rounds.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def data(num_tokens: int, batch_size: int, seq_len: int, rounds: int, as_json: bool) -> None:
    """get_batch throughput against the chapter's list comprehension (target: >= 20x)."""
    if seq_len >= num_tokens:
        raise UserError(f"--seq-len {seq_len} must be shorter than --tokens {num_tokens}")
    result = measure(num_tokens, batch_size, seq_len, rounds)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(
        f"get_batch on a {num_tokens:,}-token uint16 memmap, batch {batch_size}, "
        f"seq_len {seq_len} (median of {rounds} interleaved rounds)"
    )
    for name, seconds in result["seconds_per_batch"].items():
        rate = result["tokens_per_second"][name]
        click.echo(f"  {name:10s} {seconds * 1e3:9.3f} ms/batch  {rate / 1e6:9.1f} M tokens/s")
    click.echo(
        f"minitrain vs chapter: {result['speedup_vs_chapter']:.1f}x; "
        f"vs nanoGPT: {result['speedup_vs_nanogpt']:.1f}x"
    )
