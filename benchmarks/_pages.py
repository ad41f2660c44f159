"""Dated result pages: ``python benchmarks/<name>.py --page`` also writes what it prints to
``docs/benchmarks/<name>.md``, with the host, torch version, commit and date it was measured on.

A page is one measurement, replaced by the next run of the same script; the history of earlier
runs lives in git.
"""

from __future__ import annotations

import datetime
import functools
import io
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

__all__ = ["PAGES", "host", "page", "render", "write_page"]

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "benchmarks"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def host() -> dict[str, str]:
    """Where and when a measurement ran: CPU, cores, load, GPU, versions, commit, date."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--", "minitrain", "benchmarks", "backends"):
        commit += " with uncommitted changes to minitrain/, benchmarks/ or backends/"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "CPU": f"{_cpu_model()}, {os.cpu_count()} cores ({usable} usable)",
        "load average (1, 5, 15 min) at the start": ", ".join(f"{x:.2f}" for x in load),
        "GPU": gpu,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "torch": torch.__version__,
        "minitrain commit": commit,
    }


def render(name: str, title: str, command: str, output: str, about: dict[str, str]) -> str:
    """The page's Markdown.

    >>> print(render("x", "X against Y", "python benchmarks/x.py --page", "1.00x",
    ...              {"torch": "2.13.0"}))
    # X against Y
    <BLANKLINE>
    Measured by `python benchmarks/x.py --page`; run it again to replace this page.
    <BLANKLINE>
    | | |
    |---|---|
    | torch | 2.13.0 |
    <BLANKLINE>
    ```text
    1.00x
    ```
    <BLANKLINE>
    """
    rows = "\n".join(f"| {key} | {value} |" for key, value in about.items())
    return (f"# {title}\n\nMeasured by `{command}`; run it again to replace this page.\n\n"
            f"| | |\n|---|---|\n{rows}\n\n```text\n{output.rstrip()}\n```\n")


def write_page(name: str, title: str, output: str, about: dict[str, str] | None = None,
               command: str | None = None, pages: Path | None = None) -> Path:
    """Write ``<pages>/<name>.md`` (``docs/benchmarks/`` by default) and return its path."""
    pages = PAGES if pages is None else pages
    command = command or "python " + " ".join(
        shlex.quote(a) for a in [f"benchmarks/{name}.py", *sys.argv[1:]])
    path = pages / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(name, title, command, output, about or host()))
    return path


class _Tee(io.TextIOBase):
    """Writes to a stream and keeps a copy."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def page(name: str, title: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a benchmark command a ``--page`` flag: what it prints also goes to its dated page.
    Put it just under ``@click.command``."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def command(*args: Any, page: bool = False, **kwargs: Any) -> None:
            if not page:
                return fn(*args, **kwargs)
            about = host()  # before the measurement: the load it started under
            tee, stdout = _Tee(sys.stdout), sys.stdout
            sys.stdout = tee
            try:
                fn(*args, **kwargs)
            finally:
                sys.stdout = stdout
            path = write_page(name, title, tee.copy.getvalue(), about)
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            click.echo(f"wrote {shown}", err=True)

        return click.option(
            "--page", is_flag=True,
            help=f"Also write the result to docs/benchmarks/{name}.md with the host, torch "
                 f"version, commit and date.")(command)

    return decorate
