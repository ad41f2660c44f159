"""``minitrain bench step``: a full functional train step against ``nn.Module`` + fused AdamW.

The chapter's Cruncher (dim 1024, 8 layers, batch 256, MSE to random targets) trained two ways
on the same weights and batch, interleaved round by round in one process:

* the peer: ``nn.Module`` Cruncher, ``loss.backward()`` and ``torch.optim.AdamW(fused=True)``,
  ``zero_grad(set_to_none=True)`` each step (the chapter's loop, 3.5.7);
* minitrain: ``mt.value_and_grad(loss)(params, batch)`` then ``mt.optim.adamw(...).update``, pure
  and with ``donate=True``, eager and under ``torch.compile`` (which takes mt.optim's plain path).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click
import torch
from torch import nn

import minitrain as mt
from minitrain.bench.optim import time_interleaved

ADAMW = dict(lr=1e-3, weight_decay=1e-2)


class Cruncher(nn.Module):
    """The chapter's Cruncher (3.5.2): ``num_layers`` D×D linear maps, then a D×1 head."""

    def __init__(self, params: dict):
        super().__init__()
        self.layers = nn.ParameterList(
            [nn.Parameter(layer["weight"].clone()) for layer in params["layers"]]
        )
        self.final = nn.Parameter(params["final"]["weight"].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.layers:
            x = x @ weight
        return (x @ self.final).squeeze(-1)


def make_problem(dim: int, num_layers: int, batch: int, device: str) -> tuple[dict, tuple]:
    """Cruncher params and one fixed (x, y) batch."""
    g = torch.Generator().manual_seed(0)
    params = mt.models.cruncher_init(dim=dim, num_layers=num_layers, generator=g)
    params = mt.tree.map(lambda t: t.to(device), params)
    x = torch.randn(batch, dim, generator=g).to(device)
    y = torch.randn(batch, generator=g).to(device)
    return params, (x, y)


def cruncher_loss(params: dict, batch: tuple) -> torch.Tensor:
    x, y = batch
    return mt.losses.mse(mt.models.cruncher(params, x), y)


def make_pure_step(donate: bool) -> Callable:
    """``(params, state, batch) -> (params, state, loss)``: value_and_grad, then AdamW."""
    opt = mt.optim.adamw(**ADAMW)
    loss_and_grads = mt.value_and_grad(cruncher_loss)

    def step(params, state, batch):
        loss, grads = loss_and_grads(params, batch)
        params, state = opt.update(grads, state, params, donate=donate)
        return params, state, loss

    return step


class PureStepper:
    """Calls a pure step and carries params and state, as a training loop does."""

    def __init__(self, step: Callable, params: dict, batch: tuple):
        self.step = step
        self.params = mt.tree.map(torch.clone, params)
        self.state = mt.optim.adamw(**ADAMW).init(self.params)
        self.batch = batch

    def __call__(self) -> None:
        self.params, self.state, _ = self.step(self.params, self.state, self.batch)


class ModuleStepper:
    """The chapter's loop: forward, backward, fused AdamW step, zero_grad(set_to_none=True)."""

    def __init__(self, params: dict, batch: tuple):
        self.model = Cruncher(params).to(batch[0].device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW, fused=True)
        self.batch = batch

    def __call__(self) -> None:
        x, y = self.batch
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def measure(
    dim: int = 1024, num_layers: int = 8, batch: int = 256, rounds: int = 15, inner: int = 3,
    device: str = "cpu", with_compile: bool = True,
) -> dict[str, Any]:
    """Best-round seconds per train step of each variant and their ratios to the peer."""
    params, data = make_problem(dim, num_layers, batch, device)
    steppers: dict[str, Callable[[], None]] = {
        "module_fused_adamw": ModuleStepper(params, data),
        "minitrain_pure": PureStepper(make_pure_step(donate=False), params, data),
        "minitrain_donate": PureStepper(make_pure_step(donate=True), params, data),
    }
    compile_seconds = None
    if with_compile:
        compiled = PureStepper(torch.compile(make_pure_step(donate=False)), params, data)
        start = time.perf_counter()
        compiled()
        compile_seconds = time.perf_counter() - start
        steppers["minitrain_compiled"] = compiled
    seconds = time_interleaved(steppers, rounds, inner, device)
    peer = seconds["module_fused_adamw"]
    return {
        "device": device,
        "model": f"Cruncher dim {dim}, {num_layers} layers, batch {batch}, fp32",
        "seconds": seconds,
        "ratio_to_peer": {name: value / peer for name, value in seconds.items()},
        "compile_seconds": compile_seconds,
    }


@click.command()
@click.option("--dim", type=click.IntRange(min=1), default=1024)
@click.option("--layers", "num_layers", type=click.IntRange(min=0), default=8)
@click.option("--batch", type=click.IntRange(min=1), default=256)
@click.option("--rounds", type=click.IntRange(min=1), default=15, help="Interleaved rounds.")
@click.option("--inner", type=click.IntRange(min=1), default=3, help="Steps per round.")
@click.option("--device", default="cpu", help="cpu or cuda.")
@click.option("--compile/--no-compile", "with_compile", default=True,
              help="Also time the pure step under torch.compile.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def step(dim: int, num_layers: int, batch: int, rounds: int, inner: int, device: str,
         with_compile: bool, as_json: bool) -> None:
    """Functional train step (value_and_grad + AdamW) over nn.Module + fused AdamW."""
    from minitrain.cli.errors import UserError

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda needs a CUDA GPU; none is available, use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"--device {device!r} is not supported; use cpu or cuda")
    result = measure(dim, num_layers, batch, rounds, inner, device, with_compile)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"train step of the {result['model']} on {device} "
               f"(best of {rounds} interleaved rounds x {inner})")
    for name, seconds in result["seconds"].items():
        click.echo(f"  {name:20s} {seconds * 1e3:8.2f} ms  {result['ratio_to_peer'][name]:.2f}x")
    if result["compile_seconds"] is not None:
        click.echo(f"  (torch.compile took {result['compile_seconds']:.1f} s, not counted)")
