"""Packages the accounting tests need (references, plots): missing, a test fails (never skips)."""

from __future__ import annotations

import importlib

import pytest


def require(module: str):
    """Import ``module``, or fail saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is needed by these tests and is not importable ({exc}); "
                    f"install the test extras: pip install -e '.[test]'", pytrace=False)
