"""The README's headline figures, computed by the library: a Markdown table, one row per figure,
each with the command that reproduces it (``python tools/figures.py formats``: the docs' table
of number formats). ``tools/generate_docs.py`` pastes the table into the
README, and its ``--check`` fails when a figure changes.

Every figure here is deterministic (napkin math, predictions on fake tensors, a seeded CPU run),
so the table is the same on every machine; timings live on the dated benchmark pages.
"""

from __future__ import annotations

import math

import torch

import minitrain as mt
from minitrain.cli.formats import stats_record

OWN = "python tools/figures.py"  # the figures no single command prints


def napkin() -> list[tuple[str, str, str]]:
    acc = mt.accounting
    flops = acc.training_flops(params=70e9, tokens=15e12)
    days = acc.training_time(flops, hardware="h100", gpus=1024, mfu=0.5) / acc.SECONDS_PER_DAY
    largest = acc.max_params("h100", optimizer="adamw", precision="fp32", gpus=8)
    ridge = acc.hardware("h100").intensity("bf16")
    return [
        ("70B params × 15T tokens on 1024 H100s at 50% MFU", f"{days:.1f} days (6·N·D FLOPs)",
         "minitrain estimate time --params 70e9 --tokens 15e12 --hardware h100 --gpus 1024"),
        ("largest model trained with fp32 AdamW on 8 × 80 GB", f"{largest / 1e9:.1f}B params",
         "minitrain estimate memory --hardware h100 --gpus 8 --optimizer adamw"),
        ("H100 ridge point, dense bf16", f"{ridge:.1f} FLOP/byte",
         "minitrain roofline --hardware h100"),
    ]


def cruncher_step() -> list[tuple[str, str, str]]:
    """A Cruncher D=1024, L=8, B=256 step predicted on fake tensors (nothing allocated)."""
    params = mt.models.cruncher_init(dim=1024, num_layers=8, generator=torch.Generator())
    batch = (torch.empty(256, 1024, device="meta"), torch.empty(256, device="meta"))

    def loss(p, b):
        return mt.losses.mse(mt.models.cruncher(p, b[0]), b[1])

    rows = []
    command = ("minitrain estimate step examples/linreg.py --set dim=1024 --set num_layers=8 "
               "--set batch_size=256 --pure")
    for name, opt in (("SGD", mt.optim.sgd(lr=0.01)), ("AdamW", mt.optim.adamw(lr=1e-3))):
        pred = mt.accounting.predict_step(loss, params, batch, optimizer=opt)
        rows.append((f"Cruncher D=1024, L=8, B=256, {name} step: predicted peak memory",
                     f"{pred.peak_bytes:,} B", command if name == "SGD" else OWN))
    pred_flops = mt.accounting.predict_step(loss, params, batch, optimizer=None)
    size = mt.tree.size(params)
    rows.append(("the same, matmul FLOPs per step: exact vs 6·B·P",
                 f"{pred_flops.matmul_flops:,} vs {6 * 256 * size:,}", command))
    return rows


def linreg_run() -> list[tuple[str, str, str]]:
    import runpy

    script = runpy.run_path("examples/linreg.py")
    result = mt.fit(script["experiment"](dict(script["CONFIG"])), mt.get_backend("cpu"),
                    progress=False, seed=0)
    # Converged to float32's noise, whose last digits differ between CPUs (AVX2 or AVX-512
    # sums): the power of ten above it
    bound = 10.0 ** math.ceil(math.log10(result.summary["final_loss"]))
    return [("linreg, defaults (SGD, lr 0.01, 1000 steps, seed 0)", f"final loss < {bound:.0e}",
             "minitrain run examples/linreg.py")]


def formats() -> list[tuple[str, str, str]]:
    rows = []
    for name in ("bf16", "fp8_e4m3", "mxfp4", "nvfp4"):
        rel = stats_record(name, 1.0, 0)["rel_error"]
        rows.append((f"{name}: relative rounding error on N(0, 1)", f"{rel:.2e}",
                     "minitrain formats --stats"))
    return rows


def formats_table() -> None:
    """Every number format: layout, range, and rounding error on N(0, 1) samples (seed 0)."""
    import json

    from minitrain.cli.formats import formats as command

    records = json.loads(_invoke(command, ["--stats", "--json"]))
    print("| format | bits/value | max | eps | block | source | rel. error | underflow |")
    print("|---|---:|---:|---:|---|---|---:|---:|")
    for r in records:
        block = f"{r['block_size']} × {r['scale_format']}" if r["block_size"] else "-"
        stats = r["stats"]
        print(f"| `{r['name']}` | {r['bits_per_element']:g} | {r['max']:.4g} | {r['epsilon']:.4g} "
              f"| {block} | {r['source']} | {stats['rel_error']:.2e} "
              f"| {100 * stats['underflow']:.2f} % |")


def _invoke(command, args: list[str]) -> str:
    from click.testing import CliRunner

    result = CliRunner().invoke(command, args, catch_exceptions=False)
    return result.output


def main() -> None:
    import sys

    if sys.argv[1:] == ["formats"]:
        return formats_table()
    print("| figure | value | reproduce |")
    print("|---|---|---|")
    for what, value, command in [*napkin(), *cruncher_step(), *linreg_run(), *formats()]:
        print(f"| {what} | {value} | `{command}` |")


if __name__ == "__main__":
    main()
