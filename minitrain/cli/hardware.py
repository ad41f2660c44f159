"""``minitrain hardware``: the accelerator registry, and this machine's CPU measured."""

from __future__ import annotations

import click

from minitrain.accounting.units import si
from minitrain.cli.errors import Command, UserError
from minitrain.cli.options import emit


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
