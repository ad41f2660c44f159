"""Backends: one record of a device and a precision policy, found through entry points.

A :class:`Backend`'s :meth:`~Backend.autocast` is :func:`compute_context`, the one context a
train step wraps its forward and backward pass in (nanoGPT's ``nullcontext()`` or
``torch.amp.autocast(...)``, plus the simulated matmuls). Backends register under the
entry-point group ``minitrain.backends``, as the repository's ``backends/`` package does::

    [project.entry-points."minitrain.backends"]
    my-fp16 = "my_package.backends:my_fp16"    # a Backend, or a function returning one

>>> import minitrain as mt
>>> backend = mt.get_backend("cpu")
>>> backend.name, str(backend.device), backend.policy.name, backend.compute_dtype
('cpu', 'cpu', 'fp32', torch.float32)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, NamedTuple

import torch

from minitrain.errors import ExperimentError, UserError
from minitrain.precision.matmuls import PER_TENSOR, Recipe, recipe
from minitrain.precision.policies import Policy, policy
from minitrain.precision.simulation import simulate
from minitrain.tree import map as tree_map
from minitrain.tree import named_leaves

__all__ = [
    "ENTRY_POINT_GROUP", "FP8_MIN_CAPABILITY", "Backend", "BackendError", "BackendStatus",
    "available_backends", "backend_statuses", "compute_context", "delayed_scaling",
    "fp8_support", "get_backend", "register_backend",
]

ENTRY_POINT_GROUP = "minitrain.backends"
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (sm_90) and Blackwell have fp8 tensor cores


class BackendError(UserError):
    """An unknown backend name, or a backend this machine cannot run."""


@contextlib.contextmanager
def compute_context(
    p: Policy | str, device: torch.device | str = "cpu", fp8_state: torch.Tensor | None = None
) -> Iterator[None]:
    """The context for forward and backward: autocast to ``compute`` where it differs from
    ``param``, simulated matmuls where the policy names a format (``fp8_state``: amax
    histories, see :func:`minitrain.precision.simulate`).

    >>> with compute_context("bf16", "cpu"):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    >>> with compute_context("fp8"):
    ...     (torch.tensor([[1.0, 3.3]]) @ torch.eye(2)).tolist()
    [[0.9428570866584778, 3.299999713897705]]
    """
    p = policy(p)
    with contextlib.ExitStack() as stack:
        if p.compute != p.param:
            device_type = torch.device(device).type
            stack.enter_context(torch.autocast(device_type=device_type, dtype=p.compute_dtype))
        if p.matmul_format is not None:
            stack.enter_context(simulate(p.matmul_format, fp8_state))
        yield


def delayed_scaling(p: Policy | str) -> Recipe | None:
    """The fp8 recipe whose scales a run takes from an amax history (TE's ``DelayedScaling``),
    or None (block formats, or no matmul format).

    >>> delayed_scaling("fp8").history_len, delayed_scaling("mxfp8"), delayed_scaling("bf16")
    (16, None, None)
    """
    p = policy(p)
    if p.matmul_format is None:
        return None
    r = recipe(p.matmul_format)
    return r if r.forward in PER_TENSOR else None


def on_tensor_cores(p: Policy) -> bool:
    """Whether ``p``'s matmuls run as real fp8 GEMMs (``torch._scaled_mm``), not simulated."""
    return p.matmul_format is not None and recipe(p.matmul_format).gemm == "scaled_mm"


def fp8_support(capability: tuple[int, int]) -> tuple[bool, str]:
    """Whether a GPU of compute ``capability`` has fp8 tensor cores, and why not, in one line.

    >>> fp8_support((8, 0))[1]  # doctest: +ELLIPSIS
    'fp8 matmuls need compute capability >= 8.9 (Ada, Hopper, Blackwell), this GPU has 8.0; ...'
    """
    major, minor = capability
    if (major, minor) < FP8_MIN_CAPABILITY:
        return False, (
            f"fp8 matmuls need compute capability >= 8.9 (Ada, Hopper, Blackwell), this GPU "
            f"has {major}.{minor}; use cuda (bf16) or cpu-fp8 to simulate fp8"
        )
    return True, f"compute capability {major}.{minor}"


@dataclass(frozen=True)
class Backend:
    """A device and the precision policy that runs on it (each may be given by name).

    >>> b = Backend("cpu-fp16", "cpu", "fp16")
    >>> b.device, b.policy.loss_scaling, b.param_dtype, b.compute_dtype
    (device(type='cpu'), True, torch.float32, torch.float16)
    """

    name: str
    device: torch.device | str  # a torch.device once built
    policy: Policy | str  # a Policy once built

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "policy", policy(self.policy))

    @property
    def param_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    def is_available(self) -> tuple[bool, str]:
        """``(usable, reason)``: whether this machine can run the backend, and why not."""
        kind = self.device.type
        if kind == "cpu":
            return True, "host CPU"
        if kind == "cuda" and not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            return False, (
                f"no CUDA GPU here (torch {torch.__version__}: {build}); use a cpu backend "
                "(cpu, cpu-bf16, cpu-fp16, cpu-fp8, ...), or install a CUDA build of torch on a "
                "GPU machine"
            )
        if kind == "cuda" and on_tensor_cores(self.policy):
            return fp8_support(torch.cuda.get_device_capability(self.device))
        if kind == "cuda":
            return True, torch.cuda.get_device_name(self.device)
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            return True, f"{kind} device"
        return False, f"no {kind} device here"

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The precision context for forward and backward (a no-op for pure fp32)."""
        return compute_context(self.policy, self.device)

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work (for honest timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type != "cpu":  # the CPU runs ops synchronously
            getattr(torch, self.device.type).synchronize()

    def to_device(self, batch: Any) -> Any:
        """Every tensor leaf of ``batch`` on ``device``; CPU tensors bound for a GPU are pinned
        and copied ``non_blocking`` to overlap with compute (the chapter's 3.5.4).

        >>> Backend("cpu", "cpu", "fp32").to_device({"x": torch.ones(2)})
        {'x': tensor([1., 1.])}
        """
        pin = self.device.type == "cuda"

        def move(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or leaf.device == self.device:
                return leaf
            if leaf.device.type == "meta":
                name = next(n for n, t in named_leaves(batch) if t is leaf)
                raise ExperimentError(
                    f"the batch has a meta tensor (no data) at {name!r}; next_batch must return "
                    "tensors with data (drop device='meta')")
            if pin and leaf.device.type == "cpu":
                return leaf.pin_memory().to(self.device, non_blocking=True)
            return leaf.to(self.device)

        return tree_map(move, batch)


class BackendStatus(NamedTuple):
    """One line of ``minitrain backends``: a name, whether it runs here, its precision."""

    name: str
    usable: bool
    reason: str
    source: str
    precision: str


_REGISTERED: dict[str, Backend | Callable[[], Backend]] = {}


def register_backend(name: str, backend: Backend | Callable[[], Backend]) -> None:
    """Register a backend (or a function returning one) in this process; entry points are the
    persistent way."""
    _REGISTERED[name] = backend
    _entry_points.cache_clear()


@functools.cache
def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _sources() -> dict[str, Any]:
    return {**_entry_points(), **_REGISTERED}


def available_backends() -> list[str]:
    """Names of the installed backends (usable on this machine or not).

    >>> {"cpu", "cuda"} <= set(available_backends())
    True
    """
    return sorted(_sources())


def _load(name: str) -> Backend:
    found = _sources()[name]
    if isinstance(found, metadata.EntryPoint):
        found = found.load()
    backend = found if isinstance(found, Backend) else found()
    if not isinstance(backend, Backend):
        raise BackendError(
            f"backend {name!r} is a {type(backend).__name__}, not a minitrain.precision.Backend; "
            "register a Backend(name, device, policy), or a function returning one"
        )
    return backend


def backend_statuses() -> list[BackendStatus]:
    """Every installed backend with whether it can run here and why not."""
    statuses = []
    for name in available_backends():
        found = _sources()[name]
        source = found.value if isinstance(found, metadata.EntryPoint) else "registered"
        backend = _load(name)
        usable, reason = backend.is_available()
        statuses.append(BackendStatus(name, usable, reason, source, backend.policy.name))
    return statuses


def get_backend(name: str = "auto") -> Backend:
    """The backend called ``name``; ``"auto"``: ``cuda`` when usable, else ``cpu``. An unknown
    name or a backend this machine cannot run is a :class:`BackendError` saying why.

    >>> get_backend("tpu-v9")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    minitrain.precision.backend.BackendError: unknown backend 'tpu-v9'; installed backends: cpu, ...
    """
    if name == "auto":
        cuda_ok = "cuda" in _sources() and _load("cuda").is_available()[0]
        name = "cuda" if cuda_ok else "cpu"
    if name not in _sources():
        raise BackendError(
            f"unknown backend {name!r}; installed backends: {', '.join(available_backends())}"
        )
    backend = _load(name)
    usable, reason = backend.is_available()
    if not usable:
        raise BackendError(f"backend {name!r} cannot run here: {reason}")
    return backend
