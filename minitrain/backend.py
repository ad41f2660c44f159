"""Backends: a small record of device and precision choices, discovered through entry points.

A backend says where tensors live (``device``), the dtype of the master params
(``param_dtype``) and of the math (``compute_dtype``), and gives the autocast context for the
forward and backward pass (nanoGPT's ``nullcontext()`` or ``torch.amp.autocast(...)``). It
also synchronizes the device, moves a batch there, reports memory, and knows its peak FLOP/s
for MFU. Backends register under the entry-point group ``minitrain.backends``: the
distribution ships ``cpu`` (fp32), ``cpu-bf16`` (bf16 autocast on CPU) and ``cuda`` (bf16
autocast over fp32 master params); another package adds its own the same way::

    [project.entry-points."minitrain.backends"]
    mydevice = "my_package.backend:factory"     # factory() -> Backend

>>> import minitrain as mt
>>> backend = mt.get_backend("cpu")
>>> backend.name, str(backend.device), backend.param_dtype, backend.compute_dtype
('cpu', 'cpu', torch.float32, torch.float32)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from importlib import metadata
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

__all__ = [
    "Backend",
    "BackendError",
    "BackendStatus",
    "ENTRY_POINT_GROUP",
    "available_backends",
    "backend_statuses",
    "get_backend",
    "move_to_device",
    "register_backend",
]

ENTRY_POINT_GROUP = "minitrain.backends"


class BackendError(ValueError):
    """An unknown backend name, or a backend this machine cannot run."""


@runtime_checkable
class Backend(Protocol):
    """What the training loop needs from a device: a record of choices plus a few actions."""

    name: str
    device: torch.device
    param_dtype: torch.dtype
    compute_dtype: torch.dtype

    def is_available(self) -> tuple[bool, str]:
        """``(usable, reason)``: whether this machine can run the backend, and why not."""
        ...

    def autocast(self) -> ContextManager[Any]:
        """The precision context for forward and backward (a no-op for pure fp32)."""
        ...

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work (for honest timings)."""
        ...

    def to_device(self, batch: Any) -> Any:
        """Move a pytree of CPU tensors to ``device`` (pinned + non_blocking where it helps)."""
        ...

    def memory_allocated(self) -> int | None:
        """Bytes allocated on the device now, or None where the device cannot tell."""
        ...

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated since the last :meth:`reset_peak_memory`, or None."""
        ...

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""
        ...

    def peak_flops(self) -> float | None:
        """Dense peak FLOP/s in ``compute_dtype`` (for MFU), or None if unknown."""
        ...


class BackendStatus(NamedTuple):
    """One line of ``minitrain backends``: a registered name and whether it runs here."""

    name: str
    usable: bool
    reason: str
    source: str


_EXTRA_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register a backend factory in this process (entry points are the persistent way)."""
    _EXTRA_FACTORIES[name] = factory
    _entry_points.cache_clear()


@functools.cache
def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _factories() -> dict[str, Callable[[], Backend] | metadata.EntryPoint]:
    return {**_entry_points(), **_EXTRA_FACTORIES}


def available_backends() -> list[str]:
    """Names of the installed backends (usable on this machine or not).

    >>> {"cpu", "cuda"} <= set(available_backends())
    True
    """
    return sorted(_factories())


def _load(name: str) -> Backend:
    factory = _factories()[name]
    if isinstance(factory, metadata.EntryPoint):
        factory = factory.load()
    backend = factory()
    if not isinstance(backend, Backend):
        raise BackendError(
            f"backend {name!r} did not produce a Backend (got {type(backend).__name__}); "
            f"its factory must return an object with the Backend protocol's attributes"
        )
    return backend


def backend_statuses() -> list[BackendStatus]:
    """Every installed backend with whether it can run here and why not."""
    statuses = []
    for name in available_backends():
        factory = _factories()[name]
        source = factory.value if isinstance(factory, metadata.EntryPoint) else "registered"
        usable, reason = _load(name).is_available()
        statuses.append(BackendStatus(name, usable, reason, source))
    return statuses


def get_backend(name: str = "auto") -> Backend:
    """The backend called ``name``; ``"auto"`` picks ``cuda`` when a GPU is usable, else ``cpu``.

    Raises :class:`BackendError` for an unknown name (listing the installed ones) or a backend
    this machine cannot run (saying why).

    >>> get_backend("tpu-v9")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    minitrain.backend.BackendError: unknown backend 'tpu-v9'; installed backends: cpu, ...
    """
    if name == "auto":
        cuda_ok = "cuda" in _factories() and _load("cuda").is_available()[0]
        name = "cuda" if cuda_ok else "cpu"
    if name not in _factories():
        raise BackendError(
            f"unknown backend {name!r}; installed backends: {', '.join(available_backends())}"
        )
    backend = _load(name)
    usable, reason = backend.is_available()
    if not usable:
        raise BackendError(f"backend {name!r} cannot run here: {reason}")
    return backend


def move_to_device(batch: Any, device: torch.device, pin_memory: bool = False) -> Any:
    """Move every tensor leaf of ``batch`` to ``device``.

    With ``pin_memory`` (for CUDA), CPU tensors are pinned first and copied with
    ``non_blocking=True``, so the copy overlaps with compute (the chapter's 3.5.4).

    >>> move_to_device({"x": torch.ones(2)}, torch.device("cpu"))
    {'x': tensor([1., 1.])}
    """

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device == device:
            return leaf
        if pin_memory and leaf.device.type == "cpu":
            return leaf.pin_memory().to(device, non_blocking=True)
        return leaf.to(device)

    return torch.utils._pytree.tree_map(move, batch)


def autocast_context(device_type: str, compute_dtype: torch.dtype, param_dtype: torch.dtype):
    """``torch.autocast`` when compute and param dtypes differ, else a no-op context."""
    if compute_dtype == param_dtype:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=compute_dtype)
