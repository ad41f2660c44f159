"""The picture: a roofline with ops placed on it.

It needs matplotlib (``pip install 'minitrain[plot]'``); without it, a one-line error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from minitrain.accounting.roofline import MEMORY, Placement, Roof, attainable_flops
from minitrain.accounting.units import Number
from minitrain.errors import UserError

__all__ = ["plot"]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib; install it with: "
                        "pip install 'minitrain[plot]'") from None
    return plt


def plot(roofs: Sequence[Roof], placements: Iterable[Placement], path: str, *,
         title: str = "Roofline", measured: Iterable[tuple[str, float, float]] = (),
         label_top: int | None = None) -> str:
    """Draw the log-log roofline of each roof, mark ridge points and place the ops; save PNG.

    Ops sit on the first roof (red: memory-bound, green: compute-bound), those without FLOPs
    left out; ``label_top`` names only the slowest ops; ``measured`` adds points ``(label,
    intensity, achieved FLOP/s)``. Returns ``path``.
    """
    plt = _pyplot()
    if not roofs:
        raise UserError("plot needs at least one roof")
    points = [p for p in placements if math.isfinite(p.intensity) and p.intensity > 0]
    measured = list(measured)
    xs = [p.intensity for p in points] + [x for _, x, _ in measured] + [r.ridge for r in roofs]
    lo, hi = 10 ** math.floor(math.log10(min(xs) / 4)), 10 ** math.ceil(math.log10(max(xs) * 4))
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for r in roofs:
        line = ax.plot([lo, r.ridge, hi], [lo * r.bandwidth, r.peak_flops, r.peak_flops],
                       label=r.name)[0]
        ax.axvline(r.ridge, color=line.get_color(), linestyle=":", linewidth=1)
        ax.annotate(f"ridge {r.ridge:.3g} FLOP/B", (r.ridge, r.peak_flops),
                    textcoords="offset points", xytext=(4, 6), fontsize=8, color=line.get_color())
    _place_ops(ax, roofs[0], points, hi, label_top)
    for label, x, achieved in measured:
        ax.scatter([x], [achieved], marker="x", color="black", zorder=4)
        ax.annotate(label, (x, achieved), textcoords="offset points", xytext=(-6, 6),
                    ha="right", fontsize=7)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), title=title,
           xlabel="arithmetic intensity (FLOP / byte)", ylabel="attainable FLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _place_ops(ax: Any, top: Roof, points: list[Placement], hi: Number,
               label_top: int | None) -> None:
    """The ops as dots on roof ``top``, the slowest ``label_top`` named."""
    ranked = sorted(points, key=lambda p: -p.seconds)
    labelled = {id(p) for p in ranked[: len(ranked) if label_top is None else label_top]}
    labels: dict[float, list[str]] = {}  # ops at the same spot share one label
    for p in points:
        y = attainable_flops(p.intensity, top.peak_flops, top.bandwidth)
        color = "tab:red" if p.bound == MEMORY else "tab:green"
        ax.scatter([p.intensity], [y], color=color, zorder=3, s=18, alpha=0.7)
        if id(p) in labelled:
            labels.setdefault(round(math.log10(p.intensity), 2), []).append(p.name)
    previous, stacked = -math.inf, 0
    for spot in sorted(labels):
        # Labels of nearby ops (within 0.35 decades) stack downwards instead of overlapping.
        stacked = stacked + 1 if spot - previous < 0.35 else 0
        previous = spot
        x = 10**spot
        y = attainable_flops(x, top.peak_flops, top.bandwidth)
        names = [_short(name.removeprefix("aten.")) for name in labels[spot]]
        text = ", ".join(names[:2]) + (f" +{len(names) - 2}" if len(names) > 2 else "")
        right = x > hi / 10  # in the last decade, write to the left so the label stays inside
        ax.annotate(text, (x, y), textcoords="offset points", fontsize=7,
                    xytext=(-4 if right else 4, -10 - 9 * stacked), ha="right" if right else "left")


def _short(name: str, width: int = 36) -> str:
    """An op's name cut to ``width`` characters for a plot label, keeping its phase suffix."""
    if len(name) <= width:
        return name
    base, _, phase = name.partition(" (")
    suffix = f" ({phase}" if phase else ""
    return base[: max(8, width - len(suffix) - 1)] + "…" + suffix
