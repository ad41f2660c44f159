"""``python benchmarks/optim.py``: mt.optim updates against ``torch.optim``, side by side.

Every optimizer updates 8 fp32 params of 1024×1024 with fixed random grads. The rows are the
registry ``OPTIMIZERS`` (add one with :func:`register`); ``CHAINS`` holds chains of
transformations built by hand, each timed against an aliased row's peer (the hand-built
clip + Adam + weight decay + schedule chain against fused AdamW, target 1.5x), pure and donated
as the aliases are, and against what torch runs for the same chain (``clip_grad_norm_``, the
fused step, an ``LRScheduler``).
Per optimizer, one process times, round by round interleaved (so all see the same machine
load): ``torch.optim`` with ``fused=True`` (the peer; ``foreach=True`` for RMSprop, which has
no fused kernel) and with ``foreach=True``, and minitrain's update without donation
(``params, state = opt.update(grads, state, params)``, the previous params freed each step as in
a training loop) and with ``donate=True``. Ratios are best-round time over the peer's, and
beside them the median over rounds of the two sides' ratio in the same round (the peer and
minitrain run back to back, so the load of that moment cancels).

``--breakdown`` splits one pure AdamW update into its parts: the in-place fused kernel; the
streaming C kernel's call alone (``kernels.streaming.run``), one out-of-place pass into two sets of
buffers used in turn, with plain stores and with streaming stores (the read for ownership of every
output line, and what skipping it saves); copies of params and state into fresh memory and aten's
out-of-place kernel (allocation); Python overhead (the same update on 8 scalars); the whole pure
update; and page faults per step (``getrusage`` minor faults). ``--family`` adds the rest of the
family against their references (:mod:`_optim_family`); ``--processes N`` repeats the whole
measurement in N fresh processes and gives each figure's median across them
(:func:`_timing.summarize`).
"""

from __future__ import annotations

import json
import resource
from collections.abc import Callable
from typing import Any

import click
import torch
from _optim_family import FAMILY, family_ratios
from _pages import page
from _timing import (
    across_processes,
    best_rounds,
    cache_flusher,
    child_options,
    main,
    paired,
    paired_median_ratio,
    paired_ratio_interval,
    time_interleaved,
    time_rounds,
)

import minitrain as mt
from minitrain import _torch
from minitrain.errors import UserError
from minitrain.optim.kernels import pool, streaming
from minitrain.optim.kernels.checks import pointers

# The registry of rows: name -> (minitrain factory, torch.optim class, kwargs shared by both,
# the peer's fast flag: "fused" or "foreach"). The factory takes the kwargs; more
# optimizers join with ``register(name, factory, cls, kwargs, flag)``.
OPTIMIZERS: dict[str, tuple[Callable[..., Any], type, dict[str, Any], str]] = {
    "adamw": (mt.optim.adamw, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-2), "fused"),
    "adam": (mt.optim.adam, torch.optim.Adam, dict(lr=1e-3), "fused"),
    "sgd_momentum": (mt.optim.sgd, torch.optim.SGD, dict(lr=1e-2, momentum=0.9), "fused"),
    "adagrad": (mt.optim.adagrad, torch.optim.Adagrad, dict(lr=1e-2), "fused"),
    "rmsprop": (mt.optim.rmsprop, torch.optim.RMSprop, dict(lr=1e-2), "foreach"),
}


def register(name: str, factory: Callable[..., Any], cls: type, kwargs: dict[str, Any],
             flag: str) -> None:
    """Add a row: ``factory(**kwargs)`` against ``cls(params, **kwargs, **{flag: True})``.

    >>> register("sgd_plain", mt.optim.sgd, torch.optim.SGD, dict(lr=0.1), "fused")
    >>> "sgd_plain" in OPTIMIZERS
    True
    >>> del OPTIMIZERS["sgd_plain"]
    """
    if flag not in ("fused", "foreach"):
        raise ValueError(f"invalid flag={flag!r}: use 'fused' or 'foreach'")
    OPTIMIZERS[name] = (factory, cls, dict(kwargs), flag)


def hand_built_schedule(lr: float = 1e-3) -> Callable[[int], float]:
    """The hand-built chain's lr schedule: cosine over 10,000 updates after 10 of warmup."""
    return mt.optim.cosine_schedule(lr, decay_steps=10_000, warmup_steps=10)


