"""The benchmark scripts (``benchmarks/*.py``: in the repository, not in the wheel) as modules.

A script imports its private helpers (``_timing``, ``_optim_family``, ...) from its own folder,
as ``python benchmarks/optim.py`` finds them; loaded here, the same helpers are the same modules
for every script and every test.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, loaded once per process: a script as the module
    ``benchmarks_<name>`` (no clash with any installed ``optim`` or ``data``), a private helper
    (``_timing``) under its own name, as the scripts import it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    if name.startswith("_"):
        return importlib.import_module(name)
    module_name = f"benchmarks_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def scripts() -> list[str]:
    """The names of the runnable benchmarks: every ``benchmarks/<name>.py`` but the private
    helpers."""
    return sorted(path.stem for path in BENCHMARKS.glob("*.py") if not path.stem.startswith("_"))
