"""Resource accounting: napkin math, hardware specs, FLOP/byte counting, live reports.

The napkin math (``training_flops``, ``training_time``, ``bytes_per_param``, ``max_params``,
activation formulas, transformer presets) and the hardware registry are plain Python and import
without torch. The torch-using parts load on first use: :class:`Counter` (a
``TorchDispatchMode`` counting FLOPs, bytes and live memory per aten op and module),
:func:`predict_step` (one training step predicted on fake tensors: peak memory and its moment,
FLOPs, time on a given device), :func:`resource_report` (predicted vs measured for one
training step) and ``roofline``.

>>> import minitrain as mt
>>> flops = mt.accounting.training_flops(params=70e9, tokens=15e12)
>>> round(mt.accounting.training_time(flops, hardware="h100", gpus=1024, mfu=0.5) / 86400)
144
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from minitrain.accounting.communication import (
    allreduce_bytes,
    allreduce_seconds,
    communication_time,
)
from minitrain.accounting.flops import (
    SECONDS_PER_DAY,
    cruncher_flops,
    effective_throughput,
    forward_flops,
    optimizer_flops_per_element,
    round_significant,
    training_flops,
    training_time,
)
from minitrain.accounting.hardware import (
    Hardware,
    HardwareError,
    dtype_name,
    hardware,
    hardware_for_cuda_device,
    hardware_names,
    measure_cpu,
)
from minitrain.accounting.memory import (
    OPTIMIZER_STATES,
    PRECISIONS,
    BytesPerParam,
    MemoryBreakdown,
    bytes_per_param,
    cruncher_activations,
    cruncher_memory,
    cruncher_params,
    max_params,
    optimizer_state_elements,
    optimizer_states,
    per_device_bytes_per_param,
    training_memory,
    transformer_activation_bytes,
)
from minitrain.accounting.transformer import (
    PRESETS,
    TransformerConfig,
    preset,
    transformer_activation_terms,
    transformer_flops_per_token,
    transformer_layer_activation_bytes,
    transformer_matmul_params,
    transformer_memory,
    transformer_optimizer_state_elements,
    transformer_params,
    transformer_tensors,
)

# Names that need torch, imported on first access (PEP 562).
_LAZY = {
    "Counter": "minitrain.accounting.counter",
    "OpRecord": "minitrain.accounting.counter",
    "resource_report": "minitrain.accounting.report",
    "predicted_peak_bytes": "minitrain.accounting.report",
    "predict_step": "minitrain.accounting.predict",
    "PredictionError": "minitrain.accounting.predict",
    "StepPrediction": "minitrain.accounting.predict",
    "TensorSpec": "minitrain.accounting.predict",
    "fake_mode": "minitrain.accounting.predict",
}
_LAZY_SUBMODULES = ("counter", "predict", "report", "roofline")

__all__ = [
    "SECONDS_PER_DAY",
    "OPTIMIZER_STATES",
    "PRECISIONS",
    "PRESETS",
    "BytesPerParam",
    "Hardware",
    "HardwareError",
    "MemoryBreakdown",
    "TransformerConfig",
    "allreduce_bytes",
    "allreduce_seconds",
    "bytes_per_param",
    "communication_time",
    "cruncher_activations",
    "cruncher_flops",
    "cruncher_memory",
    "cruncher_params",
    "dtype_name",
    "effective_throughput",
    "forward_flops",
    "hardware",
    "hardware_for_cuda_device",
    "hardware_names",
    "max_params",
    "measure_cpu",
    "optimizer_flops_per_element",
    "optimizer_state_elements",
    "optimizer_states",
    "per_device_bytes_per_param",
    "preset",
    "round_significant",
    "training_flops",
    "training_memory",
    "training_time",
    "transformer_activation_bytes",
    "transformer_activation_terms",
    "transformer_flops_per_token",
    "transformer_layer_activation_bytes",
    "transformer_matmul_params",
    "transformer_memory",
    "transformer_optimizer_state_elements",
    "transformer_params",
    "transformer_tensors",
    *_LAZY,
    *_LAZY_SUBMODULES,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for static type checkers and IDEs only
    from minitrain.accounting import counter, predict, report, roofline  # noqa: F401
    from minitrain.accounting.counter import Counter, OpRecord  # noqa: F401
    from minitrain.accounting.predict import (  # noqa: F401
        PredictionError,
        StepPrediction,
        TensorSpec,
        fake_mode,
        predict_step,
    )
    from minitrain.accounting.report import predicted_peak_bytes, resource_report  # noqa: F401
