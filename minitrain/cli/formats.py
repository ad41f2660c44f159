"""``minitrain formats``: the number formats from fp32 down to NVFP4, side by side."""

from __future__ import annotations

import math

import click

from minitrain.cli.errors import Command, UserError
from minitrain.cli.options import SEED, Real, echo_json, number
from minitrain.cli.roofline import print_table


def stats_record(name: str, std: float, seed: int) -> dict[str, float]:
    """Error statistics of a format on 65536 Gaussian samples of standard deviation ``std``
    (their magnitudes for an unsigned format)."""
    import torch

    from minitrain.precision import error_stats, spec

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 256, generator=generator) * std
    return error_stats(x if spec(name).signed else x.abs(), name)._asdict()


@click.command(cls=Command)
@click.option("--values", "values_of", default=None, metavar="FORMAT", help="List every code.")
@click.option("--stats", is_flag=True, help="Add error statistics on Gaussian samples.")
@click.option("--std", type=Real(min=0, min_open=True), default=1.0,
              help="Standard deviation of the samples.")
@click.option("--seed", type=SEED, default=0, help="Seed of the samples.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def formats(values_of: str | None, stats: bool, std: float, seed: int, as_json: bool) -> None:
    """Number formats: bits, range, precision and encodings (fp32 ... fp4, MX and NVFP4)."""
    from minitrain.precision import FORMATS, spec, values

    if values_of is not None:
        try:
            codes = values(values_of)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        _print_values(values_of, codes, as_json)
        return
    records = [{**spec(name).__dict__, "bits_per_element": spec(name).bits_per_element}
               for name in FORMATS]
    if stats:
        for record in records:
            record["stats"] = stats_record(record["name"], std, seed)
    if as_json:
        echo_json(records)
        return
    columns = ["format", "bits", "E", "M", "bias", "max", "min normal", "min subnormal", "eps"]
    columns += ["inf", "NaN", "block", "bits/elem"]
    if stats:
        columns += ["rel. error", "underflow", "overflow"]
    rows = []
    for r in records:
        row = [
            r["name"], *(str(r[k]) for k in ("bits", "exponent_bits", "mantissa_bits", "bias")),
            *(number(r[k]) for k in ("max", "min_normal", "min_subnormal", "epsilon")),
            "yes" if r["inf"] else "-", "yes" if r["nan"] else "-",
            f"{r['block_size']} x {r['scale_format']}" if r["block_size"] else "-",
            f"{r['bits_per_element']:g}",
        ]
        if stats:
            s = r["stats"]
            row += [f"{s['rel_error']:.2e}", f"{s['underflow']:.2%}", f"{s['overflow']:.2%}"]
        rows.append(row)
    title = "number formats" + (f"; errors on N(0, {std:g}²) samples" if stats else "")
    print_table(title, columns, rows, width=170)


def _print_values(name: str, codes: list[tuple[int, float]], as_json: bool) -> None:
    from minitrain.precision import spec

    bits = spec(name).bits
    if as_json:
        echo_json([{"code": c, "value": v if math.isfinite(v) else str(v)} for c, v in codes])
        return
    rows = [[f"{c:0{bits}b}", f"{c}", f"{v:g}"] for c, v in codes]
    print_table(f"{name}: all {len(codes)} codes", ["bits", "code", "value"], rows)
