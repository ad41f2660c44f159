"""Run logs: an append-only ``metrics.jsonl``, an optional TensorBoard writer, a loss-curve PNG.

``metrics.jsonl`` is written line by line, so a killed run keeps everything it logged; a
resumed run drops the lines past its step, and a line cut short by a failed write is removed.

>>> import tempfile
>>> run = tempfile.mkdtemp()
>>> with MetricsWriter(run) as log:
...     _ = log.write(1, loss=2.5, lr=0.1)
...     _ = log.write(2, loss=2.0, lr=0.1)
>>> [row["loss"] for row in read_metrics(run)]
[2.5, 2.0]
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from numbers import Real
from pathlib import Path
from typing import Any

from minitrain.atomic_io import storage_errors, write_atomic
from minitrain.errors import StorageError, UserError

__all__ = [
    "METRICS_FILE", "MetricsError", "MissingExtra", "MetricsWriter", "read_metrics",
    "truncate_metrics", "plot", "ema",
]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"


class MetricsError(UserError):
    """A metrics file or directory that cannot be read or plotted, with a one-line message."""


class MissingExtra(UserError, ImportError):
    """An optional dependency (an extra such as ``plot`` or ``tensorboard``) is not installed."""


def _metrics_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (or of a run directory); a torn last line is ignored."""
    path = _metrics_path(path)
    if not path.is_file():
        raise MetricsError(f"no metrics file at {path}; pass a run directory written with --out")
    with storage_errors(path, "read"):
        lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_refuse_constant)
        except ValueError:
            if number == len(lines):  # the unfinished last line of a killed run
                break
            raise MetricsError(f"{path} line {number} is not JSON; fix or delete it") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsError(f"{path} line {number} has no integer 'step'; fix or delete it")
        records.append(record)
    return records


def _refuse_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (minitrain writes null): a line holding one was edited."""
    raise ValueError(f"{name} is not JSON")


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Atomically drop the records after ``step`` and any torn line; return how many stay."""
    path = _metrics_path(path)
    if not path.exists():
        return 0
    kept = [record for record in read_metrics(path) if record["step"] <= step]
    write_atomic(path, "".join(_dumps(record) + "\n" for record in kept), "rewrite")
    return len(kept)


def _plain(value: Any) -> Any:
    """A JSON-friendly number: tensors and numpy scalars become floats, NaN/inf become null."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _dumps(record: dict[str, Any]) -> str:
    try:
        return json.dumps(record, allow_nan=False, separators=(", ", ": "))
    except (TypeError, ValueError) as exc:
        for key, value in record.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise MetricsError(f"metrics value {key!r} cannot be logged ({exc}); log "
                                   "numbers, strings or None") from None
        raise


class MetricsWriter:
    """Append one JSON line per :meth:`write` to ``run_dir/metrics.jsonl``, flushed at once.

    ``resume_step`` drops the lines after it first; ``tensorboard`` also writes scalars,
    flushed before the line, so a killed run's TensorBoard holds every line of its jsonl.
    """

    def __init__(
        self, run_dir: str | os.PathLike, resume_step: int = 0, tensorboard: bool = False
    ) -> None:
        if not isinstance(resume_step, int) or resume_step < 0:
            raise MetricsError(f"resume_step must be a non-negative int, got {resume_step!r}")
        self.path = Path(run_dir) / METRICS_FILE
        self._fd: int | None = None
        self._tensorboard = None
        with storage_errors(self.path, "write"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step:
                truncate_metrics(self.path, resume_step)
            flags = os.O_WRONLY | os.O_CREAT | (0 if resume_step else os.O_TRUNC)
            self._fd = os.open(self.path, flags, 0o644)
            # Whole lines only: os.write of one line per record, at the end of the file.
            self._size = os.lseek(self._fd, 0, os.SEEK_END)
        if tensorboard:
            try:
                import tensorboard  # noqa: F401
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.close()
                raise MissingExtra(
                    "TensorBoard logging needs the tensorboard package; pip install "
                    "'minitrain[tensorboard]' or turn TensorBoard logging off"
                ) from None
            directory = self.path.parent / TENSORBOARD_DIR
            try:  # purge_step hides older events past resume_step (all of them from step 0)
                self._tensorboard = SummaryWriter(str(directory), purge_step=resume_step + 1)
            except OSError as exc:
                self.close()
                raise StorageError.from_os_error(exc, directory, "write") from None

    def write(self, step: int, **values: Any) -> dict[str, Any]:
        """Log ``values`` for ``step``; returns the record written."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise MetricsError(f"step must be an int, got {step!r}")
        if self._fd is None:
            raise MetricsError(f"{self.path} is closed; open a new MetricsWriter")
        record = {"step": step, **{key: _plain(value) for key, value in values.items()}}
        line = (_dumps(record) + "\n").encode()
        if self._tensorboard is not None:
            with storage_errors(self.path.parent / TENSORBOARD_DIR, "write"):
                for key, value in record.items():
                    if key != "step" and isinstance(value, Real) and not isinstance(value, bool):
                        self._tensorboard.add_scalar(key, value, step)
                self._tensorboard.flush()
        self._append(line)
        return record

    def _append(self, line: bytes) -> None:
        """Write one whole line; if the OS refuses part way, cut the file back and raise."""
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            try:  # drop the partial line so the file holds whole records only
                os.ftruncate(self._fd, self._size)
                os.lseek(self._fd, self._size, os.SEEK_SET)
            except OSError:
                pass  # read_metrics ignores an unfinished last line anyway
            raise StorageError.from_os_error(exc, self.path, "write") from None
        self._size += len(line)

    def close(self) -> None:
        """Flush the file to disk and close it (and the TensorBoard writer); safe to repeat."""
        fd, self._fd = self._fd, None
        tensorboard, self._tensorboard = self._tensorboard, None
        with storage_errors(self.path, "write"):
            if fd is not None:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if tensorboard is not None:
                tensorboard.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average, as TensorBoard's smoothing slider."""
    smoothed, average = [], 0.0
    for count, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        smoothed.append(average / (1 - weight**count))
    return smoothed