def hand_built_adamw(lr: float = 1e-3, weight_decay: float = 1e-2,
                     max_norm: float = 1.0) -> mt.optim.Optimizer:
    """A chain built by hand: clip by global norm, Adam, decoupled weight decay, cosine schedule.

    >>> opt = hand_built_adamw()
    >>> [mt.optim.spec(tx)[0] for tx in mt.optim.spec(opt.update.transformation)[1]["transforms"]]
    ['clip_by_global_norm', 'scale_by_adam', 'add_decayed_weights', 'scale_by_learning_rate']
    """
    schedule = hand_built_schedule(lr)
    return mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.clip_by_global_norm(max_norm), mt.optim.scale_by_adam(),
        mt.optim.add_decayed_weights(weight_decay), mt.optim.scale_by_learning_rate(schedule),
    ))


ALIAS_TARGETS = {"pure": 1.35, "donate": 1.05}
"""The aliases' targets over their torch peer (fused, or foreach for RMSprop): the most a pure
and a donated update may take, as ratios."""

# Chains of transformations timed against an aliased row's torch peer:
# name -> (factory, the OPTIMIZERS row whose peer it is held to, target ratio).
CHAINS: dict[str, tuple[Callable[..., Any], str, float]] = {
    "chain_clip_adam_decay_schedule": (hand_built_adamw, "adamw", 1.5),
}


