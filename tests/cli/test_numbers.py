"""One number parser for the command line (``accounting.units.parse_number``): every numeric
option of every command reads ``1e3``, ``4k`` and ``1_000`` alike, and refuses NaN, infinities,
overflow and words in one line naming the option, before any work."""

import math

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minitrain.accounting.units import parse_number
from minitrain.cli import cli, main
from minitrain.cli.options import Real, Whole
from tests.cli.test_json_output import ARGUMENTS
from tests.cli.test_script_folder import command_options


def numeric_options() -> list[tuple[str, click.Option]]:
    """(command, option) for every option of every command whose value is a number."""
    return command_options(cli, lambda p: isinstance(
        p.type, click.types.IntParamType | click.types.FloatParamType))


OPTIONS = numeric_options()


def test_every_numeric_option_goes_through_the_one_parser():
    assert len(OPTIONS) > 20
    loose = [f"{path} {p.opts[0]}" for path, p in OPTIONS if not isinstance(p.type, Whole | Real)]
    assert not loose, loose


@pytest.mark.parametrize("path, option", OPTIONS, ids=[f"{c} {o.opts[0]}" for c, o in OPTIONS])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "1e400", "ten", "", "1e3x", "0x10"])
def test_a_bad_number_is_one_line_naming_the_option(path, option, bad, tmp_path, capsys):
    args = [a.format(run=tmp_path, tmp=tmp_path) for a in ARGUMENTS.get(path, [])]
    if path == "plot":
        args = [str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main([*path.split(), *args, option.opts[0], bad])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert err.startswith("error: ") and "\n" not in err and option.opts[0] in err, err


@pytest.mark.parametrize("path, option", [(c, o) for c, o in OPTIONS if isinstance(o.type, Whole)],
                         ids=[f"{c} {o.opts[0]}" for c, o in OPTIONS if isinstance(o.type, Whole)])
def test_a_whole_option_reads_every_spelling_of_a_number(path, option):
    low = option.type.min if option.type.min is not None else 0
    high = option.type.max if option.type.max is not None else 10**6
    value = max(low, min(high, 1000))
    spellings = [str(value), f"{value:_}", f"{value:e}"] + (["1k"] if value == 1000 else [])
    for text in spellings:
        assert option.type.convert(text, option, None) == value, text


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_finite_float_reads_back_exactly(x):
    assert parse_number(repr(x), "x") == x


@given(st.integers(-(2**80), 2**80))
def test_a_whole_number_reads_back_exactly_however_large(n):
    assert parse_number(str(n), "n", whole=True) == n


@pytest.mark.parametrize("text, value", [("70B", 70e9), ("15T", 15e12), ("1.5k", 1500.0),
                                         ("2m", 2e6), ("1_000", 1000.0), (".5", 0.5),
                                         ("-3e-2", -0.03), ("+7", 7.0)])
def test_napkin_spellings(text, value):
    assert math.isclose(parse_number(text, "x"), value)


@pytest.mark.parametrize("text, kwargs, says", [
    ("1.5", {"whole": True}, "not a whole number"),
    ("-1", {"low": 0}, "at least 0"),
    ("2**63", {}, "not a finite number"),
    ("9223372036854775808", {"whole": True, "high": 2**63 - 1}, "at most 9223372036854775807"),
])
def test_refusals_name_the_rule(text, kwargs, says):
    with pytest.raises(ValueError, match=says):
        parse_number(text, "--x", **kwargs)


BAD = ["nan", "inf", "-inf", "1e400", "ten", "", "1e3x", "0x10"]


@pytest.mark.parametrize("where", ["--set lr", "--set dim", "--seeds"])
@pytest.mark.parametrize("bad", BAD)
def test_set_and_seeds_take_the_same_rules(where, bad, capsys):
    command = "sweep" if where == "--seeds" else "run"
    value = [where, bad] if where == "--seeds" else ["--set", f"{where.split()[1]}={bad}"]
    with pytest.raises(SystemExit) as exit_info:
        main([command, ARGUMENTS["run"][0], "--steps", "1", *value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert len(err) == 1 and err[0].startswith(f"error: {where}"), err


def test_set_reads_every_spelling_of_a_number():
    from minitrain.train.experiment import coerce_value

    assert [coerce_value("dim", text, 16) for text in ("10", "1e1", "1_0")] == [10, 10, 10]
    assert coerce_value("lr", "1.5k", 0.1) == 1500.0
