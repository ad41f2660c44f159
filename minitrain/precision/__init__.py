"""Precision: backends, policies, loss scaling, simulated low-precision matmuls, number formats.

Modules: ``backend`` (the :class:`Backend` record and its entry-point registry), ``policies``
(the one vocabulary of precisions), ``loss_scale``, ``matmuls`` and ``simulation`` (fp8 and MX
/ NVFP4 matmuls simulated bit for bit), ``formats`` and ``rounding``. Names load on first use;
policies and formats need no torch.

>>> import minitrain as mt
>>> mt.precision.policy("fp16").loss_scaling, mt.precision.spec("bf16").bits
(True, 16)
"""

from __future__ import annotations

import importlib
from typing import Any

# Each module's __all__, written out so that no module loads before one of its names is used;
# the torch-free modules come first.
_NAMES = {
    "policies": ("POLICIES", "PRECISIONS", "Policy", "Precision", "element_bytes", "policy",
                 "without_matmul_format"),
    "formats": ("FormatSpec", "FORMATS", "spec"),
    "backend": ("ENTRY_POINT_GROUP", "FP8_MIN_CAPABILITY", "Backend", "BackendError",
                "BackendStatus", "available_backends", "backend_statuses", "compute_context",
                "delayed_scaling", "fp8_support", "get_backend", "register_backend"),
    "loss_scale": ("DynamicLossScale", "LossScaleState", "all_finite", "dynamic_loss_scale",
                   "scaled_value_and_grad", "select_tree"),
    "matmuls": ("AMAX_FLOOR", "RECIPES", "Recipe", "amax_to_scale", "delayed_scale", "linear",
                "matmul", "quantize_operand", "recipe", "scaled_mm_operands"),
    "simulation": ("count_matmuls", "init_state", "recompute_context", "simulate"),
    "rounding": ("ErrorStats", "quantize", "decode", "values", "error_stats"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*_NAMES, *__all__})
