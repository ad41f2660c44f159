"""``minitrain plot DIR [DIR ...]``: the loss curve of a run as a PNG, or several runs overlaid."""

from __future__ import annotations

from pathlib import Path

import click

from minitrain.cli.errors import Command, UserError
from minitrain.cli.options import PNG, emit


def _summary(records: list[dict]) -> dict:
    return {
        "records": len(records),
        "first_step": records[0]["step"],
        "last_step": records[-1]["step"],
        "last": records[-1],
    }


@click.command(cls=Command)
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=PNG, default=None,
              help="PNG file to write [default: RUN_DIR/loss.png; needed with several RUN_DIRS].")
@click.option("--key", "keys", multiple=True,
              help="Series to plot (repeatable) [default: loss and every val*/eval* key].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def plot(run_dirs: tuple[Path, ...], out: str | None, keys: tuple[str, ...],
         as_json: bool) -> None:
    """Plot the metrics.jsonl of RUN_DIRS (written by minitrain run --out RUN_DIR).

    Several RUN_DIRS overlay their curves in one PNG, labelled by directory name, e.g.
    minitrain plot runs/fp32 runs/bf16 --out compare.png. A sweep's directory gets one curve
    per member.
    """
    from minitrain import metrics

    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise UserError(f"{run_dir} is not a directory; pass the --out directory of a run")
    if len(run_dirs) > 1 and out is None:
        raise UserError(f"{len(run_dirs)} run directories make one plot; pass --out PATH.png")
    runs = [metrics.read_metrics(run_dir) for run_dir in run_dirs]
    pairs = list(zip(run_dirs, runs, strict=True))
    png = metrics.plot(list(run_dirs), out, keys=keys or None)
    if len(run_dirs) == 1:
        result = {"png": str(png), **_summary(runs[0])}
        line = (f"wrote {png} ({result['records']} records, steps {result['first_step']}.."
                f"{result['last_step']})")
    else:
        result = {"png": str(png), "runs": [{"run_dir": str(d), **_summary(r)} for d, r in pairs]}
        each = ", ".join(f"{d.name}: {len(r)} records" for d, r in pairs)
        line = f"wrote {png} ({len(run_dirs)} runs; {each})"
    emit(result, [line], as_json)
