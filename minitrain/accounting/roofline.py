"""Arithmetic intensity and the roofline model (chapter 3.6; JAX Scaling Book, "Rooflines").

An op of intensity ``flops / bytes`` on a device of ridge point ``peak / bandwidth`` takes
``max(flops / peak, bytes / bandwidth)`` seconds, attains ``min(peak, intensity · bandwidth)``
FLOP/s and at most ``min(1, intensity / ridge)`` MFU. :func:`plot` draws it (matplotlib, the
``plot`` extra).

>>> h100 = roof("h100", "bf16")
>>> round(h100.ridge)
295
>>> relu = chapter_ops(n=1024 * 1024)[0]
>>> relu.name, relu.intensity, place(relu, h100).bound
('relu', 0.25, 'memory')
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from minitrain.accounting.hardware import DTYPE_NAMES, Hardware, dtype_name, hardware
from minitrain.accounting.units import Number, check_numbers
from minitrain.errors import UserError

__all__ = ["DTYPE_BYTES", "Op", "Placement", "Roof", "StepProfile", "accelerator_intensity",
           "arithmetic_intensity", "attainable_flops", "bound", "chapter_ops", "mfu_bound",
           "phases", "place", "plot", "predicted_seconds", "profile_records", "roof",
           "step_time"]

MEMORY, COMPUTE = "memory", "compute"


def arithmetic_intensity(flops: Number, bytes_moved: Number) -> float:
    """FLOPs per byte moved (chapter 3.6.3); inf for an op that moves nothing.

    >>> arithmetic_intensity(flops=1024, bytes_moved=4096)
    0.25
    """
    check_numbers(flops=flops, bytes_moved=bytes_moved)
    if bytes_moved == 0:
        return math.inf if flops else math.nan
    return flops / bytes_moved


def accelerator_intensity(peak_flops: Number, bandwidth: Number) -> float:
    """The ridge point: peak FLOP/s over memory bytes/s (chapter 3.6.3).

    >>> round(accelerator_intensity(989.4e12, 3.35e12))  # H100 SXM, dense bf16
    295
    """
    check_numbers(True, peak_flops=peak_flops, bandwidth=bandwidth)
    return peak_flops / bandwidth


def bound(intensity: Number, ridge: Number) -> str:
    """``"memory"`` left of the ridge point, ``"compute"`` at or right of it.

    >>> bound(0.25, 295), bound(341, 295)
    ('memory', 'compute')
    """
    check_numbers(True, ridge=ridge)
    return COMPUTE if intensity >= ridge else MEMORY


def attainable_flops(intensity: Number, peak_flops: Number, bandwidth: Number) -> float:
    """The roofline: min(peak, intensity x bandwidth) FLOP/s (Williams et al., 2009).

    >>> attainable_flops(1.0, peak_flops=100.0, bandwidth=10.0)
    10.0
    """
    check_numbers(True, peak_flops=peak_flops, bandwidth=bandwidth)
    return float(min(peak_flops, intensity * bandwidth))


def mfu_bound(intensity: Number, ridge: Number) -> float:
    """The best MFU an op can reach: min(1, intensity / ridge) (chapter 3.6.6).

    >>> mfu_bound(5.0, 295.0) < 0.02, mfu_bound(341.0, 295.0)
    (True, 1.0)
    """
    check_numbers(True, ridge=ridge)
    return min(1.0, intensity / ridge)


def predicted_seconds(flops: Number, bytes_moved: Number, peak_flops: Number,
                      bandwidth: Number) -> float:
    """Time with compute and transfers overlapped: max(FLOPs/peak, bytes/bandwidth) (3.6.2).

    >>> n = 1024 * 1024  # the chapter's ReLU on an H100: transfers dominate
    >>> f"{predicted_seconds(n, 4 * n, 989.5e12, 3.35e12):.1e}"
    '1.3e-06'
    """
    check_numbers(flops=flops, bytes_moved=bytes_moved)
    check_numbers(True, peak_flops=peak_flops, bandwidth=bandwidth)
    return max(flops / peak_flops, bytes_moved / bandwidth)


# Bytes per element of each dtype name of the hardware registry.
DTYPE_BYTES: dict[str, float] = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1,
                                 "int8": 1, "fp4": 0.5}


class Roof(NamedTuple):
    """One device's roofline in one dtype."""

    name: str
    peak_flops: Number
    bandwidth: Number
    source: str = ""

    @property
    def ridge(self) -> float:
        """Accelerator intensity, FLOP/byte."""
        return accelerator_intensity(self.peak_flops, self.bandwidth)


