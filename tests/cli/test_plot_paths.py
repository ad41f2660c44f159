"""Every option that names a plot file takes a ``.png`` path: anything else is one line,
exit 2, before any work (matplotlib's own error was a traceback)."""

import pytest

from minitrain.cli import cli, main
from minitrain.cli.options import PNG
from tests.cli.test_json_output import ARGUMENTS
from tests.cli.test_script_folder import command_options


def plot_options() -> list[tuple[str, str]]:
    """(command, option) for every option of type PNG."""
    return [(path, p.opts[0]) for path, p in command_options(cli, lambda p: p.type is PNG)]


def test_the_plot_options_are_found():
    assert {("roofline", "--plot"), ("profile", "--plot"), ("plot", "--out")} <= set(plot_options())


@pytest.mark.parametrize("command, option", plot_options())
@pytest.mark.parametrize("name", ["x.txt", "x.PNG.pdf", "x", "dir/"])
def test_a_plot_path_not_ending_in_png_is_one_line(command, option, name, tmp_path, capsys):
    args = [a.format(run=tmp_path, tmp=tmp_path) for a in ARGUMENTS[command]]
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), *args, option, str(tmp_path / name)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and "\n" not in err and ".png" in err, err
