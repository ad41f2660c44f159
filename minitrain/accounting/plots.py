"""The pictures: a roofline with ops placed on it, and live memory over one step by category.

Both need matplotlib (``pip install 'minitrain[plot]'``); without it each is a one-line error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from minitrain.accounting.roofline import MEMORY, Placement, Roof, attainable_flops
from minitrain.accounting.timeline import CATEGORIES, Timeline
from minitrain.accounting.units import Number
from minitrain.errors import UserError

__all__ = ["plot", "plot_memory_timeline"]

_COLORS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer_state": "#59a14f",
           "batch": "#b07aa1", "buffers": "#9c755f", "activations": "#e15759",
           "temporaries": "#bab0ac"}


def _pyplot(what: str) -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(f"{what} needs matplotlib; install it with: "
                        "pip install 'minitrain[plot]'") from None
    return plt


def _save(plt: Any, fig: Any, path: str, **layout: Any) -> str:
    fig.tight_layout(**layout)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot(roofs: Sequence[Roof], placements: Iterable[Placement], path: str, *,
         title: str = "Roofline", measured: Iterable[tuple[str, float, float]] = (),
         label_top: int | None = None) -> str:
    """Draw the log-log roofline of each roof, mark ridge points and place the ops; save PNG.

    Ops sit on the first roof (red: memory-bound, green: compute-bound), those without FLOPs
    left out; ``label_top`` names only the slowest ops; ``measured`` adds points ``(label,
    intensity, achieved FLOP/s)``. Returns ``path``.
    """
    plt = _pyplot("plotting")
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
    return _save(plt, fig, path)


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


def plot_memory_timeline(
    timelines: Mapping[str, Timeline], path: str, *, title: str = "live memory over one step"
) -> str:
    """Draw each timeline (label -> timeline) as stacked areas of live bytes by category over
    the op index, one panel each on a shared y axis, phases marked; returns ``path``."""
    plt = _pyplot("the memory picture")
    panels = [(label, t) for label, t in timelines.items() if t]
    if not panels:
        raise UserError("plot_memory_timeline needs at least one non-empty timeline")
    used = [c for c in CATEGORIES if any(c in live for _, t in panels for _, _, live in t)]
    top = max(sum(live.values()) for _, t in panels for _, _, live in t)
    unit, scale = next((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1))
                       if top >= s or s == 1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels) + 0.6), dpi=120,
                             squeeze=False)
    for ax, (label, timeline) in zip(axes[:, 0], panels, strict=True):
        _memory_panel(ax, timeline, used, top, unit, scale)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("op index")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=min(len(used), 4))
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    return _save(plt, fig, path, rect=(0, 0, 1, 0.94))


def _memory_panel(ax: Any, timeline: Timeline, used: list[str], top: Number, unit: str,
                  scale: Number) -> None:
    xs = [index for index, _, _ in timeline]
    ys = [[live.get(c, 0) / scale for _, _, live in timeline] for c in used]
    ax.stackplot(xs, ys, labels=used, colors=[_COLORS[c] for c in used], step="post")
    totals = [sum(live.values()) for _, _, live in timeline]
    peak = max(range(len(totals)), key=totals.__getitem__)
    ax.plot([xs[peak]], [totals[peak] / scale], "k.", markersize=8)
    right = xs[peak] > xs[0] + 0.6 * (xs[-1] - xs[0])  # label left of a peak on the right
    ax.annotate(f"peak {totals[peak] / scale:.3g} {unit} ({timeline[peak][1]})",
                (xs[peak], totals[peak] / scale), textcoords="offset points",
                xytext=(-6 if right else 6, 4), ha="right" if right else "left", fontsize=8)
    for phase, start, end in _phase_spans(timeline):
        if start:
            ax.axvline(start, color="black", linestyle="--", linewidth=0.7)
        ax.text((start + end) / 2, top / scale * 1.1, phase, ha="center", va="bottom", fontsize=8)
    ax.set(ylim=(0, top / scale * 1.22), xlim=(xs[0], max(xs[-1], xs[0] + 1)),
           ylabel=f"live {unit}")
    ax.grid(alpha=0.3)


def _phase_spans(timeline: Timeline) -> list[tuple[str, int, int]]:
    spans: list[tuple[str, int, int]] = []
    for index, phase, _ in timeline:
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], index)
        else:
            spans.append((phase, index, index))
    return spans
