"""Ctrl-C, SIGTERM and SIGHUP as requests to stop, recorded for the whole life of a run.

The first signal is recorded; the loop reads it between steps, saves and raises ``Interrupted``.
A second one raises ``KeyboardInterrupt`` inside a step that still runs. A watchdog thread
hears every signal through ``signal.set_wakeup_fd`` (also while the main thread is stuck in C
code): a second signal, or a first not obeyed within ``MINITRAIN_STOP_GRACE`` seconds, wakes
the main thread; a process still alive a few seconds later exits 130 naming its checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from minitrain.train.script_errors import LIBRARY

__all__ = ["GRACE_ENV", "StopRequest", "stop_requests", "stop_signals"]

_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
GRACE_ENV = "MINITRAIN_STOP_GRACE"
DEFAULT_GRACE_S = 10.0
FORCE_AFTER_S = 5.0  # after waking the main thread, how long it has to save and exit


class StopRequest:
    """How many stop signals arrived, the first one's name, and whether the loop obeyed it."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None
        self.obeyed = False  # the loop read the request: it is saving and stopping
        self.live = True  # False once the run is over: a signal is then only counted

    @property
    def requested(self) -> bool:
        if self.count > 0:
            self.obeyed = True
        return self.count > 0

    def handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.first is None:
            self.first = signal.Signals(signum).name
        if self.count >= 2 and self.live and not self.obeyed:
            self.obeyed = True
            raise KeyboardInterrupt  # out of a stuck step; the loop saves the last finished one


_active: StopRequest | None = None


def stop_signals() -> tuple[int, ...]:
    """SIGINT, SIGTERM, and SIGHUP unless the process was started to ignore it (``nohup``)."""
    hangup = getattr(signal, "SIGHUP", None)
    return tuple(sig for sig in _SIGNALS
                 if not (sig == hangup and signal.getsignal(sig) is signal.SIG_IGN))


def grace_seconds() -> float:
    """``MINITRAIN_STOP_GRACE`` (seconds a first stop signal may wait for the step), else 10."""
    try:
        value = float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE_S)
    except ValueError:
        value = -1.0
    return value if value > 0 else DEFAULT_GRACE_S


def _ignore_stops_at_exit() -> None:
    """At interpreter exit Python puts default handlers back (a late SIGTERM would kill the
    process after its result was saved and printed); ignore the signals instead."""
    for sig in _SIGNALS:
        handler = signal.getsignal(sig)
        if isinstance(getattr(handler, "__self__", None), StopRequest):
            signal.signal(sig, signal.SIG_IGN)


def doing(thread_id: int) -> tuple[str, int, bool]:
    """The innermost function of ``thread_id``'s stack outside minitrain and installed
    packages (the script's, e.g. ``next_batch``; else the innermost), its frame's id, and
    whether it is the script's."""
    frame = sys._current_frames().get(thread_id)
    innermost = frame
    while frame is not None and frame.f_code.co_filename.startswith(LIBRARY):
        frame = frame.f_back
    script, frame = frame is not None, frame or innermost
    return (frame.f_code.co_name, id(frame), script) if frame is not None else ("?", 0, False)


class _Watchdog(threading.Thread):
    """Hears the stop signals even while the main thread is stuck; see the module docstring."""

    def __init__(self, request: StopRequest, stops: tuple[int, ...]) -> None:
        super().__init__(name="minitrain-stop-watchdog", daemon=True)
        self.request, self.stops, self.grace = request, stops, grace_seconds()
        self.main = threading.main_thread().ident or 0
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self.done = False
        self.where, self.since = doing(self.main), time.monotonic()

    def close(self) -> None:
        self.done = True
        signal.set_wakeup_fd(self.previous_fd)
        with contextlib.suppress(OSError):
            self.writer.send(b"\0")
        self.join(timeout=1.0)
        self.reader.close()
        self.writer.close()

    def run(self) -> None:
        count, deadline, woke, reason = 0, None, None, ""
        while not self.done:
            wait = [d - time.monotonic() for d in (deadline, woke) if d is not None]
            if select.select([self.reader], [], [], max(0.0, min(wait, default=1.0)))[0]:
                count += sum(byte in self.stops for byte in self.reader.recv(256))
            now, where = time.monotonic(), doing(self.main)
            if where != self.where:  # the main thread moved on: progress
                self.where, self.since = where, now
            if self.done or not count:
                continue
            if deadline is None:
                deadline = now + self.grace
                if self.where[2]:
                    _note_hang(self.where[0], now - self.since)
            if woke is None and (count >= 2 or now >= deadline):
                woke = now + FORCE_AFTER_S
                reason = "a second stop signal" if count >= 2 else (
                    f"no stop within {self.grace:g} s of a stop signal")
                if not self.request.obeyed:
                    with contextlib.suppress(OSError, ValueError):
                        signal.pthread_kill(self.main, signal.SIGINT)
            elif woke is not None and now >= woke:
                _force_exit(reason, self.where[0], now - self.since)


def _note_hang(where: str, seconds: float) -> None:
    """In a ``--nproc`` worker stopped by the launcher: leave what this rank was doing."""
    if "RANK" in os.environ and seconds >= 2.0:
        from minitrain.distributed import leave_report  # torch.distributed: only in a worker

        rank = os.environ["RANK"]
        leave_report("hang", f"rank {rank} made no progress for {seconds:.0f} s in {where}")


def _force_exit(reason: str, where: str, seconds: float) -> None:
    """Exit 130 at once, naming the newest checkpoint of the run directory this process holds."""
    from minitrain import checkpoint, rundir

    kept = []
    with contextlib.suppress(Exception):
        kept = [c for d in rundir.held() for c in checkpoint.list_checkpoints(d)[-1:]]
    saved = (f"the last good checkpoint is {kept[-1]}; continue with --resume" if kept
             else "no checkpoint was saved")
    message = (f"error: stopped ({reason}); the run made no progress for {seconds:.0f} s in "
               f"{where} and did not stop; {saved}\n")
    if "RANK" in os.environ:  # a --nproc worker: its launcher says it if the stop was the user's
        from minitrain.distributed import leave_report

        if leave_report("forced", message):
            os._exit(130)
    with contextlib.suppress(OSError):
        os.write(2, message.encode())
    os._exit(130)


@contextlib.contextmanager
def stop_requests(keep_until_exit: bool = False) -> Iterator[StopRequest]:
    """Install the recording handler and the watchdog; yield the :class:`StopRequest` (nested
    uses share it). With ``keep_until_exit=True`` a signal during shutdown is recorded, not fatal.
    """
    global _active
    if _active is not None:
        yield _active
        return
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    stops = stop_signals()
    previous = {sig: signal.signal(sig, request.handle) for sig in stops}
    watchdog = _Watchdog(request, stops)
    watchdog.start()
    _active = request
    if keep_until_exit:
        atexit.register(_ignore_stops_at_exit)
    try:
        yield request
    finally:
        _active, request.live = None, False
        watchdog.close()
        if not keep_until_exit:
            for sig, old in previous.items():
                signal.signal(sig, old)
