"""Every command runs with its standard output or error closed by the shell (``>&-``): what it
would print is discarded, it exits as it would otherwise, and a run still saves its summary."""

import os
import pathlib
import subprocess
import sys

import click
import pytest

from minitrain.cli import cli
from tests.cli.test_script_folder import command_paths

with click.Context(cli) as _ctx:
    COMMANDS = command_paths(cli, _ctx)


def minitrain(args: list[str], closed: int, cwd) -> subprocess.CompletedProcess:
    """Run ``python -m minitrain ARGS`` started with file descriptor ``closed`` (1 or 2) closed,
    as ``>&-`` / ``2>&-`` start it."""
    return subprocess.run([sys.executable, "-m", "minitrain", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, preexec_fn=lambda: os.close(closed))


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command_with_a_stream_closed(command, closed, tmp_path):
    proc = minitrain([*command.split(), "--help"], closed, tmp_path)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_a_run_with_a_stream_closed_trains_and_saves_its_summary(closed, tmp_path):
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = minitrain(["run", str(root / "examples" / "linreg.py"), "--steps", "3",
                      "--out", str(tmp_path / "run"), "--no-report", "--json"], closed, tmp_path)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert (tmp_path / "run" / "summary.json").is_file()
