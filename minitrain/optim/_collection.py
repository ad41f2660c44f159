"""Automatic garbage collection held off from an update's last check to its kernel.

A collection can start at any allocation and runs the finalizers (``__del__``) and weakref
callbacks of whatever it frees: the caller's code, which could resize a storage that a kernel,
already handed its pointer, then writes past. Holding collection over the check-to-kernel
window closes that way in; the garbage is collected at the next allocation after it. (Another
Python thread, run while a torch op releases the GIL, and a Python signal handler stay able to
run there: a thread that resizes an update's tensors during the update races it on any path.)
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["COLLECTION_HELD", "holding_collection"]

F = TypeVar("F", bound=Callable)


class _CollectionHeld:
    """``with COLLECTION_HELD:`` disables automatic collection inside, and restores it when the
    outermost ``with`` ends (nested and concurrent holds share one count, so one thread's exit
    does not re-enable collection under another's kernel). Collection the caller disabled stays
    disabled.

    >>> import gc
    >>> with COLLECTION_HELD:
    ...     gc.isenabled()
    False
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._restore = False

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._restore = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._restore:
                gc.enable()


COLLECTION_HELD = _CollectionHeld()


def holding_collection(function: F) -> F:
    """``function`` run inside ``with COLLECTION_HELD:`` (for functions that check tensors, then
    hand their pointers to a kernel); traced by ``torch.compile``, which runs no kernel of
    ours, it is ``function`` itself."""

    @functools.wraps(function)
    def held(*args, **kwargs):
        if torch.compiler.is_compiling():
            return function(*args, **kwargs)
        with COLLECTION_HELD:
            return function(*args, **kwargs)

    return held  # type: ignore[return-value]
