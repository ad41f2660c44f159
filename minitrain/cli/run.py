"""``minitrain run SCRIPT``, ``minitrain sweep SCRIPT --set lr=0.01,0.1 --seeds 0,1`` (a grid
trained by one vmapped step) and the commands around them: ``backends``, ``prepare`` (the
byte-level corpus the examples train on) and ``plot`` (the loss curves of runs)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import click

from minitrain.cli.errors import Command, RunFailed, UserError, cli_errors
from minitrain.cli.options import (
    PNG,
    SEED,
    Real,
    Whole,
    check_out,
    emit,
    number,
    print_summary,
    script_argument,
    training_options,
)


@click.command(cls=Command)
@script_argument
@training_options
@click.option("--seed", type=SEED, default=0, help="Seed for init and data (0 to 2**63-1).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a CONFIG key of the script (repeatable), e.g. --set lr=0.1.")
@click.option("--tensorboard", is_flag=True, help="Also log to --out/tensorboard (extra).")
@click.option("--report/--no-report", default=True, help="Add the resource report.")
@click.option("--compile", "compile_", is_flag=True,
              help="torch.compile forward and backward (the update stays eager).")
@click.option("--nproc", type=Whole(min=1), default=None,
              help="Data parallel: start N workers with torch.distributed's elastic agent (as "
                   "torchrun); gloo on CPU, NCCL on CUDA. The global batch stays the same.")
def run(script: Path, backend: str, steps: int | None, seed: int, overrides: tuple[str, ...],
        out: Path | None, log_every: int, checkpoint_every: int, keep: int, resume: bool,
        overwrite: bool, tensorboard: bool, report: bool, compile_: bool, as_json: bool,
        nproc: int | None) -> None:
    """Train the experiment defined in SCRIPT (see examples/linreg.py)."""
    from minitrain.precision import get_backend
    from minitrain.train import fit, load_experiment
    from minitrain.train.experiment import parse_overrides
    from minitrain.train.signals import stop_requests

    experiment, config = load_experiment(script, parse_overrides(overrides), steps=steps)
    chosen = get_backend(backend)
    check_out(out, resume, overwrite)
    if nproc is not None:
        _launch_workers(nproc, experiment, chosen)
        return
    parallel = _join_process_group(chosen)
    outcome: Any = contextlib.nullcontext()
    if parallel is not None:
        from minitrain.cli.launch import worker_outcome  # torch.distributed: only in a worker

        outcome = worker_outcome(parallel)
    with stop_requests(keep_until_exit=True), outcome:
        with cli_errors():  # mapped inside the outcome, which ends a worker by the CLI error
            result = fit(experiment, chosen, seed=seed, out_dir=out, log_every=log_every,
                         checkpoint_every=checkpoint_every, keep=keep, resume=resume,
                         overwrite=overwrite, progress=not as_json, compile=compile_,
                         tensorboard=tensorboard, report=report, config=config, parallel=parallel)
        if parallel is None or parallel.is_main:
            print_summary(result.summary, out, as_json, _show_run,
                          "(predicted vs measured, one step)")


def _launch_workers(nproc: int, experiment: Any, backend: Any) -> None:
    """``--nproc N``: check the run can be split, then start N workers with this command line."""
    from minitrain import distributed
    from minitrain.cli import launch

    if distributed.in_worker():
        raise UserError(
            "--nproc starts its own workers; under torchrun drop --nproc "
            "(torchrun --nproc-per-node sets the number of workers)"
        )
    try:
        distributed.check_splittable(experiment, backend, nproc)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    argv = launch.forward_argv(click.get_current_context(), drop=("nproc",))
    launch.launch(nproc, ["run", *argv])


def _join_process_group(backend: Any) -> Any:
    """The rank's :class:`minitrain.distributed.DataParallel` under torchrun, else None."""
    from minitrain import distributed

    try:  # None outside a worker
        return distributed.from_environment(backend.device)
    except (ValueError, RuntimeError) as exc:
        raise RunFailed(f"could not join the process group: {exc}") from None


def _show_run(console: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"{summary['name']} on {summary['backend']}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    rows = [
        ("steps", f"{summary['steps']:,}"),
        ("final loss", number(summary.get("final_loss"))),
        ("wall time", f"{summary['seconds']:.2f} s"),
        ("step time", f"{summary['step_seconds'] * 1e3:.3f} ms"),
        ("params", f"{summary['params']:,}"),
        *([("ranks (data parallel)", str(summary["ranks"]))] if "ranks" in summary else []),
        ("FLOPs / step (6·B·P)", f"{summary['flops_per_step']:,}"),
    ]
    if summary.get("flops_per_step_exact") is not None:
        rows.append(("FLOPs / step (exact)", f"{summary['flops_per_step_exact']:,}"))
    rows += [(f"eval {k}", f"{v:.6g}") for k, v in summary.get("eval", {}).items()]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


@click.command(cls=Command)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def backends(as_json: bool) -> None:
    """List the installed backends and whether each can run on this machine."""
    from minitrain.precision import backend_statuses

    statuses = backend_statuses()
    emit([status._asdict() for status in statuses],
         [f"{s.name:10s} usable: {'yes' if s.usable else 'no '}  {s.reason}  ({s.source})"
          for s in statuses], as_json)


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


def _summary(records: list[dict]) -> dict:
    return {"records": len(records), "first_step": records[0]["step"],
            "last_step": records[-1]["step"], "last": records[-1]}


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
    ranked_by = parse_rank_by(rank_by) if rank_by is not None else None
    ensemble = load_sweep(script, overrides, parse_seeds(seeds), steps=steps)
    chosen = get_backend(backend)
    if not as_json:
        click.echo(
            f"{ensemble.size} members of {ensemble.template.name} in one vmapped step "
            f"(swept: {', '.join(ensemble.swept) or 'seeds only'})",
            err=True,
        )
    with stop_requests(keep_until_exit=True):
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
    print_summary(summary, out, as_json, _show_sweep,
                  "of the whole ensemble (predicted vs measured)")


def _show_sweep(console: Any, summary: dict[str, Any]) -> None:
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
