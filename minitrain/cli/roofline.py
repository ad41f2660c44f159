"""Rooflines from the shell: ``minitrain hardware`` (the accelerator registry, and this
machine's CPU measured), ``minitrain roofline`` (the chapter's arithmetic-intensity table on a
device) and ``minitrain profile SCRIPT`` (every op of a real training step on a roofline).

``profile`` runs one step of ``make_train_step`` under :class:`minitrain.accounting.Counter`;
each aten call is placed on the roofline (max(FLOPs / peak, bytes / bandwidth)) and the sum set
against the measured step time.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any

import click

from minitrain import accounting as acc  # the registry: no torch
from minitrain.accounting.hardware import dtype_name
from minitrain.accounting.units import si
from minitrain.cli.errors import Command, UserError
from minitrain.cli.options import PNG, SEED, Whole, echo_json, emit, script_argument


def print_table(title: str, columns: list[str], rows: list[list[str]], width: int = 120) -> None:
    """Print a right-aligned table with rich, at least ``width`` characters wide."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console = Console()
    Console(width=max(console.width, width)).print(table)


def roof_line(r: Any) -> str:
    return (f"{r.name}: peak {si(r.peak_flops, 'FLOP/s')}, bandwidth {si(r.bandwidth, 'B/s')}, "
            f"accelerator intensity {r.ridge:.1f} FLOP/byte")


@click.command(cls=Command)
@click.option("--hardware", "hardware_name", default="h100", help="A registered device or cpu.")
@click.option("--dtype", default="bf16", help="Peak FLOP/s and element size of this dtype.")
@click.option("--n", type=Whole(min=1), default=1024, help="Operand size n of the ops.")
@click.option("--plot", "plot_path", type=PNG, default=None, help="Draw the roofline.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def roofline(hardware_name: str, dtype: str, n: int, plot_path: str | None, as_json: bool) -> None:
    """The chapter's five ops (ReLU, GeLU, dot, mat-vec, matmul) on a device's roofline."""
    from minitrain.accounting.roofline import DTYPE_BYTES, chapter_ops, place, plot, roof

    r = roof(hardware_name, dtype)
    name = dtype_name(dtype)
    placements = [place(op, r) for op in chapter_ops(n, DTYPE_BYTES[name])]
    if plot_path is not None:
        plot(r, placements, plot_path, title=f"Roofline: {r.name}, ops of size n={n}")
    if as_json:
        record = {
            "hardware": r.name.split()[0], "dtype": name, "peak_flops": r.peak_flops,
            "bandwidth": r.bandwidth, "accelerator_intensity": r.ridge, "n": n,
            "bytes_per_element": DTYPE_BYTES[name],
            "ops": [p._asdict() for p in placements], "plot": plot_path,
            "source": r.source,
        }
        echo_json(record)
        return
    click.echo(roof_line(r))
    columns = ["op", "FLOPs", "bytes", "FLOP/byte", "bound", "attainable", "MFU ≤", "time"]
    rows = [[p.name, f"{p.flops:.4g}", f"{p.bytes:.4g}", f"{p.intensity:.3g}", p.bound,
             si(p.attainable_flops, "FLOP/s"), f"{p.mfu_bound:.3f}", si(p.seconds, "s")]
            for p in placements]
    print_table(f"chapter 3.6.4 ops, n={n}, {DTYPE_BYTES[name]:g} bytes/element", columns, rows)
    if plot_path is not None:
        click.echo(f"wrote {plot_path}")


@click.command(cls=Command)
@click.argument("name", required=False)
@click.option("--measure", is_flag=True,
              help="Measure the CPU again now (a kept measurement is reused for a week on the "
                   "same machine and torch build).")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
def hardware(name: str | None, measure: bool, as_json: bool) -> None:
    """List accelerators (peak FLOP/s dense and sparse, memory, bandwidth, source), or NAME."""
    if measure and name is not None and name.strip().lower() != "cpu":
        raise UserError(
            f"--measure measures this machine's CPU, not {name!r}; run "
            "`minitrain hardware cpu --measure`"
        )
    if measure:
        acc.measure_cpu(refresh=True)
    specs = [acc.hardware(n) for n in ([name] if name else acc.hardware_names())]
    records = [spec.to_dict() | {"intensity_bf16": spec.intensity("bf16")} for spec in specs]
    lines = [f"{'name':<11}{'bf16 dense':>12}{'bf16 sparse':>13}{'fp32':>10}{'memory':>9}"
             f"{'bandwidth':>11}{'FLOP/B':>8}"]
    for spec in specs:
        sparse = spec.sparse_flops.get("bf16")
        lines.append(
            f"{spec.name:<11}{si(spec.peak('bf16')):>12}"
            f"{'-' if sparse is None else si(sparse):>13}"
            f"{si(spec.peak('fp32')):>10}{spec.memory_bytes / 1e9:>7.0f} G"
            f"{si(spec.memory_bandwidth) + '/s':>11}{spec.intensity('bf16'):>8.0f}"
        )
    lines += ["", *(f"{spec.name}: {spec.description}. {spec.source}" for spec in specs)]
    emit(records if name is None else records[0], lines, as_json)


def profile_script(
    script: Path, overrides: dict[str, str], backend_name: str, hardware_name: str,
    dtype: str | None, seed: int, warmup: int, repeats: int,
) -> tuple[Any, dict[str, Any], Any]:
    """Run a script's step under the counter, timed: ``(profile, config, counter)``."""
    from minitrain.accounting.counter import Counter
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
    return {
        "script": str(script), "config": config,
        "roof": result.roof._asdict() | {"accelerator_intensity": result.roof.ridge},
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
