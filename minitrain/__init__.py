"""minitrain: a functional training library on PyTorch with resource accounting built in.

Params are plain pytrees; forward passes, gradients and optimizer updates are pure functions on
``torch.func``. This module is the table of contents of the public API. Submodules load on first
use, so ``import minitrain`` is cheap and the napkin math in ``minitrain.accounting`` never
needs torch.

>>> import minitrain as mt
>>> mt.accounting.training_flops(params=70e9, tokens=15e12)
6.3e+24
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Submodules, imported on first attribute access.
_SUBMODULES = (
    "accounting", "checkpoint", "data", "distributed", "func", "init", "losses", "models", "nn",
    "optim", "precision", "random", "rng", "strides", "train", "tree", "typecheck",
)

# Top-level names and the submodule that defines each.
_EXPORTS = {
    "value_and_grad": "func",
    "grad": "func",
    "vmap": "func",
    "from_module": "func",
    "per_example_grads": "func",
    "Backend": "precision",
    "get_backend": "precision",
    "available_backends": "precision",
    "seed_everything": "rng",
    "Experiment": "train",
    "fit": "train",
}

__all__ = [*_SUBMODULES, *_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'minitrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for static type checkers and IDEs only
    from minitrain import (  # noqa: F401
        accounting,
        checkpoint,
        data,
        distributed,
        func,
        init,
        losses,
        models,
        nn,
        optim,
        precision,
        random,
        rng,
        strides,
        train,
        tree,
        typecheck,
    )
    from minitrain.func import from_module, grad, value_and_grad, vmap  # noqa: F401
    from minitrain.precision import Backend, available_backends, get_backend  # noqa: F401
    from minitrain.rng import seed_everything  # noqa: F401
    from minitrain.train import Experiment, fit  # noqa: F401
