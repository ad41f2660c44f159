"""``python benchmarks/research.py``: research patterns written with minitrain's public API
against the same patterns in plain ``torch.func`` and hand-written code, side by side.

Each row times a minitrain step and its peer on the same data from the same start, interleaved
round by round in one process (:func:`_timing.time_rounds`), and reports the median of the
per-round ratios minitrain / peer with its 95% interval:

* ``gpt`` (target <= 1.05): ``mt.models.gpt`` under ``mt.value_and_grad``, then
  ``mt.optim.adamw(...).update(..., donate=True)``; the peer runs the same forward on leaf
  tensors, ``loss.backward()`` and ``torch.optim.AdamW(fused=True)``. (``benchmarks/step.py
  --model gpt`` times bytelm's GPT against nanoGPT's ``nn.Module``.)
* ``maml`` (<= 1.05): examples/maml_sine.py's meta-step: ``vmap`` over tasks of
  ``mt.optim.unroll`` (SGD) on the support points, Adam on the query loss; the peer adapts with
  ``torch.func.grad`` and ``p - lr * g`` by hand, ``loss.backward()``, ``torch.optim.Adam``.
  ``maml run`` (no target) is the same pair with minitrain's step under ``torch.no_grad()``, as
  ``minitrain run`` takes each step: ``mt.value_and_grad`` then skips its walk of the graph for
  closed-over tensors that require grad (the grads stay differentiable through them in grad
  mode, as ``torch.func``'s do).
* ``dp-sgd`` (<= 1.10): ``mt.vmap(mt.value_and_grad(loss))`` per-example grads, then
  ``mt.optim.dpsgd`` (optax's ``contrib.dpsgd``: ``differentially_private_aggregate`` and SGD,
  noise from ``mt.random``'s Threefry); the peer clips by hand, draws ``torch.randn`` noise and
  updates in place. ``dp-sgd example`` (no target) is examples/dp_sgd.py's step as
  ``minitrain run`` takes it (the private gradient through the loss, the fraction clipped
  logged) against that peer.
* ``ensemble`` (<= 1.05): examples/ensemble.py's step (the members' grads through ``mt.vmap``,
  then Adam with ``scale_by_learning_rate(lrs)``, a learning rate per member over the stacked
  leaves); the peer vmaps ``torch.func.grad_and_value`` of ``functional_call`` and runs Adam
  with per-member learning rates by hand, in place.
* ``per-example norm`` (no target): ``mt.tree.per_example_global_norm`` against
  ``mt.vmap(mt.tree.global_norm)`` on the ensemble's per-example grads.

``--processes N`` repeats the whole measurement in N fresh processes and gives each row's median
across them, with how many processes were over its target (:func:`_timing.summarize`): two
processes can disagree by more than one process's interval.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
import torch.nn.functional as F
from _pages import page
from _timing import (
    across_processes,
    child_options,
    main,
    paired,
    paired_median_ratio,
    paired_ratio_interval,
    time_rounds,
)
from torch import nn

import minitrain as mt

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TARGETS = {"gpt": 1.05, "maml": 1.05, "maml run": None, "dp-sgd": 1.10, "dp-sgd example": None,
           "ensemble": 1.05, "per-example norm": None}
SIZES = {
    "default": {"dim": 128, "layers": 4, "seq": 64, "batch": 16, "tasks": 25, "inner_steps": 1,
                "dp_batch": 64, "members": 8, "points": 256},
    "tiny": {"dim": 32, "layers": 1, "seq": 8, "batch": 2, "tasks": 2, "inner_steps": 1,
             "dp_batch": 4, "members": 2, "points": 8},
}
Steppers = dict[str, Callable[[], Any]]  # "minitrain", "peer"; "params": both sides' leaves


def load_example(name: str) -> Any:
    """examples/<name>.py as a module (registered by name, as torch.compile looks it up)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _leaf_copies(tree: Any) -> Any:
    return mt.tree.map(lambda t: t.detach().clone().requires_grad_(), tree)


