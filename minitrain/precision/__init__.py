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
from typing import TYPE_CHECKING, Any

# Each public name is in its module's __all__; the torch-free modules are searched first.
_MODULES = ("policies", "formats", "backend", "loss_scale", "matmuls", "simulation", "rounding")


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if not name.startswith("__"):
        for module_name in _MODULES:
            module = importlib.import_module(f"{__name__}.{module_name}")
            if name in module.__all__:
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    modules = [importlib.import_module(f"{__name__}.{m}") for m in _MODULES]
    return sorted({*_MODULES, *(name for m in modules for name in m.__all__)})


if TYPE_CHECKING:  # pragma: no cover - for static type checkers and IDEs only
    from minitrain.precision.backend import *  # noqa: F403
    from minitrain.precision.formats import *  # noqa: F403
    from minitrain.precision.loss_scale import *  # noqa: F403
    from minitrain.precision.matmuls import *  # noqa: F403
    from minitrain.precision.policies import *  # noqa: F403
    from minitrain.precision.rounding import *  # noqa: F403
    from minitrain.precision.simulation import *  # noqa: F403
