"""The reference packages the precision tests compare with: missing, a test fails (never skips)."""

from __future__ import annotations

import importlib

import pytest


def reference(module: str):
    """Import ``module`` (a reference implementation), or fail saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is the reference these tests compare with and is not importable "
                    f"({exc}); install the test extras: pip install -e '.[test]'", pytrace=False)
