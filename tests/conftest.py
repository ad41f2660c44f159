"""Shared fixtures: the hostile-input corpus (tests/*/test_hostile_*.py) and tiny-op runs."""

from __future__ import annotations

import pytest
import torch
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


@pytest.fixture
def one_thread():
    """The ops are tiny: one intra-op thread is fastest, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
