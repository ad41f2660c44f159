"""The reference packages tests compare with: a missing one fails the test (never skips)."""

from __future__ import annotations

import importlib

import pytest

import minitrain.accounting as acc


def require(module: str):
    """Import ``module`` (a reference or a test extra), or fail saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is needed by these tests and is not importable ({exc}); "
                    f"install the test extras: pip install -e '.[test]'", pytrace=False)


# optax's aliases have no torch.optim (or lion-pytorch, schedulefree) reference: their state
# sizes are checked against their optax-formula states in tests/optim/test_optax_transforms.py.
OPTAX_ALIASES = {"lamb", "lars", "adabelief", "yogi", "polyak_sgd"}
TORCH_REFERENCED = sorted(set(acc.OPTIMIZER_STATES) - OPTAX_ALIASES)
