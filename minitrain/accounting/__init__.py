"""Resource accounting: napkin math, hardware specs, FLOP/byte counting, live reports.

The napkin math and the hardware registry import without torch; :class:`Counter`,
:func:`predict_step` (a step on fake tensors), :func:`resource_report` and ``roofline`` use it.
Every name loads its module on first use.

>>> import minitrain as mt
>>> flops = mt.accounting.training_flops(params=70e9, tokens=15e12)
>>> round(mt.accounting.training_time(flops, hardware="h100", gpus=1024, mfu=0.5) / 86400)
144
"""

from __future__ import annotations

import importlib
from typing import Any

# The function, bound before any submodule import could set the package's ``hardware``
# attribute to the module of the same name.
from minitrain.accounting.hardware import hardware

# The table of contents: each module and the public names it defines.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "units": ("SECONDS_PER_DAY", "round_significant"),
    "flops": ("allreduce_bytes", "allreduce_seconds", "communication_time", "cruncher_flops",
              "effective_throughput", "optimizer_flops_per_element", "training_flops",
              "training_time"),
    "hardware": ("Hardware", "HardwareError", "backend_peak_flops", "cpu_peak_bound", "dtype_name",
                 "hardware_for_cuda_device", "hardware_names", "measure_cpu"),
    "memory": ("OPTIMIZER_STATES", "PRECISIONS", "BytesPerParam", "MemoryBreakdown",
               "bytes_per_param", "max_params", "optimizer_state_elements", "optimizer_states",
               "state_bytes", "training_memory", "ZeroMemory", "zero_memory"),
    "transformer": ("PRESETS", "TransformerConfig", "preset", "transformer_activation_bytes",
                    "transformer_activation_terms", "transformer_flops_per_token",
                    "transformer_matmul_params",
                    "transformer_memory", "transformer_optimizer_state_elements",
                    "transformer_params", "transformer_tensors"),
    "counter": ("Counter", "OpRecord"),
    "predict": ("PredictionError", "StepPrediction", "TensorSpec", "fake_mode", "predict_call",
                "predict_step"),
    "report": ("resource_report",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
# Modules used by their own name: mt.accounting.roofline.roof("h100").
_SUBMODULES = ("counter", "predict", "report", "roofline")

__all__ = ["hardware", *_MODULE_OF, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