def make_params(count: int, shape: tuple[int, ...], device: str, seed: int = 0) -> list:
    """``count`` random fp32 tensors of ``shape`` (a list pytree)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device) for _ in range(count)]


class TorchStepper:
    """``torch.optim.<cls>(..., **flag)``: one ``step()`` per call, grads set once."""

    def __init__(self, cls: type, kwargs: dict, flag: str, params: list, grads: list):
        self.params = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.clone()
        self.optimizer = cls(self.params, **kwargs, **{flag: True})

    def __call__(self) -> None:
        self.optimizer.step()


class TorchClipStepper(TorchStepper):
    """What a torch user runs for a clip + AdamW + schedule chain: ``clip_grad_norm_`` (foreach),
    the fused ``step()``, then an ``LRScheduler``'s ``step()`` following ``schedule``."""

    def __init__(self, cls: type, kwargs: dict, flag: str, params: list, grads: list,
                 max_norm: float, schedule: Callable[[int], float]):
        super().__init__(cls, kwargs, flag, params, grads)
        self.max_norm = max_norm
        base_lr = kwargs.get("lr", 1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: float(schedule(step)) / base_lr)

    def __call__(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()


class MinitrainStepper:
    """``params, state = opt.update(grads, state, params[, donate=True])`` per call."""

    def __init__(self, factory: Callable, kwargs: dict, params: list, grads: list,
                 donate: bool):
        self.opt = factory(**kwargs)
        self.params = [p.clone() for p in params]
        self.state = self.opt.init(self.params)
        self.grads = grads
        self.donate = donate

    def __call__(self) -> None:
        self.params, self.state = self.opt.update(
            self.grads, self.state, self.params, donate=self.donate
        )


def measure(
    names: list[str], count: int = 8, size: int = 1024, rounds: int = 15, inner: int = 5,
    device: str = "cpu", cold: bool = False,
) -> dict[str, Any]:
    """Seconds per update and ratios to the peer for each optimizer in ``names``; ``cold``
    flushes the last-level cache before every update (:func:`cache_flusher`)."""
    flush = cache_flusher() if cold else None
    params = make_params(count, (size, size), device)
    grads = make_params(count, (size, size), device, seed=1)
    results = {}
    for name in names:
        factory, cls, kwargs, flag = OPTIMIZERS[name]
        steppers = {
            f"torch_{flag}": TorchStepper(cls, kwargs, flag, params, grads),
            "minitrain_pure": MinitrainStepper(factory, kwargs, params, grads, donate=False),
            "minitrain_donate": MinitrainStepper(factory, kwargs, params, grads, donate=True),
        }
        if flag != "foreach":
            steppers["torch_foreach"] = TorchStepper(cls, kwargs, "foreach", params, grads)
        times = time_rounds(steppers, rounds, inner, device, flush)
        seconds = best_rounds(times)
        peer = seconds[f"torch_{flag}"]
        results[name] = {
            "peer": f"torch_{flag}",
            "targets": dict(ALIAS_TARGETS),
            "seconds": seconds,
            "pure_over_peer": seconds["minitrain_pure"] / peer,
            "donate_over_peer": seconds["minitrain_donate"] / peer,
            "paired_median_ratios": {
                side: paired_median_ratio(times, f"minitrain_{side}", f"torch_{flag}")
                for side in ("pure", "donate")
            },
            "paired_intervals": {
                side: paired_ratio_interval(times, f"minitrain_{side}", f"torch_{flag}")
                for side in ("pure", "donate")
            },
        }
        del steppers
    return {"device": device, "params": f"{count} x {size}x{size} fp32", "results": results}


def measure_chains(names: list[str], count: int = 8, size: int = 1024, rounds: int = 15,
                   inner: int = 5, device: str = "cpu", cold: bool = False) -> dict[str, Any]:
    """Seconds per pure update of each chain in ``names`` and its ratio to its peer, timed
    interleaved with that peer (``cold``: as :func:`measure`)."""
    flush = cache_flusher() if cold else None
    params = make_params(count, (size, size), device)
    grads = make_params(count, (size, size), device, seed=1)
    results = {}
    for name in names:
        factory, row, target = CHAINS[name]
        _, cls, kwargs, flag = OPTIMIZERS[row]
        # The donated chain updates in place after the pure one, as the aliases' rows run: the
        # peer then starts each round after an in-place stepper's write-backs, as the pure
        # chain starts after the peer's (with the pure chain alone, which leaves no dirty
        # lines, only the chain paid for the other's write-backs).
        steppers = {
            f"torch_{flag}": TorchStepper(cls, kwargs, flag, params, grads),
            "minitrain_pure": MinitrainStepper(factory, {}, params, grads, donate=False),
            "minitrain_donate": MinitrainStepper(factory, {}, params, grads, donate=True),
            # Not the target's peer: what torch runs for the same chain, for the reader.
            f"torch_clip_{flag}": TorchClipStepper(cls, kwargs, flag, params, grads, 1.0,
                                                  hand_built_schedule(kwargs.get("lr", 1e-3))),
        }
        times = time_rounds(steppers, rounds, inner, device, flush)
        seconds = best_rounds(times)
        peer = seconds[f"torch_{flag}"]
        results[name] = {"peer": f"{row} torch_{flag}", "seconds": seconds,
                         "pure_over_torch_chain": paired_median_ratio(
                             times, "minitrain_pure", f"torch_clip_{flag}"),
                         "pure_over_peer": seconds["minitrain_pure"] / peer,
                         "donate_over_peer": seconds["minitrain_donate"] / peer,
                         "target": target,
                         "paired_median_ratio": paired_median_ratio(
                             times, "minitrain_pure", f"torch_{flag}"),
                         "paired_median_donate_ratio": paired_median_ratio(
                             times, "minitrain_donate", f"torch_{flag}"),
                         "paired_interval": paired_ratio_interval(
                             times, "minitrain_pure", f"torch_{flag}"),
                         "paired_donate_interval": paired_ratio_interval(
                             times, "minitrain_donate", f"torch_{flag}")}
        del steppers
    return {"device": device, "params": f"{count} x {size}x{size} fp32", "results": results}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


ADAMW_HP = [0.9, 0.999, 1e-8, 1e-2, 1e-3, 1e-3 / (1 - 0.9), (1 - 0.999) ** 0.5, True, False, 1.0]
"""AdamW's first update in ``_streaming.c``'s order: beta1, beta2, eps, weight decay, lr, lr over
the first moment's bias correction, the second's square root, decoupled, amsgrad, sign."""


def _one_pass_parts(params, grads, exp_avg, exp_avg_sq) -> dict[str, Callable[[], Any]]:
    """The streaming kernel's single out-of-place pass: as the pure update calls it (into this
    thread's pool, stores chosen by size), then with plain stores and with streaming stores into
    two sets of buffers used in turn (as the pool hands them out)."""
    rows = [params, grads, exp_avg, exp_avg_sq, None]
    found = pointers(rows, dtype=torch.float32)
    if found is None or not streaming.available():
        return {}
    hp, sizes = [float(v) for v in ADAMW_HP], [p.numel() for p in params]
    generations = [[[t.clone() for t in leaves] for leaves in (params, exp_avg, exp_avg_sq)]
                   for _ in range(2)]
    turn = [0]

    def one_pass(nontemporal: bool) -> None:
        source, target = generations[turn[0] % 2], generations[(turn[0] + 1) % 2]
        turn[0] += 1
        inputs = pointers([source[0], grads, source[1], source[2], None])
        streaming.launch(streaming.RULES["adam"][0], hp, [*inputs, *pointers([*target, None])],
                         sizes, nontemporal)

    def kernel_call() -> None:
        outputs = pool.current()
        outputs.begin_update()
        streaming.run("adam", hp, rows, found, outputs)

    return {
        "kernel_call_alone": kernel_call,
        "one_pass_plain_stores": lambda: one_pass(False),
        "one_pass_streaming_stores": lambda: one_pass(True),
    }


def breakdown(count: int = 8, size: int = 1024, rounds: int = 15, inner: int = 5) -> dict:
    """Where one pure AdamW update's time goes on CPU (see the module docstring)."""
    params = make_params(count, (size, size), "cpu")
    grads = make_params(count, (size, size), "cpu", seed=1)
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    steps = [torch.tensor(1.0)] * count
    kernel_kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8,
                         amsgrad=False, maximize=False)
    tiny = MinitrainStepper(mt.optim.adamw, {}, make_params(count, (1,), "cpu"),
                            make_params(count, (1,), "cpu", seed=1), donate=False)
    pure = MinitrainStepper(mt.optim.adamw, {}, params, grads, donate=False)
    parts = {
        "fused_kernel_in_place": lambda: _torch.fused_adamw_(
            params, grads, exp_avg, exp_avg_sq, [], steps, **kernel_kwargs
        ),
        **_one_pass_parts(params, grads, exp_avg, exp_avg_sq),
        "copies_of_params_and_state": lambda: [
            t.clone() for t in (*params, *exp_avg, *exp_avg_sq)
        ],
        "aten_out_of_place_fused": lambda: torch.ops.aten._fused_adamw.default(
            params, grads, exp_avg, exp_avg_sq, [], steps, **kernel_kwargs
        ),
        "python_overhead_8_scalars": tiny,
        "minitrain_pure_update": pure,
    }
    seconds = time_interleaved(parts, rounds, inner, "cpu")
    faults = {}
    for name, part in parts.items():
        before = _faults()
        for _ in range(inner):
            part()
        faults[name] = (_faults() - before) / inner
    return {"seconds": seconds, "minor_page_faults_per_call": faults}


