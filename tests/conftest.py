"""Fixtures shared by the hostile-input corpus (tests/*/test_hostile_*.py)."""

from __future__ import annotations

import pytest
from test_hostile_harness import recorded_signals, write_script


@pytest.fixture
def script(tmp_path):
    """The hostile experiment script (tests/test_hostile_harness.py's SCRIPT) in ``tmp_path``."""
    return write_script(tmp_path)


@pytest.fixture
def safe_signals():
    """SIGINT and SIGTERM that reach the test process outside minitrain's handlers are recorded,
    not fatal; yields the list of those signals."""
    with recorded_signals() as seen:
        yield seen
