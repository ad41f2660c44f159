"""``minitrain prepare``: build the byte-level token memmaps from Python's own sources."""

from __future__ import annotations

from pathlib import Path

import click

from minitrain.cli.errors import Command
from minitrain.cli.options import Real, emit


@click.command(cls=Command)
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Directory for train.bin, val.bin and meta.json [default: the minitrain cache].")
@click.option("--source", type=click.Path(path_type=Path), default=None,
              help="Folder of .py files to read [default: this Python's standard library].")
@click.option("--val-fraction", type=Real(min=0.0, max=1.0, min_open=True, max_open=True),
              default=0.05,
              help="Share of the files held out for evaluation (chosen by a hash of each path).")
@click.option("--json", "as_json", is_flag=True, help="Print the meta record as JSON.")
def prepare(out: Path | None, source: Path | None, val_fraction: float, as_json: bool) -> None:
    """Write the bytes of every .py file under SOURCE as uint16 token memmaps (vocab 256)."""
    from minitrain import data

    meta = data.prepare(out, source, val_fraction=val_fraction)
    out_dir = out if out is not None else data.default_data_dir()
    summary = {"out": str(out_dir), **{k: v for k, v in meta.items() if k != "val_files"}}
    tokens, files = meta["tokens"], meta["files"]
    emit(summary, [f"wrote {out_dir}: train {tokens['train']:,} bytes from {files['train']:,} "
                   f"files, val {tokens['val']:,} bytes from {files['val']:,} files "
                   f"({meta['source']})"], as_json)
