"""``minitrain bench step``: the command over :mod:`minitrain.bench.step` (the Cruncher, default)
and :mod:`minitrain.bench.gpt_step` (``--model gpt``): parse, run, print."""

from __future__ import annotations

import json
from typing import Any

import click
import torch

from minitrain.cli.errors import UserError

__all__ = ["step"]

# Sizes of each model when the flag is not given: the Cruncher of the chapter (3.5.2) and
# bytelm's GPT at the size of minitrain.bench.gpt_step.DEFAULT.
CRUNCHER_DEFAULTS = {"dim": 1024, "num_layers": 8, "batch": 256}
GPT_DEFAULTS = {"dim": 256, "num_layers": 4, "batch": 16}


def _check_device(device: str, model: str) -> None:
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"--device {device!r} is not supported; use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda needs a CUDA GPU; none is available, use --device cpu")
    if model == "gpt" and device != "cpu":
        raise UserError("--model gpt times the CPU step only; drop --device or use --device cpu")


def _sizes(model: str, given: dict[str, int | None]) -> dict[str, int]:
    """The flags given, else the model's defaults.

    >>> _sizes("gpt", {"dim": None, "num_layers": 2, "batch": None})
    {'dim': 256, 'num_layers': 2, 'batch': 16}
    """
    defaults = GPT_DEFAULTS if model == "gpt" else CRUNCHER_DEFAULTS
    return {key: defaults[key] if value is None else value for key, value in given.items()}


def _print_cruncher(result: dict[str, Any], device: str, rounds: int, inner: int) -> None:
    click.echo(f"train step of the {result['model']} on {device} "
               f"(best of {rounds} interleaved rounds x {inner})")
    for name, seconds in result["seconds"].items():
        click.echo(f"  {name:26s} {seconds * 1e3:8.2f} ms  {result['ratio_to_peer'][name]:.2f}x")
    if result["compile_seconds"] is not None:
        click.echo(f"  (torch.compile took {result['compile_seconds']:.1f} s, not counted)")


def _print_gpt(result: dict[str, Any], rounds: int, inner: int) -> None:
    config = result["config"]
    click.echo(
        f"train step of bytelm's GPT (d_model {config['d_model']}, {config['n_layers']} layers, "
        f"{config['n_heads']} heads, seq_len {config['seq_len']}, batch {config['batch_size']}; "
        f"{result['gflops_per_step']:.2f} GFLOP/step) on cpu "
        f"(best of {rounds} interleaved rounds x {inner})"
    )
    for name, seconds in result["seconds"].items():
        rate = result["achieved_gflops"].get(name)
        click.echo(f"  {name:28s} {seconds * 1e3:8.2f} ms  {rate:7.1f} GFLOP/s")
    for name, ratio in result["ratios"].items():
        peer = "fp32 functional step" if name == "fp8/fp32" else "nanoGPT nn.Module"
        target = 2.0 if name == "fp8/fp32" else 1.05
        label = "minitrain fp8" if name == "fp8/fp32" else f"minitrain {name}"
        paired = result["paired_median_ratios"][name]
        click.echo(f"  {label} / {peer}: {ratio:.2f}x best rounds, {paired:.2f}x median of "
                   f"paired rounds (target <= {target}x)")


@click.command()
@click.option("--model", type=click.Choice(["cruncher", "gpt"]), default="cruncher",
              show_default=True,
              help="cruncher: the chapter's Cruncher vs nn.Module + fused AdamW; gpt: bytelm's "
                   "GPT vs nanoGPT's nn.Module + fused AdamW, fp32 / bf16 / simulated fp8.")
@click.option("--dim", type=click.IntRange(min=1), default=None,
              show_default="cruncher 1024, gpt 256", help="Width (d_model for gpt).")
@click.option("--layers", "num_layers", type=click.IntRange(min=0), default=None,
              show_default="cruncher 8, gpt 4", help="Layers.")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              show_default="cruncher 256, gpt 16", help="Batch size.")
@click.option("--heads", type=click.IntRange(min=1), default=4, show_default=True,
              help="Attention heads (gpt only).")
@click.option("--seq-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Sequence length (gpt only).")
@click.option("--rounds", type=click.IntRange(min=1), default=15, show_default=True,
              help="Interleaved rounds.")
@click.option("--inner", type=click.IntRange(min=1), default=3, show_default=True,
              help="Steps per round.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (cruncher only).")
@click.option("--compile/--no-compile", "with_compile", default=True, show_default=True,
              help="Also time the steps under torch.compile.")
@click.option("--fp8/--no-fp8", "with_fp8", default=True, show_default=True,
              help="Also time the simulated fp8 step (gpt only).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def step(model: str, dim: int | None, num_layers: int | None, batch: int | None, heads: int,
         seq_len: int, rounds: int, inner: int, device: str, with_compile: bool, with_fp8: bool,
         as_json: bool) -> None:
    """Functional train step (value_and_grad + AdamW) over nn.Module + fused AdamW."""
    _check_device(device, model)
    sizes = _sizes(model, {"dim": dim, "num_layers": num_layers, "batch": batch})
    if model == "gpt":
        from minitrain.bench.gpt_step import gpt_step_ratios

        if sizes["dim"] % heads:
            raise UserError(f"--dim {sizes['dim']} must be a multiple of --heads {heads}")
        config = {"d_model": sizes["dim"], "n_layers": sizes["num_layers"], "n_heads": heads,
                  "seq_len": seq_len, "batch_size": sizes["batch"]}
        result = gpt_step_ratios(config, rounds, inner, compile=with_compile, fp8=with_fp8)
    else:
        from minitrain.bench.step import measure

        result = measure(sizes["dim"], sizes["num_layers"], sizes["batch"], rounds, inner,
                         device, with_compile)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif model == "gpt":
        _print_gpt(result, rounds, inner)
    else:
        _print_cruncher(result, device, rounds, inner)