def roof(hardware_name: str = "h100", dtype: str = "bf16") -> Roof:
    """The roofline of a registered device (``"cpu"`` is measured here) in ``dtype``.

    >>> roof("a100-80gb", "bf16").peak_flops / 1e12
    312.0
    """
    spec = hardware(hardware_name)
    name = dtype_name(dtype)
    return Roof(f"{spec.name} {name}", spec.peak(name), spec.memory_bandwidth, spec.source)


class Op(NamedTuple):
    """An operation's work: FLOPs done and bytes moved; ``count`` calls folded together."""

    name: str
    flops: Number
    bytes: Number
    count: int = 1

    @property
    def intensity(self) -> float:
        return arithmetic_intensity(self.flops, self.bytes)


class Placement(NamedTuple):
    """An op on a roofline: where it sits and what it can attain."""

    name: str
    flops: Number
    bytes: Number
    count: int
    intensity: Number
    bound: str  # "memory", "compute" or "none" (moves and computes nothing)
    attainable_flops: Number
    mfu_bound: Number
    seconds: Number  # predicted: max(flops / peak, bytes / bandwidth)


def place(op: Op, on: Roof) -> Placement:
    """Place ``op`` on roofline ``on``.

    >>> p = place(Op("matmul", flops=2 * 1024**3, bytes=6 * 1024**2), roof("h100", "bf16"))
    >>> p.bound, round(p.intensity), p.mfu_bound
    ('compute', 341, 1.0)
    """
    intensity = op.intensity
    seconds = predicted_seconds(op.flops, op.bytes, on.peak_flops, on.bandwidth)
    if math.isnan(intensity):
        return Placement(op.name, op.flops, op.bytes, op.count, intensity, "none", 0.0, 0.0, 0.0)
    return Placement(op.name, op.flops, op.bytes, op.count, intensity, bound(intensity, on.ridge),
                     attainable_flops(intensity, on.peak_flops, on.bandwidth),
                     mfu_bound(intensity, on.ridge), seconds)


def chapter_ops(n: int = 1024, bytes_per_element: Number = 2) -> list[Op]:
    """The chapter's five operations on size-``n`` operands (table 3.6.4; bf16 by default):
    ReLU and GeLU (~20 FLOPs a value), dot product, matrix-vector and matrix-matrix.

    >>> [round(op.intensity, 2) for op in chapter_ops(n=1024)]
    [0.25, 5.0, 0.5, 1.0, 341.17]
    """
    if n < 1 or not bytes_per_element > 0:
        raise UserError(f"n must be >= 1 and bytes_per_element > 0, got {n}, {bytes_per_element}")
    b = bytes_per_element
    return [
        Op("relu", n, 2 * b * n),
        Op("gelu", 20 * n, 2 * b * n),
        Op("dot", 2 * n - 1, b * (2 * n + 1)),
        Op("matvec", n * (2 * n - 1), b * (n * n + 2 * n)),
        Op("matmul", n * n * (2 * n - 1), 3 * b * n * n),
    ]


class StepProfile(NamedTuple):
    """Every op of one step placed on a roofline, and the sums."""

    roof: Roof
    calls: list[Placement]  # one per op call, in order, named "aten.mm (backward)"
    groups: list[Placement]  # calls folded by name, slowest predicted first
    flops: float
    bytes: float
    predicted_seconds: float  # sum over calls of max(flops / peak, bytes / bandwidth)
    measured_seconds: float | None

    @property
    def intensity(self) -> float:
        """FLOPs per byte of the whole step."""
        return arithmetic_intensity(self.flops, self.bytes)

    @property
    def achieved_flops(self) -> float | None:
        """FLOP/s the step reached on its measured time."""
        return self.flops / self.measured_seconds if self.measured_seconds else None


def phases(backward: Sequence[bool]) -> list[str]:
    """Each op call's phase: "forward" before the first backward op, "backward" up to the
    last one, "update" after it.

    >>> phases([False, True, True, False])
    ['forward', 'backward', 'backward', 'update']
    """
    marked = [i for i, b in enumerate(backward) if b]
    first, last = (marked[0], marked[-1]) if marked else (len(backward), len(backward))
    return ["forward" if i < first else "update" if i > last else "backward"
            for i in range(len(backward))]


