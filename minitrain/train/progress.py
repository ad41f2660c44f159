"""What a run shows while it trains: a progress bar on stderr, and messages on stderr."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator

__all__ = ["progress_bar", "resident_bytes", "to_stderr"]

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@contextlib.contextmanager
def progress_bar(
    name: str, total: int, start: int, enabled: bool
) -> Iterator[Callable[[int, float], None]]:
    """A rich progress bar on stderr (steps, elapsed, ETA, live loss); yields
    ``advance(step, loss)``. Disabled, it yields a function that does nothing."""
    if not enabled:
        yield lambda step, loss: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("loss {task.fields[loss]}"),
        console=Console(stderr=True),
        refresh_per_second=4,
    )
    with progress:
        task = progress.add_task(name, total=total, completed=start, loss="-")

        def advance(step: int, loss: float) -> None:
            progress.update(task, completed=step, loss=f"{loss:.4g}")

        yield advance


def to_stderr(message: str) -> None:
    """Print a progress message on stderr (stdout stays clean for ``--json``)."""
    print(message, file=sys.stderr, flush=True)


@functools.cache
def _statm() -> int | None:
    try:
        return os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None


def resident_bytes() -> int | None:
    """This process's resident memory (RSS) from ``/proc/self/statm``; None where unavailable."""
    fd = _statm()
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