@click.command()
@page("optim", "Optimizer updates against torch.optim's fused and foreach kernels")
@click.option("--optimizer", "names", multiple=True, type=click.Choice(list(OPTIMIZERS)),
              help="Optimizers to time (repeatable); default: all.")
@click.option("--count", type=click.IntRange(min=1), default=8, help="Number of params.")
@click.option("--size", type=click.IntRange(min=1), default=1024, help="Each param is size².")
@click.option("--rounds", type=click.IntRange(min=1), default=15, help="Interleaved rounds.")
@click.option("--inner", type=click.IntRange(min=1), default=5, help="Updates per round.")
@click.option("--device", default="cpu", help="cpu or cuda.")
@click.option("--breakdown", "with_breakdown", is_flag=True,
              help="Also split a pure AdamW update into kernel, copies, overhead, faults (CPU).")
@click.option("--chain", "chains", multiple=True, type=click.Choice(list(CHAINS)),
              help="Chains of transformations to time (repeatable); default: all.")
@click.option("--family", "with_family", is_flag=True,
              help="Also time the rest of the family (Adadelta ... Muon, Lion, schedule-free "
                   "AdamW) against their references' fastest path (CPU).")
@click.option("--member", "members", multiple=True, type=click.Choice(list(FAMILY)),
              help="With --family: members to time (repeatable); default: all.")
@click.option("--cold", is_flag=True,
              help="Flush the last-level cache before every timed update, as a training "
                   "loop's forward and backward pass do (CPU).")
@click.option("--budget", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="With --family: seconds a member's row may take; a slower one (Muon's "
                   "bfloat16 GEMMs on a CPU without native bfloat16) times fewer updates, "
                   "down to 6 rounds of 1.")
