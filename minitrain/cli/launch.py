"""Starting ``--nproc N`` workers under torch's elastic agent, and ending each one cleanly."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import click
import torch.distributed as dist

from minitrain.cli.errors import LostPeer, RunFailed, RunInterrupted
from minitrain.distributed import REPORTS_ENV, DataParallel, leave_report
from minitrain.errors import DistributedError

__all__ = ["REPORTS_ENV", "forward_argv", "launch", "worker_outcome"]


def forward_argv(ctx: Any, drop: Sequence[str] = ()) -> list[str]:
    """Rebuild the command line of a click context from its parsed values, minus ``drop``."""
    argv: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in drop or value is None:
            continue
        if isinstance(param, click.Argument):
            argv.extend(str(v) for v in (value if param.multiple else [value]))
            continue
        assert isinstance(param, click.Option)
        if param.is_flag:
            if param.secondary_opts:
                argv.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                argv.append(param.opts[0])
            continue
        for item in value if param.multiple else [value]:
            argv.extend([param.opts[0], str(item)])
    return argv


@contextlib.contextmanager
def _quiet_elastic() -> Iterator[None]:
    """The elastic agent logs each step of its work; keep its warnings out of the user's way."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def launch(nproc: int, argv: Sequence[str], monitor_interval: float = 0.1) -> None:
    """Run ``python -m minitrain *argv`` in ``nproc`` workers under the elastic agent.

    A failed worker stops the others; this then raises ``SystemExit`` with its exit code or
    :class:`DistributedError` naming the root cause.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    with tempfile.TemporaryDirectory(prefix="minitrain-elastic-") as log_dir, _quiet_elastic():
        reports = Path(log_dir) / "reports"
        reports.mkdir()
        # rdzv as `torchrun --standalone`: a TCP store on a free port.
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
            monitor_interval=monitor_interval, logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        # What the workers inherit: the reports folder, and (as torchrun does, unless the user
        # chose) the cores split between them.
        environ = {REPORTS_ENV: str(reports)}
        if "OMP_NUM_THREADS" not in os.environ:
            environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        try:
            with mock.patch.dict(os.environ, environ):
                elastic_launch(config, sys.executable)("-m", "minitrain", *argv)
        except ChildFailedError as exc:
            _show_first_failure(exc, _read_reports(reports, "failed"))
            hangs = _read_reports(reports, "hang")
            if hangs:  # a rank stuck in the script; the others' lost peers are consequences
                raise DistributedError(hangs[min(hangs)]) from None
            _raise_failure(exc, _read_reports(reports))
        except SignalException as exc:
            # Ctrl-C and SIGTERM reach the workers too, which save and exit 130 (the agent
            # waits for them); the job ends as a stopped run, not a killed one. A worker that
            # did not stop left why (after another rank's failure, that failure says it).
            if forced := _read_reports(reports, "forced"):
                click.echo(forced[min(forced)], err=True)
            stopped = exc.sigval in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            raise SystemExit(130 if stopped else 128 + int(exc.sigval)) from None


# Exit codes of a worker that printed its own one-line error (see minitrain.cli.errors).
_REPORTED_EXIT_CODES = (1, 2, 130)


def _read_reports(folder: Path, kind: str = "rank") -> dict[int, str]:
    """The messages workers left in ``folder`` (``<kind>-N``), by rank."""
    reports = {}
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            rank_text = path.name.removeprefix(f"{kind}-")
            if path.name.startswith(f"{kind}-") and rank_text.isdigit():
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    reports[int(rank_text)] = path.read_text(encoding="utf-8").strip()
    return {rank_: text for rank_, text in reports.items() if text}


def _show_first_failure(exc: Any, failed: Mapping[int, str]) -> None:
    """Print the error of the rank that failed first on its own (the script's frames and its
    one line), and exit with its code; nothing when no rank reported one."""
    if not failed:
        return
    failures = exc.failures
    first = min(failed, key=lambda r: (failures[r].timestamp if r in failures else 0.0, r))
    click.echo(failed[first], err=True)
    code = failures[first].exitcode if first in failures else 1
    raise SystemExit(code if code in _REPORTED_EXIT_CODES else 1)


def _raise_failure(exc: Any, lost_peers: Mapping[int, str] | None = None) -> None:
    """Turn ``ChildFailedError`` into one message naming the root cause.

    In order: a rank killed by a signal, a rank that failed on its own, the first that lost peers.
    """
    failures = exc.failures
    lost_peers = lost_peers or {}
    # A signal (SIGKILL, OOM killer...) other than the agent's own SIGTERM is the root cause.
    killed = {
        r: f for r, f in failures.items() if f.exitcode < 0 and -f.exitcode != signal.SIGTERM
    }
    own = {
        r: f for r, f in failures.items()
        if r not in lost_peers and not (f.exitcode < 0 and -f.exitcode == signal.SIGTERM)
    }
    if not killed and not own and lost_peers:
        raise DistributedError(lost_peers[min(lost_peers)])
    rank_, failure = min(
        (killed or own or failures).items(), key=lambda item: (item[1].timestamp, item[0])
    )
    if failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        raise DistributedError(
            f"worker rank {rank_} (pid {failure.pid}) was killed by {name}; "
            "the other workers were stopped"
        )
    if failure.exitcode in _REPORTED_EXIT_CODES:
        raise SystemExit(failure.exitcode)
    raise DistributedError(
        f"worker rank {rank_} (pid {failure.pid}) exited with code {failure.exitcode}; "
        "the other workers were stopped"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _lost_peer(exc: RuntimeError) -> bool:
    """Whether a collective failed because another rank went away (or timed out)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        marker in text for marker in ("connection closed", "connection reset", "timed out",
                                      "gloo", "nccl", "broken pipe")
    )


