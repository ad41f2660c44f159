"""``python benchmarks/step.py``: a full functional train step against ``nn.Module`` + fused AdamW.

The chapter's Cruncher (dim 1024, 8 layers, batch 256, MSE to random targets) trained two ways
on the same weights and batch, interleaved round by round in one process:

* the peer: ``nn.Module`` Cruncher, ``loss.backward()`` and ``torch.optim.AdamW(fused=True)``,
  ``zero_grad(set_to_none=True)`` each step (the chapter's loop, 3.5.7);
* minitrain: ``mt.value_and_grad(loss)(params, batch)`` then ``mt.optim.adamw(...).update``, pure
  and with ``donate=True``, eager and under ``torch.compile`` (where mt.optim runs the
  chain's tensor ops: a traced update leaves the kernels).

The compiled step copies its new params and state into buffers it is given (``out``), so that
inductor stores each result straight into them instead of into fresh allocations: the pure
variant passes the buffers of the step before last (its inputs are never written, as the eager
pure update recycles buffers), the donated one passes the inputs themselves. It compiles with
:data:`COMPILE_OPTIONS`, which compute the update's step-count scalars once per step rather
than once per element (see :class:`ScalarCSE`).

Shape checks step aside while dynamo traces, so forward, backward and update compile into one
graph, in which inductor updates each layer as soon as its gradient is ready.

``minitrain_run_compile`` is what ``minitrain run --compile`` does: the forward pass under
``torch.compile`` (its backward through AOTAutograd), then the eager update, donated (torch's fused
kernel, in place).

``--model gpt`` trains bytelm's GPT against nanoGPT's ``nn.Module`` instead (:mod:`_gpt_step`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click
import torch
from _pages import page
from _timing import main, time_interleaved
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import minitrain as mt
from minitrain.errors import UserError

ADAMW = dict(lr=1e-3, weight_decay=1e-2)


class ScalarCSE(CustomGraphPass):
    """Merge repeated one-element computations of an inductor (post-grad) graph into one node.

    Traced, mt.optim's chain computes each leaf's bias corrections (``1 - beta**step``)
    from the step count anew. Inductor inlines each such 0-d chain into the loop of its leaf's
    update, and as it compiles C++ with errno-preserving libm calls, the compiler may not hoist
    the ``pow`` out of the loop: two double ``pow`` per vector of 16 floats, which made the
    update of 8 × 1024² fp32 leaves take 9.4 ms against 4.6 ms for ``torch._fused_adamw_``.
    Merged, the node has a user per leaf, and with ``realize_opcount_threshold=0`` inductor
    stores a node with several users in a buffer: one scalar kernel computes it, the loops load
    it.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[Any, torch.fx.Node] = {}
        for node in list(graph.nodes):
            key = _scalar_key(node)
            if key is None:
                continue
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> str:
        return "benchmarks.step.ScalarCSE/1"


def _scalar_key(node: torch.fx.Node) -> Any:
    """A hashable key for a pure, deterministic op with a one-element tensor result, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return None
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None

    def frozen(arg: Any) -> Any:
        if isinstance(arg, list | tuple):
            return tuple(frozen(a) for a in arg)
        return (type(arg), arg)  # 1 and 1.0 (and True) hash alike but are different arguments

    key = (target, frozen(node.args), tuple(sorted((k, frozen(v)) for k, v in node.kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


COMPILE_OPTIONS = {"post_grad_custom_pre_pass": ScalarCSE(), "realize_opcount_threshold": 0}
"""Inductor options of the compiled step: step-count scalars computed once (:class:`ScalarCSE`)."""


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


def make_pure_step(donate: bool, compile_grads: bool = False) -> Callable:
    """``(params, state, batch) -> (params, state, loss)``: value_and_grad, then AdamW.

    ``compile_grads`` puts the forward pass through ``torch.compile`` (AOTAutograd compiles
    its backward) and keeps the update eager, as ``minitrain run --compile`` does.
    """
    opt = mt.optim.adamw(**ADAMW)
    loss = torch.compile(cruncher_loss) if compile_grads else cruncher_loss
    loss_and_grads = mt.value_and_grad(loss)

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


def make_compiled_step() -> Callable:
    """``(params, state, batch, out) -> loss`` under ``torch.compile``: value_and_grad, then
    AdamW, the new params and state copied into the ``(params, state)``-shaped ``out``.

    The copies are inductor's to place: it writes each result directly into its ``out`` buffer.
    ``out`` may be the inputs themselves (donation) or any other buffers of the same layout.
    """
    opt = mt.optim.adamw(**ADAMW)
    loss_and_grads = mt.value_and_grad(cruncher_loss)

    def step(params, state, batch, out):
        loss, grads = loss_and_grads(params, batch)
        new = opt.update(grads, state, params)
        for buffer, value in zip(mt.tree.leaves(out), mt.tree.leaves(new), strict=True):
            buffer.copy_(value)
        return loss

    return torch.compile(step, options=COMPILE_OPTIONS)


class CompiledStepper:
    """Calls a compiled step and carries params and state: with ``donate``, the step writes
    them in place; without, into the buffers of the step before last, which a training loop
    has dropped by then (the step never writes its inputs)."""

    def __init__(self, params: dict, batch: tuple, donate: bool):
        self.step = make_compiled_step()
        self.params = mt.tree.map(torch.clone, params)
        self.state = mt.optim.adamw(**ADAMW).init(self.params)
        self.spare = None if donate else mt.tree.map(torch.empty_like, (self.params, self.state))
        self.batch = batch

    def __call__(self) -> None:
        out = (self.params, self.state) if self.spare is None else self.spare
        self.step(self.params, self.state, self.batch, out)
        if self.spare is not None:
            self.spare = (self.params, self.state)
        self.params, self.state = out


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
        start = time.perf_counter()
        for name, donate in (("minitrain_compiled", False), ("minitrain_compiled_donate", True)):
            steppers[name] = CompiledStepper(params, data, donate)
            steppers[name]()
        steppers["minitrain_run_compile"] = PureStepper(
            make_pure_step(donate=True, compile_grads=True), params, data
        )
        steppers["minitrain_run_compile"]()
        compile_seconds = time.perf_counter() - start
    seconds = time_interleaved(steppers, rounds, inner, device)
    peer = seconds["module_fused_adamw"]
    return {
        "device": device,
        "model": f"Cruncher dim {dim}, {num_layers} layers, batch {batch}, fp32",
        "seconds": seconds,
        "ratio_to_peer": {name: value / peer for name, value in seconds.items()},
        "compile_seconds": compile_seconds,
    }


# Sizes of each model when the flag is not given: the Cruncher of the chapter (3.5.2) and
# bytelm's GPT at the size of _gpt_step.DEFAULT.
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
@page("step", "Train step against nn.Module + torch.optim (Cruncher, or nanoGPT's GPT)")
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
        from _gpt_step import gpt_step_ratios

        if sizes["dim"] % heads:
            raise UserError(f"--dim {sizes['dim']} must be a multiple of --heads {heads}")
        config = {"d_model": sizes["dim"], "n_layers": sizes["num_layers"], "n_heads": heads,
                  "seq_len": seq_len, "batch_size": sizes["batch"]}
        result = gpt_step_ratios(config, rounds, inner, compile=with_compile, fp8=with_fp8)
    else:
        result = measure(sizes["dim"], sizes["num_layers"], sizes["batch"], rounds, inner,
                         device, with_compile)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif model == "gpt":
        _print_gpt(result, rounds, inner)
    else:
        _print_cruncher(result, device, rounds, inner)


if __name__ == "__main__":
    main(step)
