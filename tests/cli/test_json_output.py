"""Every command's ``--json`` is strict JSON: a parser that refuses ``NaN`` and ``Infinity``
(JavaScript's, Go's, ``jq``) reads it. The table names the arguments of each command; a new
command with ``--json`` fails the coverage test until it is added here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from minitrain.cli import cli
from tests.cli.test_script_folder import command_paths

LINREG = str(Path(__file__).resolve().parents[2] / "examples" / "linreg.py")
QUICK = ["--steps", "2", "--set", "dim=4"]
ARGUMENTS = {
    "backends": [],
    "estimate memory": [],
    "estimate step": [LINREG, "--set", "dim=4"],
    "estimate time": ["--params", "7e10", "--tokens", "1.5e13"],
    "estimate transformer": ["--preset", "gpt2", "--tokens", "1e9"],
    "formats": [],
    "hardware": ["h100"],
    "plot": ["{run}"],
    "prepare": ["--out", "{tmp}/data", "--source", str(Path(__file__).parent)],
    "profile": [LINREG, "--set", "dim=4", "--warmup", "0", "--repeats", "1"],
    "roofline": [],
    "run": [LINREG, *QUICK],
    "sweep": [LINREG, *QUICK, "--set", "lr=0.01,0.1"],
}


def strict_loads(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def json_commands() -> list[str]:
    with click.Context(cli) as ctx:
        return command_paths(cli, ctx, lambda c: any(p.name == "as_json" for p in c.params))


def test_the_table_covers_every_command_with_json():
    assert sorted(ARGUMENTS) == sorted(json_commands())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "linreg"
    result = CliRunner().invoke(cli, ["run", LINREG, *QUICK, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("command", sorted(ARGUMENTS))
def test_json_output_is_strict(command, run_dir, tmp_path):
    args = [a.format(run=run_dir, tmp=tmp_path) for a in ARGUMENTS[command]]
    if command == "plot":
        args += ["--out", str(tmp_path / "loss.png")]
    result = CliRunner().invoke(cli, [*command.split(), *args, "--json"])
    assert result.exit_code == 0, result.output
    assert strict_loads(result.stdout) not in (None, {}, [])


def listable_formats() -> list[str]:
    """Every format whose codes ``--values`` lists (elements of 8 bits or fewer)."""
    from minitrain.precision import FORMATS, spec

    return [name for name in FORMATS if spec(name).bits <= 8 and not spec(name).is_block]


@pytest.mark.parametrize("name", ["fp32", "tf32", "fp16", "bf16", "mxfp8", "mxfp4", "nvfp4"])
def test_a_format_whose_codes_are_not_listed_says_which_to_list(name):
    from minitrain.precision import spec

    result = CliRunner().invoke(cli, ["formats", "--values", name, "--json"])
    assert result.exit_code == 2
    message = result.output.strip()
    assert "\n" not in message
    s = spec(name)
    assert f"--values {s.element}" in message if s.is_block else "8 bits or fewer" in message


@pytest.mark.parametrize("name", listable_formats())
def test_every_code_of_every_format_is_strict_json(name):
    from minitrain.precision import values

    result = CliRunner().invoke(cli, ["formats", "--values", name, "--json"])
    assert result.exit_code == 0, result.output
    listed = strict_loads(result.stdout)
    expected = values(name)
    assert [row["code"] for row in listed] == [code for code, _ in expected]
    for row, (_, value) in zip(listed, expected, strict=True):
        shown = row["value"]
        assert shown == value if math.isfinite(value) else shown == str(value)


def test_the_codes_of_a_format_with_inf_and_nan_name_them():
    result = CliRunner().invoke(cli, ["formats", "--values", "fp8_e5m2", "--json"])
    shown = {row["value"] for row in strict_loads(result.stdout)}
    assert {"inf", "-inf", "nan"} <= shown
