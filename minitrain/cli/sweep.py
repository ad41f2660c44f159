"""``minitrain sweep SCRIPT --set lr=0.01,0.1 --seeds 0,1``: a grid trained by one vmapped step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from minitrain.cli.errors import Command, training_errors
from minitrain.cli.options import (
    check_out,
    number,
    print_summary,
    script_argument,
    training_options,
)


@click.command(cls=Command)
@script_argument
@training_options
@click.option("--set", "overrides", multiple=True, metavar="KEY=V1,V2,...",
              help="Override a CONFIG key (repeatable); comma-separated values of a float key "
                   "are swept, e.g. --set lr=0.01,0.03,0.1.")
@click.option("--seeds", default="0", help="Comma-separated seeds; each makes its own members.")
@click.option("--report/--no-report", default=True, help="Add the resource report of the ensemble.")
@click.option("--plot/--no-plot", default=True, help="Draw --out/sweep.png (needs matplotlib).")
@click.option("--check/--no-check", default=True,
              help="Compare the first step with each member's own single-run step.")
@click.option("--rank-by", "rank_by", default=None, metavar="[max:]METRIC",
              help="Rank members by METRIC, lower is better (max:METRIC: higher is): loss (the "
                   "mean of the last 10 logged train losses), final_loss, or a metric evaluate "
                   "returns, e.g. val_loss or max:accuracy. Default: val_loss where evaluate "
                   "returns it, else loss.")
def sweep(script: Path, overrides: tuple[str, ...], seeds: str, backend: str, steps: int | None,
          out: Path | None, log_every: int, checkpoint_every: int, keep: int, resume: bool,
          overwrite: bool, report: bool, plot: bool, check: bool, rank_by: str | None,
          as_json: bool) -> None:
    """Train every combination of the --set values and --seeds of SCRIPT together, one vmapped
    step for all members, and rank them."""
    from minitrain import metrics
    from minitrain.precision import get_backend
    from minitrain.train.experiment import one_line
    from minitrain.train.ranking import parse_rank_by
    from minitrain.train.signals import stop_requests
    from minitrain.train.sweep import fit_sweep, load_sweep, parse_seeds

    check_out(out, resume, overwrite)
    with training_errors():
        ranked_by = parse_rank_by(rank_by) if rank_by is not None else None
        ensemble = load_sweep(script, overrides, parse_seeds(seeds), steps=steps)
        chosen = get_backend(backend)
    if not as_json:
        click.echo(
            f"{ensemble.size} members of {ensemble.template.name} in one vmapped step "
            f"(swept: {', '.join(ensemble.swept) or 'seeds only'})",
            err=True,
        )
    with stop_requests(keep_until_exit=True), training_errors():
        result = fit_sweep(ensemble, chosen, out_dir=out, log_every=log_every,
                           checkpoint_every=checkpoint_every, keep=keep, resume=resume,
                           overwrite=overwrite, progress=not as_json, report=report, check=check,
                           rank_by=ranked_by)
    summary = result.summary
    if plot and out is not None:
        try:
            summary["plot"] = str(metrics.plot(out, Path(out) / "sweep.png"))
        except Exception as exc:  # no matplotlib or a failed plot never fails a finished sweep
            click.echo(f"warning: could not draw the plot: {one_line(exc)}", err=True)
    print_summary(summary, out, as_json, _show,
                  "of the whole ensemble (predicted vs measured)")


def _show(console: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    ranking = summary["ranking"]
    swept = summary["swept"]
    eval_keys = sorted({key for row in ranking for key in row["eval"]})
    table = Table(
        title=f"{summary['name']}: {summary['members']} members on {summary['backend']}, "
        f"ranked by {ranking[0]['ranked_by'].replace('_', ' ')} "
        f"({'higher' if ranking[0]['higher_is_better'] else 'lower'} is better)"
    )
    for column in ["rank", "member", *swept, "seed", "final loss", "smoothed loss", *eval_keys]:
        table.add_column(column, justify="right")
    table.add_column("status", no_wrap=True)
    for row in ranking:
        diverged = row["diverged_at"] is not None
        cells = [
            str(row["rank"]),
            str(row["member"]),
            *(f"{row['config'][key]:g}" for key in swept),
            str(row["seed"]),
            number(row["final_loss"], 5),
            number(row["smoothed_loss"], 5),
            *(number(row["eval"].get(key), 5) for key in eval_keys),
            f"diverged at step {row['diverged_at']}" if diverged else "ok",
        ]
        table.add_row(*cells, style="red" if diverged else None)
    console.print(table)
    step_ms = summary["step_seconds"] * 1e3
    console.print(
        f"{summary['steps']:,} steps in {summary['seconds']:.2f} s "
        f"({step_ms:.3f} ms per step of all {summary['members']} members); "
        f"{summary['params']:,} params in all ({summary['params_per_member']:,} per member)",
        highlight=False,
    )
    if summary.get("plot"):
        console.print(f"loss curves: {summary['plot']}", highlight=False)
