"""Backends built from precision policies: fp16 with loss scaling, simulated fp8 / MX / NVFP4,
and real fp8 matmuls on GPUs that have them.

Each factory returns a small frozen record with the :class:`minitrain.backend.Backend`
protocol's attributes, plus ``policy`` (:class:`minitrain.precision.Policy`): a training loop
reads ``backend.policy.loss_scaling`` to carry a dynamic loss scale, and ``backend.autocast()``
is :func:`minitrain.precision.compute_context` for the policy. They register like any backend::

    [project.entry-points."minitrain.backends"]
    cpu-fp16 = "minitrain.precision_backends:cpu_fp16"

>>> backend = cpu_fp8()
>>> backend.name, backend.param_dtype, backend.policy.matmul_format, backend.is_available()[0]
('cpu-fp8', torch.float32, 'fp8', True)
"""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from minitrain.backend import move_to_device
from minitrain.precision import Policy, compute_context, policy

__all__ = [
    "PrecisionBackend",
    "cpu_fp16",
    "cpu_fp8",
    "cpu_mxfp8",
    "cpu_mxfp4",
    "cpu_nvfp4",
    "cuda_fp16",
    "cuda_fp8",
    "FP8_MIN_CAPABILITY",
]

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores

_PEAK_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cuda_reason(device: torch.device) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
        return False, (
            f"no CUDA GPU here (torch {torch.__version__}: {build}); use a cpu-* backend, or "
            "install a CUDA build of torch on a GPU machine"
        )
    return True, torch.cuda.get_device_name(device)


def _fp8_reason(device: torch.device, capability: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether a GPU of ``capability`` can run ``torch._scaled_mm``, in one line."""
    if capability is None:
        return _cuda_reason(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = capability
        return False, (
            f"fp8 matmuls need compute capability >= 8.9 (Ada, Hopper, Blackwell), this GPU "
            f"has {major}.{minor}; use cuda (bf16) or cpu-fp8 to simulate fp8"
        )
    return True, f"compute capability {capability[0]}.{capability[1]}"


@dataclass(frozen=True)
class PrecisionBackend:
    """A device plus a precision policy (fp32 master params in every preset)."""

    name: str
    device: torch.device
    policy: Policy
    peak_key: str | None = None  # the hardware registry's peak to use for MFU
    needs_fp8: bool = False
    _capability: Any = field(default=None, repr=False)  # for tests: a pretended GPU

    @property
    def param_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    def is_available(self) -> tuple[bool, str]:
        if self.device.type == "cpu":
            return True, "host CPU"
        if self.needs_fp8:
            capability = self._capability
            if capability is None and torch.cuda.is_available():
                capability = torch.cuda.get_device_capability(self.device)
            return _fp8_reason(self.device, capability)
        return _cuda_reason(self.device)

    def autocast(self) -> ContextManager[Any]:
        return compute_context(self.policy, self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def to_device(self, batch: Any) -> Any:
        return move_to_device(batch, self.device, pin_memory=self.device.type == "cuda")

    def memory_allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None

    def max_memory_allocated(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_flops(self) -> float | None:
        from minitrain.accounting import hardware, hardware_for_cuda_device

        key = self.peak_key or _PEAK_KEYS.get(self.compute_dtype)
        if self.device.type == "cpu":
            spec = hardware("cpu")
        elif not torch.cuda.is_available():
            return None
        else:
            spec = hardware_for_cuda_device(torch.cuda.get_device_name(self.device))
        return None if spec is None else spec.peak_flops.get(key)


_CPU = torch.device("cpu")


def cpu_fp16() -> PrecisionBackend:
    """fp16 autocast on the CPU over fp32 master params, with dynamic loss scaling."""
    return PrecisionBackend("cpu-fp16", _CPU, policy("fp16"))


def cpu_fp8() -> PrecisionBackend:
    """Simulated fp8 matmuls (e4m3 forward, e5m2 backward, fp32 accumulation) on the CPU."""
    return PrecisionBackend("cpu-fp8", _CPU, policy("fp8"))


def cpu_mxfp8() -> PrecisionBackend:
    """Simulated MXFP8 matmuls (32-element blocks, e8m0 scales) on the CPU."""
    return PrecisionBackend("cpu-mxfp8", _CPU, policy("mxfp8"))


def cpu_mxfp4() -> PrecisionBackend:
    """Simulated MXFP4 matmuls on the CPU."""
    return PrecisionBackend("cpu-mxfp4", _CPU, policy("mxfp4"))


def cpu_nvfp4() -> PrecisionBackend:
    """Simulated NVFP4 matmuls (16-element blocks, e4m3 and fp32 scales) on the CPU."""
    return PrecisionBackend("cpu-nvfp4", _CPU, policy("nvfp4"))


def cuda_fp16() -> PrecisionBackend:
    """fp16 autocast on CUDA device 0 over fp32 master params, with dynamic loss scaling."""
    return PrecisionBackend("cuda-fp16", torch.device("cuda", 0), policy("fp16"))


def cuda_fp8(capability: tuple[int, int] | None = None) -> PrecisionBackend:
    """fp8 matmuls on fp8 tensor cores through ``torch._scaled_mm`` (e4m3 forward, e5m2
    backward, per-tensor scales), the rest in bf16 autocast; GPUs of compute capability >= 8.9.

    >>> cuda_fp8(capability=(8, 0)).is_available()[1]  # doctest: +ELLIPSIS
    'fp8 matmuls need compute capability >= 8.9 (Ada, Hopper, Blackwell), this GPU has 8.0; ...'
    """
    p = Policy(torch.float32, torch.bfloat16, torch.float32, matmul_format="fp8-scaled-mm")
    return PrecisionBackend(
        "cuda-fp8", torch.device("cuda", 0), p, "fp8", needs_fp8=True, _capability=capability
    )