def gpt_steppers(size: dict) -> Steppers:
    config = mt.models.GPTConfig(vocab_size=256, block_size=size["seq"], n_layer=size["layers"],
                                 n_head=4, n_embd=size["dim"], bias=False)
    ids = torch.randint(0, 256, (size["batch"], size["seq"] + 1),
                        generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    start = mt.models.gpt_init(mt.random.key(0), config)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}

    def loss(params: dict) -> torch.Tensor:
        return mt.losses.cross_entropy(mt.models.gpt(params, x, config=config), y)

    opt, grads_of = mt.optim.adamw(**hyper), mt.value_and_grad(loss)
    ours = {"params": mt.tree.map(torch.clone, start)}
    ours["state"] = opt.init(ours["params"])

    def minitrain_step() -> None:
        _, grads = grads_of(ours["params"])
        ours["params"], ours["state"] = opt.update(grads, ours["state"], ours["params"],
                                                   donate=True)

    peer = _leaf_copies(start)
    torch_opt = torch.optim.AdamW(mt.tree.leaves(peer), fused=True, **hyper)

    def peer_step() -> None:
        loss(peer).backward()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)

    return {"minitrain": minitrain_step, "peer": peer_step,
            "params": lambda: (mt.tree.leaves(ours["params"]), mt.tree.leaves(peer))}


def maml_steppers(size: dict) -> Steppers:
    maml = load_example("maml_sine")
    config = {**maml.CONFIG, "tasks": size["tasks"], "inner_steps": size["inner_steps"]}
    generator = torch.Generator().manual_seed(0)
    experiment = maml.experiment(config)
    start, tasks = experiment.init(generator), experiment.next_batch(generator)
    net = nn.Sequential(nn.Linear(1, config["hidden"]), nn.ReLU(),
                        nn.Linear(config["hidden"], config["hidden"]), nn.ReLU(),
                        nn.Linear(config["hidden"], 1))
    _, apply = mt.from_module(net)
    inner, steps, inner_lr = mt.optim.sgd(lr=config["inner_lr"]), config["inner_steps"], \
        config["inner_lr"]

    def mse(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((apply(params, x) - y) ** 2).mean()

    def task_loss(params: dict, task: dict) -> torch.Tensor:
        support = [(task["x_support"], task["y_support"])] * steps
        adapted = mt.optim.unroll(inner, lambda p, b: mse(p, *b), params, support).params
        return mse(adapted, task["x_query"], task["y_query"])

    def meta_loss(params: dict, tasks: dict) -> torch.Tensor:
        return mt.vmap(task_loss, in_dims=(None, 0))(params, tasks).mean()

    opt, grads_of = mt.optim.adam(lr=config["lr"]), mt.value_and_grad(meta_loss)
    ours = {"params": mt.tree.map(torch.clone, start)}
    ours["state"] = opt.init(ours["params"])

    def minitrain_step() -> None:
        _, grads = grads_of(ours["params"], tasks)
        ours["params"], ours["state"] = opt.update(grads, ours["state"], ours["params"],
                                                   donate=True)

    def peer_task_loss(params: dict, task: dict) -> torch.Tensor:
        for _ in range(steps):
            grads = torch.func.grad(mse)(params, task["x_support"], task["y_support"])
            params = {k: params[k] - inner_lr * grads[k] for k in params}
        return mse(params, task["x_query"], task["y_query"])

    peer = _leaf_copies(start)
    torch_opt = torch.optim.Adam(peer.values(), lr=config["lr"], fused=True)

    def peer_step() -> None:
        torch.func.vmap(peer_task_loss, in_dims=(None, 0))(peer, tasks).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)

    return {"minitrain": minitrain_step, "peer": peer_step,
            "params": lambda: (mt.tree.leaves(ours["params"]), mt.tree.leaves(peer))}


def maml_run_steppers(size: dict) -> Steppers:
    """:func:`maml_steppers` with minitrain's step under ``torch.no_grad()``, as ``minitrain
    run`` takes it."""
    steppers = maml_steppers(size)
    step = steppers["minitrain"]

    def under_no_grad() -> None:
        with torch.no_grad():
            step()

    return {**steppers, "minitrain": under_no_grad}


