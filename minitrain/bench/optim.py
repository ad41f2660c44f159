"""``minitrain bench optim``: mt.optim updates against ``torch.optim``, side by side.

Every optimizer updates 8 fp32 params of 1024×1024 with fixed random grads. The rows are the
registry ``OPTIMIZERS`` (add one with :func:`register`); ``CHAINS`` holds chains of
transformations built by hand, each timed against an aliased row's peer (the hand-built
clip + Adam + weight decay + schedule chain against fused AdamW, target 1.5x), pure and donated
as the aliases are, and against what torch runs for the same chain (``clip_grad_norm_``, the
fused step, an ``LRScheduler``). The command line is ``minitrain bench optim``
(``minitrain.cli.bench_optim``).
Per optimizer, one process times, round by round interleaved (so all see the same machine
load): ``torch.optim`` with ``fused=True`` (the peer; ``foreach=True`` for RMSprop, which has
no fused kernel) and with ``foreach=True``, and minitrain's fast path without donation
(``params, state = opt.update(grads, state, params)``, the previous params freed each step as in
a training loop) and with ``donate=True``. Ratios are best-round time over the peer's, and
beside them the median over rounds of the two sides' ratio in the same round (the peer and
minitrain run back to back, so the load of that moment cancels).

``--compiled`` adds the pure update with ``impl="compiled"`` (one inductor-generated graph
over all leaves, one pass into recycled buffers). ``--breakdown`` splits one pure AdamW update
into its parts: the in-place fused kernel; one out-of-place pass with plain stores and with
streaming stores (the read for ownership of every output line, and what skipping it saves);
copies of params and state into fresh memory and aten's out-of-place kernel (allocation);
Python overhead (the same update on 8 scalars); and page faults per step (``getrusage`` minor
faults).
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import minitrain as mt
from minitrain.optim.kernels import streaming

# The registry of rows: name -> (minitrain factory, torch.optim class, kwargs shared by both,
# the peer's fast flag: "fused" or "foreach"). The factory takes the kwargs and ``impl``; more
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
    """Add a row: ``factory(**kwargs, impl=...)`` against ``cls(params, **kwargs, **{flag: True})``.

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


def hand_built_adamw(lr: float = 1e-3, weight_decay: float = 1e-2, max_norm: float = 1.0,
                     impl: str = "auto") -> mt.optim.Optimizer:
    """A chain built by hand: clip by global norm, Adam, decoupled weight decay, cosine schedule.

    >>> opt = hand_built_adamw()
    >>> [mt.optim.spec(tx)[0] for tx in mt.optim.spec(opt.update.transformation)[1]["transforms"]]
    ['clip_by_global_norm', 'scale_by_adam', 'add_decayed_weights', 'scale_by_learning_rate']
    """
    del impl  # the chain chooses its path itself
    schedule = hand_built_schedule(lr)
    return mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.clip_by_global_norm(max_norm), mt.optim.scale_by_adam(),
        mt.optim.add_decayed_weights(weight_decay), mt.optim.scale_by_learning_rate(schedule),
    ))


ALIAS_TARGETS = {"pure": 1.35, "donate": 1.05}
"""The aliases' targets over their torch peer (fused, or foreach for RMSprop): the most a pure
and a donated update may take, as ratios."""

# Chains of transformations timed against an aliased row's torch peer:
# name -> (factory taking ``impl``, the OPTIMIZERS row whose peer it is held to, target ratio).
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

    def __init__(self, factory: Callable, kwargs: dict, params: list, grads: list, donate: bool,
                 impl: str = "auto"):
        self.opt = factory(**kwargs, impl=impl)
        self.params = [p.clone() for p in params]
        self.state = self.opt.init(self.params)
        self.grads = grads
        self.donate = donate

    def __call__(self) -> None:
        self.params, self.state = self.opt.update(
            self.grads, self.state, self.params, donate=self.donate
        )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_rounds(
    steppers: dict[str, Callable[[], None]], rounds: int, inner: int, device: str,
    before_call: Callable[[], None] | None = None, warmup: int = 3,
) -> dict[str, list[float]]:
    """Each round's seconds per call of each stepper, over ``rounds`` interleaved rounds (in a
    round the steppers run one after another, in order), after ``warmup`` untimed calls of
    each. ``before_call`` (e.g. :func:`cache_flusher`) runs untimed before every timed call.

    >>> flushes = []
    >>> times = time_rounds({"a": lambda: None}, 2, 3, "cpu", lambda: flushes.append(1))
    >>> len(times["a"]), len(flushes)
    (2, 6)
    """
    for stepper in steppers.values():  # warm-up: first-step branches, allocator, caches
        for _ in range(warmup):
            stepper()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, stepper in steppers.items():
            if before_call is None:
                _sync(device)
                start = time.perf_counter()
                for _ in range(inner):
                    stepper()
                _sync(device)
                times[name].append((time.perf_counter() - start) / inner)
                continue
            total = 0.0
            for _ in range(inner):
                before_call()
                _sync(device)
                start = time.perf_counter()
                stepper()
                _sync(device)
                total += time.perf_counter() - start
            times[name].append(total / inner)
    return times


