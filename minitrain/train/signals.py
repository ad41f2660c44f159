"""Ctrl-C, SIGTERM and SIGHUP as requests to stop, recorded for the whole life of a run.

The handler only records (so a burst of signals cannot break a checkpoint being written); the
loop reads it between steps, saves the last finished step and raises ``Interrupted``.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["StopRequest", "stop_requests", "stop_signals"]

_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class StopRequest:
    """How many stop signals arrived, and the first one's name."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    @property
    def requested(self) -> bool:
        return self.count > 0

    def handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.first is None:
            self.first = signal.Signals(signum).name


_active: StopRequest | None = None


def stop_signals() -> tuple[int, ...]:
    """SIGINT, SIGTERM, and SIGHUP unless the process was started to ignore it (``nohup``)."""
    hangup = getattr(signal, "SIGHUP", None)
    ignored = hangup is not None and signal.getsignal(hangup) is signal.SIG_IGN
    return tuple(sig for sig in _SIGNALS if not (sig == hangup and ignored))


def _ignore_stops_at_exit() -> None:
    """At interpreter exit Python puts default handlers back (a late SIGTERM would kill the
    process after its result was saved and printed); ignore the signals instead."""
    for sig in _SIGNALS:
        handler = signal.getsignal(sig)
        if isinstance(getattr(handler, "__self__", None), StopRequest):
            signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def stop_requests(keep_until_exit: bool = False) -> Iterator[StopRequest]:
    """Install the recording handler; yield the :class:`StopRequest` (nested uses share it).

    With ``keep_until_exit=True`` a signal during shutdown is recorded, not fatal.
    """
    global _active
    if _active is not None:
        yield _active
        return
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in stop_signals()}
    _active = request
    if keep_until_exit:
        atexit.register(_ignore_stops_at_exit)
    try:
        yield request
    finally:
        _active = None
        if not keep_until_exit:
            for sig, old in previous.items():
                signal.signal(sig, old)