@contextlib.contextmanager
def worker_outcome(parallel: DataParallel) -> Iterator[None]:
    """Around one worker's part of a command: end it as the whole job should.

    A stop by signal reaches every rank: they end with a barrier and rank 0 prints it. A rank's
    own failure exits at once, its error to the launcher (which prints the first failing
    rank's, once); a lost peer goes to the launcher's reports.
    """
    code = 0
    try:
        yield
    except LostPeer as exc:
        _lost_peer_exit(parallel.rank, exc.format_message())
    except RunInterrupted as exc:
        if parallel.is_main:
            exc.show()
        code = exc.exit_code
    except click.ClickException as exc:  # the others may be waiting for this rank
        _failed_exit(parallel.rank, exc)
    except DistributedError as exc:
        if getattr(exc, "lost_peer", False):
            _lost_peer_exit(parallel.rank, str(exc))
        _failed_exit(parallel.rank, RunFailed(str(exc)))
    except RuntimeError as exc:  # gloo and NCCL report a lost peer as a RuntimeError
        if not _lost_peer(exc):
            raise
        _lost_peer_exit(parallel.rank, f"lost the other workers: {_first_line(exc)}")
    with contextlib.suppress(dist.DistError, RuntimeError):
        parallel.barrier()
    parallel.close()
    if code:
        sys.exit(code)


def _failed_exit(rank_: int, exc: click.ClickException) -> None:
    """Exit at once after this rank's own failure, without waiting for the others: its message
    (with the script's frames) goes to the ``--nproc`` launcher's reports folder, which prints
    the first failing rank's, or to stderr under torchrun."""
    exc.message = f"rank {rank_}: {exc.message}"
    text = io.StringIO()
    exc.show(file=text)
    if not leave_report("failed", text.getvalue(), rank_):
        click.echo(text.getvalue(), err=True, nl=False)
    sys.exit(exc.exit_code)


def _lost_peer_exit(rank_: int, message: str) -> None:
    """Exit 1 after losing the other workers: the message goes to the launcher's reports
    folder when ``--nproc`` started this worker (it names the root cause), else to stderr."""
    text = f"rank {rank_}: {message}"
    if not leave_report("rank", text, rank_):
        click.echo(f"error: {text}", err=True)
    sys.exit(1)
