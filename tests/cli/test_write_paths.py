"""Every option that names a file or folder to write, under every command, with a path the OS
refuses (under a regular file; a name over the 255-byte limit): one ``error:`` line naming the
cause, exit 1 (an OS error) or 2, never a traceback."""

import click
import pytest

from minitrain.cli import cli, main
from minitrain.cli.options import PNG
from tests.cli.test_json_output import ARGUMENTS
from tests.cli.test_script_folder import command_options

WRITE_OPTIONS = {"out", "plot_path"}


def write_options() -> list[tuple[str, click.Option]]:
    return command_options(cli, lambda p: isinstance(p, click.Option) and p.name in WRITE_OPTIONS)


OPTIONS = write_options()


def test_the_writing_options_are_found():
    assert {(c, o.opts[0]) for c, o in OPTIONS} >= {
        ("run", "--out"), ("sweep", "--out"), ("plot", "--out"), ("prepare", "--out"),
        ("roofline", "--plot"), ("profile", "--plot")}


@pytest.mark.parametrize("path, option", OPTIONS, ids=[f"{c} {o.opts[0]}" for c, o in OPTIONS])
@pytest.mark.parametrize("refused", ["under a file", "name too long"])
def test_a_refused_path_is_one_line(path, option, refused, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "x" if refused == "under a file" else tmp_path / ("n" * 300)
    suffix = ".png" if option.type is PNG else ""
    args = [a.format(run=tmp_path / "run", tmp=tmp_path) for a in ARGUMENTS[path]]
    if path == "plot":  # a run to plot
        assert main_exit(["run", *ARGUMENTS["run"], "--out", str(tmp_path / "run")], capsys) == 0
        capsys.readouterr()
    if path in ("run", "sweep"):
        args.append("--no-report")
    code = main_exit([*path.split(), *args, option.opts[0], f"{target}{suffix}"], capsys)
    err = capsys.readouterr().err
    assert code in (1, 2), err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    cause = "not a directory" if refused == "under a file" else "name too long"
    assert cause in errors[0].lower() and "Traceback" not in err, err


def main_exit(argv: list[str], capsys=None) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code
