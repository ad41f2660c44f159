"""The CUDA backend: bf16 autocast over fp32 master params (the chapter's 3.5.9 recipe).

Params, grads and optimizer state stay fp32; matmuls in the forward and backward pass run in
bf16 under ``torch.autocast("cuda", dtype=torch.bfloat16)``. Batches are pinned and copied
with ``non_blocking=True``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from minitrain.backend import autocast_context, move_to_device


@dataclass(frozen=True)
class CUDABackend:
    """One CUDA device, bf16 autocast, fp32 master weights."""

    name: str = "cuda"
    device: torch.device = field(default_factory=lambda: torch.device("cuda", 0))
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.bfloat16

    def is_available(self) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            return False, (
                f"no CUDA GPU here (torch {torch.__version__}: {build}); "
                "use --backend cpu, or install a CUDA build of torch on a GPU machine"
            )
        return True, torch.cuda.get_device_name(self.device)

    def autocast(self) -> ContextManager[Any]:
        return autocast_context("cuda", self.compute_dtype, self.param_dtype)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def to_device(self, batch: Any) -> Any:
        return move_to_device(batch, self.device, pin_memory=True)

    def memory_allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_flops(self) -> float | None:
        from minitrain.accounting import hardware_for_cuda_device

        spec = hardware_for_cuda_device(torch.cuda.get_device_name(self.device))
        return None if spec is None else spec.peak_flops["bf16"]


def cuda() -> CUDABackend:
    """The CUDA backend on device 0."""
    return CUDABackend()
