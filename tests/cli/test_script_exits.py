"""A script that exits or raises a BaseException (at import or in experiment()) is one line and
exit 2 under every command that loads a script, never a silent exit or a traceback."""

import pytest

from minitrain.cli import main
from tests.cli.test_script_folder import INVOCATIONS

RAISES = {
    "sys.exit(7)": "import sys\nsys.exit(7)\n",
    "SystemExit('bye')": "raise SystemExit('bye')\n",
    "a BaseException subclass": "class Stop(BaseException):\n    pass\nraise Stop('custom stop')\n",
}


def script(body: str, where: str) -> str:
    if where == "import":
        return body + "CONFIG = {'lr': 0.1}\n"
    indented = "".join(f"    {line}\n" for line in body.splitlines())
    return f"CONFIG = {{'lr': 0.1}}\n\ndef experiment(config):\n{indented}"


@pytest.mark.parametrize("where", ["import", "experiment"])
@pytest.mark.parametrize("raised", sorted(RAISES))
@pytest.mark.parametrize("command", sorted(INVOCATIONS))
def test_an_exiting_script_is_one_line_under_every_command(command, raised, where, tmp_path,
                                                           capsys, monkeypatch):
    # In process: an exit or BaseException that escaped the command would escape main() too.
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "exits.py"
    path.write_text(script(RAISES[raised], where))
    args = [*command.split(), str(path), *INVOCATIONS[command]]
    if command in ("run", "sweep"):
        args += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "exits.py" in lines[0], lines
    assert "Traceback" not in err