def plot(
    run_dir: str | os.PathLike | Sequence[str | os.PathLike],
    out_png: str | os.PathLike | None = None,
    keys: tuple[str, ...] | None = None,
) -> Path:
    """Draw the loss curves of one run or several (overlaid) to a PNG; return its path. A
    sweep's run (records with a ``member``) gives a curve per member.

    ``keys`` defaults to ``loss`` and every ``val*``/``eval*`` series; the PNG goes to
    ``out_png`` or ``run_dir/loss.png``. Needs matplotlib (the ``plot`` extra).

    >>> import tempfile
    >>> run = tempfile.mkdtemp()
    >>> with MetricsWriter(run) as log:
    ...     for s in range(1, 4):
    ...         _ = log.write(s, loss=1.0 / s)
    >>> plot(run).name
    'loss.png'
    """
    one = isinstance(run_dir, (str, os.PathLike))
    run_dirs = [Path(run_dir)] if one else [Path(path) for path in run_dir]
    if not run_dirs:
        raise MetricsError("no run directories to plot; pass at least one")
    if len(run_dirs) > 1 and out_png is None:
        raise MetricsError(f"{len(run_dirs)} run directories make one plot; say where it goes "
                           "with an out path ending in .png")
    runs = [read_metrics(path) for path in run_dirs]
    if keys is None:
        found = {key for records in runs for record in records for key in record}
        keys = ("loss", *sorted(k for k in found if k.startswith(("val", "eval"))))
    out = Path(out_png) if out_png is not None else run_dirs[0] / PLOT_FILE
    if out.suffix.lower() != ".png":
        raise MetricsError(f"the plot is written as PNG; give a path ending in .png, not {out}")
    # each run by its directory's name, or by its path where two share a name
    names = [path.resolve().name or str(path) for path in run_dirs]
    if len(set(names)) < len(names):
        names = [str(path) for path in run_dirs]
    curves, labels = [], []
    for path, name, records in zip(run_dirs, names, runs, strict=True):
        for label, group in _members(name if len(run_dirs) > 1 else "", records):
            series = {key: [(r["step"], r[key]) for r in group
                            if isinstance(r.get(key), Real) and not isinstance(r[key], bool)]
                      for key in keys}
            series = {key: tuple(zip(*points, strict=True)) for key, points in series.items()
                      if points}
            if not series:
                raise MetricsError(f"{_metrics_path(path)} has no numeric values for "
                                   f"{', '.join(keys)}; nothing to plot")
            curves.append(series)
            labels.append(label)
    parents = {path.resolve().parent for path in run_dirs}
    title = names[0] if len(run_dirs) == 1 else (
        next(iter(parents)).name if len(parents) == 1 else f"{len(run_dirs)} runs")
    buffer = io.BytesIO()
    _figure(curves, labels if len(curves) > 1 else None, title).savefig(buffer, format="png",
                                                                      dpi=120)
    with storage_errors(out, "write the plot to", mkdir=True):
        out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, buffer.getvalue(), "write the plot to")


def _members(name: str, records: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """``[(label, records)]``: a run's records, or a sweep's split by their ``member``, each
    labelled by its number, swept values and seed (``#1 lr=0.1 seed=0``)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for record in records:  # one pass, however many members
        if isinstance(record.get("member"), int):
            groups.setdefault(record["member"], []).append(record)
    if not groups:
        return [(name, records)]
    return [(" ".join([name, f"#{m}", *_swept(group[0])]).strip(), group)
            for m, group in sorted(groups.items())]


def _swept(record: dict[str, Any]) -> list[str]:
    config = record.get("config")
    swept = [f"{k}={v}" for k, v in config.items()] if isinstance(config, dict) else []
    return swept + ([f"seed={record['seed']}"] if "seed" in record else [])


_LINESTYLES = ("-", "--", ":", "-.")


def _figure(curves: list[dict[str, tuple[tuple[int, ...], tuple[float, ...]]]],
            labels: list[str] | None, title: str) -> Any:
    """One axes: each run's series (several runs: a colour per run, a line style per key)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtra("plotting needs matplotlib; pip install 'minitrain[plot]'") from None
    # The object-oriented API with the Agg canvas: no pyplot, no global state, no display.
    figure = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    all_keys = list(dict.fromkeys(key for series in curves for key in series))
    for index, series in enumerate(curves):
        for key, (steps, values) in series.items():
            name = key
            style = {"color": None, "linestyle": "-"}
            if labels is not None:
                name = labels[index] if len(all_keys) == 1 else f"{labels[index]}: {key}"
                style = {"color": f"C{index % 10}",
                         "linestyle": _LINESTYLES[all_keys.index(key) % len(_LINESTYLES)]}
            if len(steps) > 20:
                raw = axes.plot(steps, values, alpha=0.3 if labels is None else 0.15,
                                linewidth=0.8, **style)[0]
                axes.plot(steps, ema(values, 0.9), label=f"{name} (EMA 0.9)",
                          **{**style, "color": raw.get_color()})
            else:
                axes.plot(steps, values, marker="o", markersize=3, label=name, **style)
    axes.set_xlabel("step")
    axes.set_ylabel(all_keys[0] if len(all_keys) == 1 else "value")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    return figure
