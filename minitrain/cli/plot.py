"""``minitrain plot DIR``: the loss curve of a run as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import click

from minitrain.cli.errors import RunFailed, UserError
from minitrain.errors import StorageError


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="PNG file to write [default: RUN_DIR/loss.png].",
)
@click.option(
    "--key",
    "keys",
    multiple=True,
    help="Series to plot (repeatable) [default: loss and every val*/eval* key].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def plot(run_dir: Path, out: Path | None, keys: tuple[str, ...], as_json: bool) -> None:
    """Plot the metrics.jsonl of RUN_DIR (written by minitrain run --out RUN_DIR)."""
    from minitrain import metrics

    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory; pass the --out directory of a run")
    try:
        png = metrics.plot(run_dir, out, keys=keys or None)
        records = metrics.read_metrics(run_dir)
    except (metrics.MetricsError, metrics.MissingExtra) as exc:
        raise UserError(str(exc)) from None
    except StorageError as exc:  # unreadable metrics, a full disk, --out that is a directory
        raise RunFailed(str(exc)) from None
    result = {
        "png": str(png),
        "records": len(records),
        "first_step": records[0]["step"],
        "last_step": records[-1]["step"],
        "last": records[-1],
    }
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        steps = f"steps {result['first_step']}..{result['last_step']}"
        click.echo(f"wrote {png} ({len(records)} records, {steps})")