def dp_sgd_steppers(size: dict, noise: bool = True) -> tuple[Steppers, Steppers]:
    dp = load_example("dp_sgd")
    config = {**dp.CONFIG, "batch_size": size["dp_batch"]}
    if not noise:
        config["noise_multiplier"] = 0.0
    experiment = dp.experiment(config)
    generator = torch.Generator().manual_seed(0)
    start, batch = experiment.init(generator), experiment.next_batch(generator)
    clip, sigma, lr = config["clip"], config["noise_multiplier"], config["lr"]
    per_example = mt.vmap(mt.value_and_grad(dp.example_loss), in_dims=(None, 0, 0))
    opt = mt.optim.dpsgd(lr, clip, sigma, key=0)
    ours = {"params": mt.tree.map(torch.clone, start)}
    ours["state"] = opt.init(ours["params"])

    def minitrain_step() -> None:
        _, grads = per_example(ours["params"], *batch)
        ours["params"], ours["state"] = opt.update(grads, ours["state"], ours["params"])

    example = {"params": mt.tree.map(torch.clone, start), "step": 0}
    sgd, grads_of = experiment.optimizer, mt.value_and_grad(experiment.loss, has_aux=True)
    example["state"] = sgd.init(example["params"])

    def example_step() -> None:  # under no_grad, as minitrain run takes each step
        example["step"] += 1
        key = mt.random.fold_in(mt.random.key(0), example["step"])
        with torch.no_grad():
            _, grads = grads_of(example["params"], batch, key=key)
            example["params"], example["state"] = sgd.update(grads, example["state"],
                                                             example["params"], donate=True)

    peer = [{k: t.clone() for k, t in layer.items()} for layer in start]
    generator = torch.Generator().manual_seed(0)

    def peer_loss(params: list, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(F.linear(x, params[0]["weight"], params[0]["bias"]))
        return F.cross_entropy(F.linear(hidden, params[1]["weight"], params[1]["bias"]), y)

    peer_grads = torch.func.vmap(torch.func.grad_and_value(peer_loss), in_dims=(None, 0, 0))

    def peer_step() -> None:
        grads, _ = peer_grads(peer, *batch)
        flat = [g for layer in grads for g in layer.values()]
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in flat]).norm(dim=0)
        scale = (clip / norms).clamp(max=1.0)
        for p, g in zip([p for layer in peer for p in layer.values()], flat, strict=True):
            summed = torch.tensordot(scale, g, dims=1)
            summed += sigma * clip * torch.randn(p.shape, generator=generator)
            p.sub_(summed, alpha=lr / len(scale))

    def params_of(side: dict) -> Callable[[], tuple[list, list]]:
        return lambda: (mt.tree.leaves(side["params"]), mt.tree.leaves(peer))

    return ({"minitrain": minitrain_step, "peer": peer_step, "params": params_of(ours)},
            {"minitrain": example_step, "peer": peer_step, "params": params_of(example)})


def ensemble_steppers(size: dict) -> Steppers:
    ensemble = load_example("ensemble")
    members, hidden = size["members"], ensemble.HIDDEN
    lrs = torch.logspace(-3, -1, members)
    keys = mt.random.split(mt.random.key(0), members)
    start = mt.tree.stack([ensemble.init(k) for k in keys])
    x, y = ensemble.data(size["points"], seed=0)
    ours = {"params": mt.tree.map(torch.clone, start)}
    adam = ensemble.adam_per_member(lrs)
    ours["state"], step = adam.init(ours["params"]), ensemble.make_ensemble_step(adam)

    def minitrain_step() -> None:
        ours["params"], ours["state"], _ = step(ours["params"], ours["state"], x, y)

    base = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 1))
    peer = {f"{2 * i}.{name}": t.clone() for i, layer in enumerate(start)
            for name, t in layer.items()}
    moments = {k: (torch.zeros_like(t), torch.zeros_like(t)) for k, t in peer.items()}
    count = [0]

    def peer_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(base, params, (x,)).squeeze(-1), y)

    peer_grads = torch.func.vmap(torch.func.grad_and_value(peer_loss), in_dims=(0, None, None))

    def peer_step() -> None:  # Adam (Kingma & Ba 2015, Algorithm 1), one lr per member
        grads, _ = peer_grads(peer, x, y)
        count[0] += 1
        c1, c2 = 1 - 0.9 ** count[0], 1 - 0.999 ** count[0]
        for name, p in peer.items():
            m, v = moments[name]
            m.lerp_(grads[name], 0.1)
            v.mul_(0.999).addcmul_(grads[name], grads[name], value=0.001)
            step = lrs.view(-1, *[1] * (p.dim() - 1)) / c1
            p.sub_(step * m / ((v / c2).sqrt_().add_(1e-8)))

    return {"minitrain": minitrain_step, "peer": peer_step,
            "params": lambda: (mt.tree.leaves(ours["params"]), list(peer.values()))}


