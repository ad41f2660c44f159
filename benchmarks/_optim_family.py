"""``python benchmarks/optim.py --family``: the torch.optim family beyond Adam, Lion and
schedule-free AdamW against their references.

Each optimizer updates 8 fp32 params of 1024×1024 with fixed random grads on the CPU; one
process times, round by round interleaved, the reference's fastest path (``foreach=True`` where
torch has one; Muon's only path; ``lion_pytorch.Lion``; ``schedulefree.AdamWScheduleFree`` with
foreach) and minitrain's pure update (``params, state = opt.update(grads, state, params)``, the
previous params dropped as in a training loop). The grads are set once on both sides
(restored before each step only for a reference that writes into them). The ratio is
best-round time over the peer's; the target is at most 1.0.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import torch
from _timing import (
    best_rounds,
    cache_flusher,
    paired_median_ratio,
    paired_ratio_interval,
    time_rounds,
)

import minitrain as mt

__all__ = ["FAMILY", "FAMILY_TARGET", "family_ratios"]

# name -> (minitrain factory, reference "module:Class", shared kwargs, reference-only kwargs)
FAMILY: dict[str, tuple[Callable[..., Any], str, dict[str, Any], dict[str, Any]]] = {
    "adadelta": (mt.optim.adadelta, "torch.optim:Adadelta", {}, {"foreach": True}),
    "adafactor": (mt.optim.adafactor, "torch.optim:Adafactor", {}, {"foreach": True}),
    "adamax": (mt.optim.adamax, "torch.optim:Adamax", {}, {"foreach": True}),
    "nadam": (mt.optim.nadam, "torch.optim:NAdam", {}, {"foreach": True}),
    "nadam_decoupled": (mt.optim.nadam, "torch.optim:NAdam",
                        dict(weight_decay=0.01, decoupled_weight_decay=True), {"foreach": True}),
    "radam": (mt.optim.radam, "torch.optim:RAdam", {}, {"foreach": True}),
    "muon": (mt.optim.muon, "torch.optim:Muon", dict(lr=0.02), {}),
    "lion": (mt.optim.lion, "lion_pytorch:Lion", dict(lr=1e-4, weight_decay=0.01), {}),
    "schedule_free_adamw": (mt.optim.schedule_free_adamw, "schedulefree:AdamWScheduleFree",
                            dict(warmup_steps=10), {"foreach": True}),
}


def make_params(count: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(count)]


def _reference_class(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


FAMILY_TARGET = 1.0
"""The most each member's pure update may take over its reference's fastest path."""

# References whose step writes into p.grad (schedulefree divides it by the denominator in
# place): their grads are restored before each step. The others keep the grads set once, as
# minitrain's update keeps its grads, so that neither side times a copy the other does not.
WRITES_GRADS = {"schedulefree:AdamWScheduleFree"}


class _Reference:
    def __init__(self, cls: type, kwargs: dict, params: list, grads: list,
                 writes_grads: bool = False):
        self.params = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.clone()
        self.optimizer = cls(self.params, **kwargs)
        if hasattr(self.optimizer, "train"):  # schedule-free: steps only in train mode
            self.optimizer.train()
        self.grads = grads if writes_grads else None

    def __call__(self) -> None:
        if self.grads is not None:
            for p, g in zip(self.params, self.grads, strict=True):
                p.grad.copy_(g)
        self.optimizer.step()


class _Pure:
    def __init__(self, factory: Callable, kwargs: dict, params: list, grads: list):
        self.opt = factory(**kwargs)
        self.params = [p.clone() for p in params]
        self.state = self.opt.init(self.params)
        self.grads = grads

    def __call__(self) -> None:
        with torch.no_grad():
            self.params, self.state = self.opt.update(self.grads, self.state, self.params)


MIN_ROUNDS = 6  # the fewest rounds whose paired median has a 95% interval


def fitted_rounds(seconds_per_call: float, calls_per_round: int, rounds: int, inner: int,
                  budget: float) -> tuple[int, int]:
    """``(rounds, inner)`` cut down, inner first, until timing them fits ``budget`` seconds,
    but not below :data:`MIN_ROUNDS` rounds of one update (Muon's bfloat16 GEMMs, emulated on
    a CPU without native bfloat16, take seconds per update).

    >>> fitted_rounds(0.01, 2, 10, 3, 60.0)
    (10, 3)
    >>> fitted_rounds(15.0, 2, 10, 3, 300.0)
    (10, 1)
    >>> fitted_rounds(15.0, 2, 10, 3, 60.0)
    (6, 1)
    """
    def cost(r: int, i: int) -> float:
        return seconds_per_call * calls_per_round * r * i

    while inner > 1 and cost(rounds, inner) > budget:
        inner -= 1
    while rounds > MIN_ROUNDS and cost(rounds, inner) > budget:
        rounds -= 1
    return rounds, inner


def _first_call_seconds(steppers: dict[str, Callable[[], None]]) -> float:
    """The slowest stepper's first call (it also warms them up)."""
    slowest = 0.0
    for stepper in steppers.values():
        start = time.perf_counter()
        stepper()
        slowest = max(slowest, time.perf_counter() - start)
    return slowest


def family_ratios(names: list[str] | None = None, count: int = 8, size: int = 1024,
                  rounds: int = 10, inner: int = 3, cold: bool = False,
                  budget: float = 120.0) -> dict[str, Any]:
    """Seconds per update (reference, minitrain pure) and their ratio for each optimizer.

    A reference that is not installed (``lion-pytorch``, ``schedulefree``) gives a row with
    ``"skipped"`` and the reason instead of numbers. ``cold`` flushes the last-level cache
    before every update (:func:`_timing.cache_flusher`). A row whose first
    updates show it would take more than ``budget`` seconds times fewer updates
    (:func:`fitted_rounds`); its ``"rounds"`` and ``"inner"`` say how many.
    """
    params = make_params(count, (size, size))
    grads = make_params(count, (size, size), seed=1)
    flush = cache_flusher() if cold else None
    rows: dict[str, Any] = {}
    for name in names or list(FAMILY):
        factory, reference, shared, only_reference = FAMILY[name]
        try:
            cls = _reference_class(reference)
        except ImportError as exc:
            rows[name] = {"skipped": f"{reference} is not installed ({exc})"}
            continue
        steppers = {
            "reference": _Reference(cls, {**shared, **only_reference}, params, grads,
                                    writes_grads=reference in WRITES_GRADS),
            "minitrain_pure": _Pure(factory, shared, params, grads),
        }
        row_rounds, row_inner = fitted_rounds(_first_call_seconds(steppers), len(steppers),
                                              rounds, inner, budget)
        times = time_rounds(steppers, row_rounds, row_inner, "cpu", flush, warmup=2)
        seconds = best_rounds(times)
        rows[name] = {
            "reference": reference,
            "target": FAMILY_TARGET,
            "rounds": row_rounds,
            "inner": row_inner,
            "seconds": seconds,
            "pure_over_reference": seconds["minitrain_pure"] / seconds["reference"],
            "paired_median_ratio": paired_median_ratio(times, "minitrain_pure", "reference"),
            "paired_interval": paired_ratio_interval(times, "minitrain_pure", "reference"),
        }
        del steppers
    return {"params": f"{count} x {size}x{size} fp32, cpu", "results": rows}