def last_level_cache_bytes() -> int:
    """This CPU's last-level cache, from Linux's sysfs; 512 MiB where it cannot be read.

    >>> last_level_cache_bytes() > 0
    True
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=512 * 2**20)


def cache_flusher() -> Callable[[], None]:
    """A function that writes twice the last-level cache's bytes: what a forward and backward
    pass do to the optimizer's buffers between two updates of a model larger than the cache
    (``--cold``). Without it, an in-place peer keeps its params and state in cache from one
    timed update to the next, which no training loop does.
    """
    buffer = torch.empty(2 * last_level_cache_bytes() // 4)
    value = [0.0]

    def flush() -> None:
        value[0] = 1.0 - value[0]
        buffer.fill_(value[0])

    return flush


def time_interleaved(
    steppers: dict[str, Callable[[], None]], rounds: int, inner: int, device: str
) -> dict[str, float]:
    """Fastest round's seconds per call of each stepper over ``rounds`` interleaved rounds.

    The minimum, not the median: on a machine shared with other jobs, the fastest round is the
    one least disturbed by them, and it is disturbed the same way for every stepper.
    """
    return best_rounds(time_rounds(steppers, rounds, inner, device))


def best_rounds(times: dict[str, list[float]]) -> dict[str, float]:
    """Each stepper's fastest round (see :func:`time_interleaved`).

    >>> best_rounds({"a": [2.0, 1.0]})
    {'a': 1.0}
    """
    return {name: min(values) for name, values in times.items()}


def paired_median_ratio(times: dict[str, list[float]], name: str, peer: str) -> float:
    """The median over rounds of ``name``'s time over ``peer``'s in the same round: two
    steppers run back to back share the load of that moment, which the ratio cancels.

    >>> paired_median_ratio({"a": [2.0, 9.0, 3.0], "b": [1.0, 9.0, 2.0]}, "a", "b")
    1.5
    """
    return statistics.median(a / b for a, b in zip(times[name], times[peer], strict=True))


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free ``confidence`` interval for the median of what ``values`` sample: the
    ``k``-th smallest and ``k``-th largest value, ``k`` the largest with P(Binomial(n, 1/2) < k)
    <= (1 - confidence) / 2 (the sign test's interval: Conover, *Practical Nonparametric
    Statistics*, 3rd ed., 3.2). None when ``n`` is too small for any (under 6 at 95%).

    >>> median_interval([float(v) for v in range(1, 16)])  # n = 15: the 4th and the 12th
    (4.0, 12.0)
    >>> median_interval([1.0, 2.0, 3.0]) is None
    True
    """
    n, tail = len(values), (1 - confidence) / 2
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k)
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def paired_ratio_interval(times: dict[str, list[float]], name: str,
                          peer: str) -> tuple[float, float] | None:
    """The 95% interval (:func:`median_interval`) of :func:`paired_median_ratio`'s median."""
    return median_interval([a / b for a, b in zip(times[name], times[peer], strict=True)])


def measure(
    names: list[str], count: int = 8, size: int = 1024, rounds: int = 15, inner: int = 5,
    device: str = "cpu", compiled: bool = False, cold: bool = False,
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
        if compiled:
            steppers["minitrain_compiled"] = MinitrainStepper(
                factory, kwargs, params, grads, donate=False, impl="compiled"
            )
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
        if compiled:
            results[name]["compiled_over_peer"] = seconds["minitrain_compiled"] / peer
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


def _one_pass_parts(params, grads, exp_avg, exp_avg_sq) -> dict[str, Callable[[], Any]]:
    """The streaming kernel's single out-of-place pass, with plain stores and with streaming
    stores, into two sets of buffers used in turn (as the pure path's pool does)."""
    if not streaming.usable(params):
        return {}
    hp = [0.9, 0.999, 1e-8, 1e-2, 1e-3, 1e-3 / (1 - 0.9), (1 - 0.999) ** 0.5, True, False, 1.0]
    generations = [[[t.clone() for t in leaves] for leaves in (params, exp_avg, exp_avg_sq)]
                   for _ in range(2)]
    turn = [0]

    def one_pass(nontemporal: bool) -> None:
        source, target = generations[turn[0] % 2], generations[(turn[0] + 1) % 2]
        given = iter(target)
        turn[0] += 1
        streaming.update("adam", hp, [source[0], grads, source[1], source[2], None],
                         lambda like: next(given), nontemporal=nontemporal)

    return {
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
        "fused_kernel_in_place": lambda: torch._fused_adamw_(
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
