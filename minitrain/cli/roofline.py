"""``minitrain hardware``: the accelerator registry, and this machine's CPU measured;
``minitrain roofline``: the chapter's arithmetic-intensity table on a device, and its plot."""

from __future__ import annotations

from typing import Any

import click

from minitrain.accounting.units import si
from minitrain.cli.errors import Command, UserError
from minitrain.cli.options import PNG, Whole, echo_json, emit


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
    return (
        f"{r.name}: peak {si(r.peak_flops, 'FLOP/s')}, bandwidth {si(r.bandwidth, 'B/s')}, "
        f"accelerator intensity {r.ridge:.1f} FLOP/byte"
    )


@click.command(cls=Command)
@click.option("--hardware", "hardware_name", default="h100", help="A registered device or cpu.")
@click.option("--dtype", default="bf16", help="Peak FLOP/s and element size of this dtype.")
@click.option("--n", type=Whole(min=1), default=1024, help="Operand size n of the ops.")
@click.option("--plot", "plot_path", type=PNG, default=None, help="Draw the roofline.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def roofline(hardware_name: str, dtype: str, n: int, plot_path: str | None, as_json: bool) -> None:
    """The chapter's five ops (ReLU, GeLU, dot, mat-vec, matmul) on a device's roofline."""
    from minitrain.accounting.hardware import dtype_name
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
    from minitrain import accounting as acc

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
