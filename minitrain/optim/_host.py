"""Scalars of optimizer state made on the host: a state's counts, lrs and flags stay on the
CPU (as with no default device set) whatever ``torch.set_default_device`` says."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["zero_count", "host_tensor"]


def zero_count() -> Tensor:
    """A state's update count, 0-d int64 on the host: counts, lrs and flags of a state stay
    on the CPU (as with no default device set) under ``torch.set_default_device``.

    >>> zero_count()
    tensor(0)
    """
    return torch.zeros((), dtype=torch.int64, device="cpu")


def host_tensor(value: Any, dtype: torch.dtype) -> Tensor:
    """``torch.as_tensor(value, dtype=dtype)``, a Python number made on the CPU whatever
    ``torch.set_default_device`` says (a tensor stays on its device).

    >>> host_tensor(0.5, torch.float64)
    tensor(0.5000, dtype=torch.float64)
    """
    return torch.as_tensor(value, dtype=dtype,
                           device=value.device if isinstance(value, Tensor) else "cpu")
