"""``minitrain profile SCRIPT``: every op of a real training step on a roofline.

One step of ``make_train_step`` runs under :class:`minitrain.accounting.Counter`; each aten call
is placed on the roofline (max(FLOPs / peak, bytes / bandwidth)) and the sum set against the
measured step time.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any

import click

from minitrain.accounting.units import si
from minitrain.cli.errors import Command
from minitrain.cli.options import PNG, SEED, Whole, echo_json, script_argument
from minitrain.cli.roofline import print_table, roof_line


def profile_script(
    script: Path, overrides: dict[str, str], backend_name: str, hardware_name: str,
    dtype: str | None, seed: int, warmup: int, repeats: int,
) -> tuple[Any, dict[str, Any], Any]:
    """Run a script's step under the counter, timed: ``(profile, config, counter)``."""
    from minitrain.accounting.counter import Counter
    from minitrain.accounting.hardware import dtype_name
    from minitrain.accounting.roofline import profile_records, roof
    from minitrain.precision import get_backend
    from minitrain.train import load_experiment, make_train_step
    from minitrain.train.step import first_step_inputs, with_fixed_key

    experiment, config = load_experiment(script, overrides)
    experiment = with_fixed_key(experiment, seed)
    backend = get_backend(backend_name)
    on = roof(hardware_name, dtype or dtype_name(str(backend.compute_dtype)))
    # the carry: the model state (BatchNorm statistics) and loss scale a run carries
    params, opt_state, batch, carry = first_step_inputs(experiment, backend, seed)
    step = functools.partial(make_train_step(experiment, backend), carry=carry)
    for _ in range(warmup):  # first calls pay for lazy initialization
        out = step(params, opt_state, batch)
        params, opt_state = out.params, out.opt_state
        step = functools.partial(step.func, carry=out.carry)
    times = []
    for _ in range(repeats):  # the median wall time of the pure step on the same inputs
        backend.synchronize()
        start = time.perf_counter()
        step(params, opt_state, batch)
        backend.synchronize()
        times.append(time.perf_counter() - start)
    with Counter(track_memory=False) as counter:
        step(params, opt_state, batch)
    return profile_records(counter.records, on, statistics.median(times)), config, counter


@click.command(cls=Command)
@script_argument
@click.option("--hardware", "hardware_name", default="cpu", help="Roof: cpu (measured) or a GPU.")
@click.option("--dtype", default=None, help="Peak of this dtype [default: the backend's].")
@click.option("--backend", "backend_name", default="cpu", help="Backend the step runs on.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override CONFIG.")
@click.option("--seed", type=SEED, default=0, help="Seed for init and data.")
@click.option("--warmup", type=Whole(min=0), default=2, help="Untimed steps first.")
@click.option("--repeats", type=Whole(min=1), default=5, help="Timed steps (median).")
@click.option("--top", type=Whole(min=1), default=15, help="Rows of the op table.")
@click.option("--plot", "plot_path", type=PNG, default=None, help="Draw the roofline.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def profile(script: Path, hardware_name: str, dtype: str | None, backend_name: str,
            overrides: tuple[str, ...], seed: int, warmup: int, repeats: int, top: int,
            plot_path: str | None, as_json: bool) -> None:
    """Place every op of one training step of SCRIPT on a roofline (see examples/linreg.py)."""
    from minitrain.accounting.roofline import plot
    from minitrain.train.experiment import parse_overrides

    result, config, counter = profile_script(
        script, parse_overrides(overrides), backend_name, hardware_name, dtype, seed, warmup,
        repeats,
    )
    if plot_path is not None:
        achieved = result.achieved_flops
        measured = [("whole step, measured", result.intensity, achieved)] if achieved else []
        plot(result.roof, result.groups, plot_path, measured=measured, label_top=8,
             title=f"{script.name}: one training step on {result.roof.name}")
    if as_json:
        echo_json(_record(script, config, result, counter, plot_path))
        return
    _print(script, result, counter, top)
    if plot_path is not None:
        click.echo(f"wrote {plot_path}")


def _record(script: Path, config: dict, result: Any, counter: Any, plot_path: str | None) -> dict:
    r = result.roof
    return {
        "script": str(script), "config": config,
        "roof": {"name": r.name, "peak_flops": r.peak_flops, "bandwidth": r.bandwidth,
                 "accelerator_intensity": r.ridge, "source": r.source},
        "flops": result.flops, "bytes": result.bytes, "intensity": result.intensity,
        "predicted_seconds": result.predicted_seconds,
        "measured_seconds": result.measured_seconds, "achieved_flops": result.achieved_flops,
        "unknown_ops": dict(counter.unknown),
        "ops": [g._asdict() for g in result.groups],
        "calls": [c._asdict() for c in result.calls],
        "plot": plot_path,
    }


def _print(script: Path, result: Any, counter: Any, top: int) -> None:
    click.echo(roof_line(result.roof))
    columns = ["op (phase)", "calls", "FLOPs", "bytes", "FLOP/byte", "bound", "predicted"]
    moving = [g for g in result.groups if g.bound != "none"]
    rows = [[g.name.removeprefix("aten."), str(g.count), f"{g.flops:.4g}", f"{g.bytes:.4g}",
             f"{g.intensity:.3g}", g.bound, si(g.seconds, "s")] for g in moving[:top]]
    title = f"{script.name}: {len(result.calls)} op calls in one step, slowest predicted first"
    if len(moving) > top:
        title += f" (top {top} of {len(moving)})"
    print_table(title, columns, rows)
    views = sum(g.count for g in result.groups if g.bound == "none")
    if views:
        click.echo(f"{views} view op calls moved no bytes and did no FLOPs (not shown)")
    ratio = result.measured_seconds / result.predicted_seconds if result.predicted_seconds else 0
    click.echo(
        f"step: {result.flops:.4g} FLOPs, {result.bytes:.4g} bytes, "
        f"{result.intensity:.3g} FLOP/byte; predicted {si(result.predicted_seconds, 's')} "
        f"(sum of per-op roofline times), measured {si(result.measured_seconds, 's')} "
        f"(median) = {ratio:.3g}x predicted"
    )
    per_call = result.predicted_seconds / max(len(result.calls), 1)
    if ratio > 10 and per_call < 10e-6:
        click.echo(
            f"ops average {si(per_call, 's')} on the roofline: per-op overhead (Python, "
            "dispatch, kernel launch), which a roofline does not model, dominates"
        )
    if counter.unknown:
        click.echo(f"ops without a FLOP formula (counted as 0): {dict(counter.unknown)}")
