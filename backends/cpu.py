"""The CPU backends: ``cpu`` (fp32 everywhere) and ``cpu-bf16`` (bf16 autocast, fp32 params).

``cpu-bf16`` exercises the same autocast code path as CUDA mixed precision, so it is tested
on any machine.

>>> backend = cpu_bf16()
>>> with backend.autocast():
...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
torch.bfloat16
"""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch

from minitrain.backend import autocast_context, move_to_device


@dataclass(frozen=True)
class CPUBackend:
    """Tensors in host memory; fp32 master params; math in ``compute_dtype``."""

    name: str = "cpu"
    device: torch.device = torch.device("cpu")
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32

    def is_available(self) -> tuple[bool, str]:
        return True, "host CPU"

    def autocast(self) -> ContextManager[Any]:
        return autocast_context("cpu", self.compute_dtype, self.param_dtype)

    def synchronize(self) -> None:
        """CPU ops run synchronously: nothing to wait for."""

    def to_device(self, batch: Any) -> Any:
        return move_to_device(batch, self.device)

    def memory_allocated(self) -> int | None:
        return None

    def max_memory_allocated(self) -> int | None:
        return None

    def reset_peak_memory(self) -> None:
        """The CPU allocator keeps no peak statistics (the accounting counter tracks them)."""

    def peak_flops(self) -> float | None:
        from minitrain.accounting import hardware

        return hardware("cpu").peak_flops[_DTYPE_NAMES[self.compute_dtype]]


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def cpu() -> CPUBackend:
    """The default backend: fp32 params and math on the host CPU."""
    return CPUBackend()


def cpu_bf16() -> CPUBackend:
    """bf16 autocast on the CPU over fp32 master params (mixed precision, as on CUDA)."""
    return CPUBackend(name="cpu-bf16", compute_dtype=torch.bfloat16)
