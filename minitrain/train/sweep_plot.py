"""``sweep.png``: every member's loss curve beside the ranking (matplotlib, an extra)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from minitrain.atomic_io import storage_errors
from minitrain.metrics import MissingExtra, read_metrics
from minitrain.train.experiment import ExperimentError
from minitrain.train.loop import SUMMARY_FILE
from minitrain.train.ranking import rank_value

__all__ = ["PLOT_FILE", "plot_sweep"]

PLOT_FILE = "sweep.png"


def plot_sweep(run_dir: str | Path, out_png: str | Path | None = None) -> Path:
    """Draw every member's loss curve, and the ranking beside it, to a PNG; return its path.

    Reads ``run_dir/metrics.jsonl`` and ``summary.json``; writes ``run_dir/sweep.png`` unless
    ``out_png`` is given. Needs matplotlib (the ``plot`` extra), imported here only.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.is_file():
        raise ExperimentError(f"no {SUMMARY_FILE} in {run_dir}; plot a finished sweep's --out")
    ranking = json.loads(summary_path.read_text())["ranking"]
    figure = _sweep_figure(records, ranking, title=run_dir.resolve().name)
    out = Path(out_png) if out_png is not None else run_dir / PLOT_FILE
    if out.suffix.lower() != ".png":
        raise ExperimentError(f"the plot is written as PNG; give a path ending in .png, not {out}")
    with storage_errors(out, "write"):
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=120)
    return out


def _sweep_figure(records: list[dict], ranking: list[dict], title: str) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtra(
            "the sweep plot needs matplotlib; pip install 'minitrain[plot]' or pass --no-plot"
        ) from None
    from minitrain.metrics import ema

    curves: dict[int, tuple[list[int], list[float]]] = {}
    for record in records:
        loss = record.get("loss")
        if isinstance(record.get("member"), int) and isinstance(loss, int | float):
            steps, values = curves.setdefault(record["member"], ([], []))
            steps.append(record["step"])
            values.append(loss)
    labels = {row["member"]: _row_label(row) for row in ranking}
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    curves_axes, ranks_axes = figure.subplots(1, 2, width_ratios=(3, 2))
    positive = all(v > 0 for _, values in curves.values() for v in values)
    healthy_top = []
    for row in ranking:
        steps, values = curves.get(row["member"], ([], []))
        if not steps:
            continue
        smooth = ema(values, 0.9) if len(steps) > 20 else values
        label = labels[row["member"]]
        if row["diverged_at"]:
            label += f" (diverged at {row['diverged_at']})"
        else:
            healthy_top.append(max(smooth))
        style = {"linestyle": ":"} if row["diverged_at"] else {}
        curves_axes.plot(steps, smooth, label=label, **style)
    if positive:
        curves_axes.set_yscale("log")
    if healthy_top and len(healthy_top) < len(ranking):  # keep diverged curves from the scale
        curves_axes.set_ylim(top=max(healthy_top) * (10 if positive else 1.2))
    curves_axes.set_xlabel("step")
    curves_axes.set_ylabel("train loss" + (" (EMA 0.9)" if len(records) > 20 else ""))
    curves_axes.set_title(f"{title}: {len(ranking)} members")
    curves_axes.grid(alpha=0.3)
    if len(ranking) <= 12:
        curves_axes.legend(fontsize=7)
    ranked = [row for row in ranking if not row["diverged_at"]]
    metric = ranked[0]["ranked_by"] if ranked else "smoothed_loss"
    values = [math.nan if rank_value(row) is None else rank_value(row) for row in ranked]
    ranks_axes.barh([labels[row["member"]] for row in ranked], values)
    ranks_axes.invert_yaxis()
    if values and min(values) > 0 and max(values) > 100 * min(values):
        ranks_axes.set_xscale("log")
    ranks_axes.set_xlabel(metric.replace("_", " ") + " (best first)")
    ranks_axes.tick_params(axis="y", labelsize=7)
    diverged = len(ranking) - len(ranked)
    ranks_axes.set_title("ranking" + (f" ({diverged} diverged, not shown)" if diverged else ""))
    return figure


def _row_label(row: dict[str, Any]) -> str:
    swept = " ".join(f"{k}={v:g}" for k, v in row["config"].items())
    return f"#{row['member']} {swept} seed={row['seed']}".replace("  ", " ")