@click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the whole measurement in this many fresh processes, one after "
                   "another, and give each figure's median across them (with a 95% interval "
                   "from 6 on): where the allocator puts buffers differs between processes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def optim(names: tuple[str, ...], count: int, size: int, rounds: int, inner: int, device: str,
          with_breakdown: bool, chains: tuple[str, ...], with_family: bool,
          members: tuple[str, ...], cold: bool, budget: float, processes: int,
          as_json: bool) -> None:
    """mt.optim update time over torch.optim fused (foreach for RMSprop), pure and donated;
    chains built by hand over fused AdamW; with --family, every other optimizer's pure update
    over its reference (target <= 1.0x)."""
    if with_family and device != "cpu":
        raise UserError("--family times the CPU only; drop --family or use --device cpu")
    if cold and device != "cpu":
        raise UserError("--cold flushes the CPU's cache only; drop --cold or use --device cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda needs a CUDA GPU; none is available, use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"--device {device!r} is not supported; use cpu or cuda")
    if processes > 1:
        if with_breakdown:
            raise UserError("--breakdown is not summarized across processes; drop --breakdown "
                            "or --processes")
        context = click.get_current_context()
        options = child_options(context.command, context.params, NOT_FORWARDED)
        across_processes(__file__, options, processes, as_json, lambda first: (
            f"update of {first['params']} on {first['device']}"
            + (", the cache flushed before every update" if cold else "")))
        return
    result = measure(list(names or OPTIMIZERS), count, size, rounds, inner, device, cold)
    result["cold"] = cold
    if with_breakdown:
        result["breakdown"] = breakdown(count, size, rounds, inner)
    result["chains"] = measure_chains(list(chains or CHAINS), count, size, rounds, inner,
                                      device, cold)["results"]
    if with_family:
        result["family"] = family_ratios(list(members) or None, count, size, rounds, inner,
                                         cold, budget)["results"]
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"update of {result['params']} on {device} (best of {rounds} interleaved "
               f"rounds x {inner}; paired: median of the rounds' own ratios, with its "
               "distribution-free 95% interval"
               + ("; cold: the last-level cache flushed before every update)" if cold else ")"))
    for name, entry in result["results"].items():
        times = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in entry["seconds"].items())
        click.echo(f"  {name:13s} {times}")
        medians, intervals = entry["paired_median_ratios"], entry["paired_intervals"]
        ratios = f"pure / {entry['peer']}: {entry['pure_over_peer']:.2f}x "
        ratios += f"({paired(medians['pure'], intervals['pure'])})   "
        ratios += f"donate / {entry['peer']}: {entry['donate_over_peer']:.2f}x "
        ratios += f"({paired(medians['donate'], intervals['donate'])})"
        click.echo(f"  {'':13s} {ratios}")
    for name, entry in result["chains"].items():
        times = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in entry["seconds"].items())
        click.echo(f"  {name}  {times}")
        pure = paired(entry["paired_median_ratio"], entry["paired_interval"])
        donate = paired(entry["paired_median_donate_ratio"], entry["paired_donate_interval"])
        click.echo(f"  {'':13s} pure / {entry['peer']}: {entry['pure_over_peer']:.2f}x "
                   f"({pure}; target <= {entry['target']}x)   "
                   f"donate: {entry['donate_over_peer']:.2f}x ({donate})"
                   f"   pure / torch's clip_grad_norm_ + step: "
                   f"{entry['pure_over_torch_chain']:.2f}x (paired)")
    for name, entry in result.get("family", {}).items():
        if "skipped" in entry:
            click.echo(f"  {name:13s} skipped: {entry['skipped']}")
            continue
        times = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in entry["seconds"].items())
        click.echo(f"  {name:13s} {times}")
        ratios = (f"pure / {entry['reference']}: {entry['pure_over_reference']:.2f}x "
                  f"({paired(entry['paired_median_ratio'], entry['paired_interval'])}; "
                  f"target <= {entry['target']}x)")
        if (entry["rounds"], entry["inner"]) != (rounds, inner):
            ratios += (f"   ({entry['rounds']} rounds x {entry['inner']}: a slow update, "
                       "cut to --budget)")
        click.echo(f"  {'':13s} {ratios}")
    if with_breakdown:
        click.echo("pure AdamW update, by part:")
        parts = result["breakdown"]
        for name, seconds in parts["seconds"].items():
            faults = parts["minor_page_faults_per_call"][name]
            click.echo(f"  {name:28s} {seconds * 1e3:8.3f} ms  {faults:8.0f} page faults/call")


NOT_FORWARDED = {"processes", "as_json", "page"}  # the parent writes the page
"""Options a child process does not get: it runs once and prints JSON."""


if __name__ == "__main__":
    main(optim)