def norm_steppers(size: dict) -> Steppers:
    ensemble = load_example("ensemble")
    x, y = ensemble.data(size["points"], seed=0)
    params = ensemble.init(mt.random.key(0))
    grads = mt.vmap(mt.grad(ensemble.loss), in_dims=(None, 0, 0))(params, x[:, None], y[:, None])
    vmapped = mt.vmap(mt.tree.global_norm)
    return {"minitrain": lambda: mt.tree.per_example_global_norm(grads),
            "peer": lambda: vmapped(grads)}


def check_same_updates(size: dict) -> None:
    """Each pair takes the same first step from the same start (DP-SGD without noise), or
    this raises: a ratio between two steps that compute different things means nothing."""
    pairs = {row: builder(size) for row, builder in
             (("gpt", gpt_steppers), ("maml", maml_steppers), ("maml run", maml_run_steppers),
              ("ensemble", ensemble_steppers))}
    pairs["dp-sgd"] = dp_sgd_steppers(size, noise=False)[0]  # each pair its own peer
    pairs["dp-sgd example"] = dp_sgd_steppers(size, noise=False)[1]
    for row, steppers in pairs.items():
        steppers["minitrain"](), steppers["peer"]()
        ours, peer = steppers["params"]()
        for a, b in zip(ours, peer, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, row=row: f"{row}: {m}")
    norms = norm_steppers(size)
    torch.testing.assert_close(norms["minitrain"](), norms["peer"]())


def measure(size: dict, rounds: int, inner: int, rows: list[str]) -> dict[str, Any]:
    """Per row: best-round milliseconds of each side, the paired median ratio and interval."""
    builders = {"gpt": gpt_steppers, "maml": maml_steppers, "maml run": maml_run_steppers,
                "ensemble": ensemble_steppers, "per-example norm": norm_steppers}
    results = {}
    for row in rows:
        if row in ("dp-sgd", "dp-sgd example"):
            chain, example = dp_sgd_steppers(size)
            steppers = chain if row == "dp-sgd" else example
        else:
            steppers = builders[row](size)
        times = time_rounds({side: steppers[side] for side in ("minitrain", "peer")}, rounds,
                            inner, "cpu")
        results[row] = {
            "ms": {side: 1e3 * min(values) for side, values in times.items()},
            "paired_median_ratio": paired_median_ratio(times, "minitrain", "peer"),
            "interval": paired_ratio_interval(times, "minitrain", "peer"),
            "target": TARGETS[row],
        }
    return results


@click.command()
@page("research", "Research patterns: minitrain against plain torch.func and hand-written steps")
@click.option("--size", type=click.Choice(sorted(SIZES)), default="default", show_default=True,
              help="tiny: a smoke run of every row in seconds.")
@click.option("--rows", "rows", multiple=True, type=click.Choice(list(TARGETS)),
              help="Rows to time (repeatable; default all).")
@click.option("--rounds", type=click.IntRange(min=1), default=11, show_default=True,
              help="Interleaved rounds.")
@click.option("--inner", type=click.IntRange(min=1), default=3, show_default=True,
              help="Steps per round.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch intra-op threads (default: torch's).")
@click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the whole measurement in this many fresh processes, one after "
                   "another, and give each row's median across them.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def research(size: str, rows: tuple[str, ...], rounds: int, inner: int, threads: int | None,
             processes: int, as_json: bool) -> None:
    """Research patterns (GPT, MAML, DP-SGD, ensemble) against plain torch.func."""
    if processes > 1:
        context = click.get_current_context()
        across_processes(__file__, child_options(context.command, context.params, NOT_FORWARDED),
                         processes, as_json, lambda first: (
                             f"minitrain / plain torch.func, {first['rounds']} rounds x "
                             f"{first['inner']} steps, {first['threads']} threads"))
        return
    if threads is not None:
        torch.set_num_threads(threads)
    check_same_updates(SIZES[size])
    result = {"size": SIZES[size], "threads": torch.get_num_threads(), "rounds": rounds,
              "inner": inner, "rows": measure(SIZES[size], rounds, inner, list(rows or TARGETS))}
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"minitrain / plain torch.func, {rounds} rounds x {inner} steps, "
               f"{result['threads']} threads")
    for row, entry in result["rows"].items():
        target = "" if entry["target"] is None else f"  target <= {entry['target']}x"
        ms = entry["ms"]
        click.echo(f"  {row:17s} {ms['minitrain']:8.2f} ms vs {ms['peer']:8.2f} ms  "
                   f"{paired(entry['paired_median_ratio'], entry['interval'])}{target}")


NOT_FORWARDED = {"processes", "as_json", "page"}  # the parent writes the page


if __name__ == "__main__":
    main(research)