def profile_records(records: Iterable[object], on: Roof,
                    measured_seconds: float | None = None) -> StepProfile:
    """Place each op call of a step (a :class:`minitrain.accounting.Counter`'s records) on
    roofline ``on``.

    >>> from types import SimpleNamespace as R
    >>> calls = [R(op="aten.mm", flops=2e6, bytes_read=8e4, bytes_written=4e3, backward=False),
    ...          R(op="aten.mm", flops=2e6, bytes_read=8e4, bytes_written=4e3, backward=True)]
    >>> p = profile_records(calls, Roof("toy", peak_flops=1e12, bandwidth=1e11))
    >>> [g.name for g in p.groups], round(p.intensity, 1), p.predicted_seconds
    (['aten.mm (forward)', 'aten.mm (backward)'], 23.8, 4e-06)
    """
    records = list(records)
    labels = phases([bool(r.backward) for r in records])
    calls = [
        place(Op(f"{r.op} ({phase})", r.flops, r.bytes_read + r.bytes_written), on)
        for r, phase in zip(records, labels, strict=True)
    ]
    by_name: dict[str, list[Placement]] = defaultdict(list)
    for c in calls:
        by_name[c.name].append(c)
    groups = [  # max() is per call: sum the calls' seconds
        place(Op(name, sum(c.flops for c in same), sum(c.bytes for c in same), len(same)),
              on)._replace(seconds=sum(c.seconds for c in same))
        for name, same in by_name.items()
    ]
    groups.sort(key=lambda g: -g.seconds)
    return StepProfile(on, calls, groups, sum(c.flops for c in calls),
                       sum(c.bytes for c in calls), sum(c.seconds for c in calls),
                       measured_seconds)


def _peak_for(spec: Hardware, dtype: Any, record_dtype: str) -> float:
    if dtype is None:  # the op's own; integer and bool ops (no peak listed) at the fp32 peak
        dtype = record_dtype if record_dtype in spec.peak_flops else "fp32"
    return spec.peak(dtype)


def step_time(counter: Any, spec: Hardware, dtype: Any = None) -> tuple[float, str, float]:
    """The counted ops of a step on ``spec``'s roofline: ``(seconds, dtype, mfu_bound)``.

    Each op takes ``max(flops / peak, bytes / bandwidth)`` (chapter 3.6.2) with the peak of
    ``dtype`` (default: the op's own, fp32 for integer ops); ``mfu_bound`` is ``flops /
    (seconds · peak)`` with the peak of the dtype that did most FLOPs.

    >>> import torch
    >>> from minitrain.accounting import Counter
    >>> with Counter() as c:
    ...     _ = torch.ones(256, 256) @ torch.ones(256, 256)
    >>> seconds, name, mfu = step_time(c, hardware("h100"))
    >>> name, round(seconds * 1e9), round(mfu, 2)  # the mm's 2·256³ FLOPs take 501 ns of 657
    ('fp32', 657, 0.76)
    """
    seconds = sum(max(record.flops / _peak_for(spec, dtype, record.dtype),
                      record.bytes / spec.memory_bandwidth) for record in counter.records)
    main_dtype = dtype_name(dtype) if dtype is not None else _main_dtype(counter)
    mfu = counter.flops / (seconds * _peak_for(spec, dtype, main_dtype)) if seconds else 0.0
    return seconds, main_dtype, mfu


def _main_dtype(counter: Any) -> str:
    # The dtype that did most of the FLOPs, of those with a name in the hardware registry.
    flops: dict[str, int] = defaultdict(int)
    for record in counter.records:
        flops[record.dtype] += record.flops
    ranked = sorted((name for name in flops if name in DTYPE_NAMES), key=lambda n: -flops[n])
    return ranked[0] if ranked else "fp32"


def _axes() -> tuple[Any, Any]:
    """A figure on the Agg canvas and its axes: no pyplot, no global state, no display."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("plotting needs matplotlib; install it with: "
                        "pip install 'minitrain[plot]'") from None
    figure = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def plot(on: Roof, placements: Iterable[Placement], path: str, *, title: str = "Roofline",
         measured: Iterable[tuple[str, float, float]] = (), label_top: int | None = None) -> str:
    """Draw the log-log roofline ``on``, mark its ridge point and place the ops; save a PNG.

    Ops without FLOPs are left out (red: memory-bound, green: compute-bound); ``label_top``
    names only the slowest ops; ``measured`` adds points ``(label, intensity, achieved
    FLOP/s)``. Returns ``path``.
    """
    points = [p for p in placements if math.isfinite(p.intensity) and p.intensity > 0]
    measured = list(measured)
    xs = [p.intensity for p in points] + [x for _, x, _ in measured] + [on.ridge]
    lo, hi = 10 ** math.floor(math.log10(min(xs) / 4)), 10 ** math.ceil(math.log10(max(xs) * 4))
    fig, ax = _axes()
    line = ax.plot([lo, on.ridge, hi], [lo * on.bandwidth, on.peak_flops, on.peak_flops],
                   label=on.name)[0]
    ax.axvline(on.ridge, color=line.get_color(), linestyle=":", linewidth=1)
    ax.annotate(f"ridge {on.ridge:.3g} FLOP/B", (on.ridge, on.peak_flops),
                textcoords="offset points", xytext=(4, 6), fontsize=8, color=line.get_color())
    _place_ops(ax, on, points, hi, label_top)
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
