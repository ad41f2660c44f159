"""Every script in ``benchmarks/`` is a click command of its own name, runnable as
``python benchmarks/<name>.py``, and its doctests pass."""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest
from benchmarks_harness import BENCHMARKS, load_benchmark, scripts
from click.testing import CliRunner


def test_the_benchmarks_are_the_ones_the_readme_names():
    assert scripts() == ["data", "distributed", "hardware", "optim", "research", "step", "sweep",
                         "typecheck"]


@pytest.mark.parametrize("name", scripts())
def test_every_benchmark_answers_help(name):
    module = load_benchmark(name)
    result = CliRunner().invoke(getattr(module, name), ["--help"], prog_name=f"{name}.py")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: {name}.py [OPTIONS]"), result.output
    assert "--json" in result.output  # a machine reads every benchmark's result
    assert f'if __name__ == "__main__":\n    main({name})\n' in module.__loader__.get_source(
        module.__name__)


def test_a_script_runs_as_a_script():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "typecheck.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Shape-check overhead" in proc.stdout, proc.stderr


@pytest.mark.parametrize("name", [*scripts(), "_timing", "_optim_family", "_gpt_step"])
def test_doctests_pass(name):
    module = load_benchmark(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, module.__name__, globs=vars(module).copy()):
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} doctest(s) of benchmarks/{name}.py failed"
