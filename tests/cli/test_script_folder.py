"""Every command that loads a script imports modules beside it, and leaves sys.path as it was."""

import sys
import textwrap

import click
import pytest

from minitrain.cli import cli, main
from minitrain.train import load_experiment
from minitrain.train.sweep import load_sweep

# Each command with a SCRIPT argument, and the rest of a short invocation of it.
INVOCATIONS = {
    "run": ["--steps", "2", "--no-report", "--json"],
    "sweep": ["--set", "lr=0.1,0.2", "--steps", "2", "--no-report", "--no-plot", "--json"],
    "estimate step": ["--json"],
    "profile": ["--warmup", "0", "--repeats", "1", "--json"],
}


def command_paths(group: click.Group, ctx: click.Context, keep=lambda command: True,
                  prefix: str = "") -> list[str]:
    """The path of every command, nested groups included, for which ``keep(command)``."""
    found = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            found += command_paths(command, ctx, keep, f"{prefix}{name} ")
        elif keep(command):
            found.append(f"{prefix}{name}")
    return found


def command_options(group: click.Group, keep) -> list[tuple[str, click.Parameter]]:
    """``(command path, param)`` for every param of every command for which ``keep(param)``."""
    found = []
    with click.Context(group) as ctx:
        for path in command_paths(group, ctx):
            command = group
            for name in path.split():
                command = command.get_command(ctx, name)
            found += [(path, p) for p in command.params if keep(p)]
    return found


def script_commands(group: click.Group, ctx: click.Context) -> list[str]:
    """The path of every command that takes a SCRIPT argument."""
    return command_paths(group, ctx, lambda c: any(p.name == "script" for p in c.params))


def write_script(folder, tag):
    """A script importing one sibling module at import time and another inside its loss."""
    (folder / f"top_{tag}.py").write_text("DIM = 3\n")
    (folder / f"late_{tag}.py").write_text("def scale(x):\n    return 2 * x\n")
    path = folder / "script.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        import minitrain as mt
        from top_{tag} import DIM

        CONFIG = {{"lr": 0.1, "steps": 2}}

        def experiment(config):
            def loss(params, batch):
                from late_{tag} import scale
                return (scale(batch @ params["w"]) - 1).square().mean()

            return mt.Experiment(init=lambda g: {{"w": torch.zeros(DIM)}}, loss=loss,
                                 next_batch=lambda g: torch.randn(4, DIM, generator=g),
                                 optimizer=mt.optim.sgd(lr=config["lr"]),
                                 steps=config["steps"])
        """))
    return str(path)


def test_the_table_covers_every_command_that_loads_a_script():
    with click.Context(cli) as ctx:
        assert sorted(script_commands(cli, ctx)) == sorted(INVOCATIONS)


@pytest.mark.parametrize("command", sorted(INVOCATIONS))
def test_a_sibling_module_imports_and_sys_path_is_restored(tmp_path, capsys, command):
    tag = command.replace(" ", "_")
    path = write_script(tmp_path, tag)
    before = list(sys.path)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([*command.split(), path, *INVOCATIONS[command]])
        out, err = capsys.readouterr()
        assert exit_info.value.code == 0, err
        assert f"late_{tag}" in sys.modules  # the loss ran, and its import found the sibling
        assert sys.path == before
    finally:
        for name in (f"top_{tag}", f"late_{tag}", "minitrain_experiment_script"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("load", [lambda p: load_experiment(p), lambda p: load_sweep(p)],
                         ids=["load_experiment", "load_sweep"])
def test_the_library_loaders_import_siblings_and_restore_sys_path(tmp_path, load):
    path = write_script(tmp_path, "library")
    before = list(sys.path)
    try:
        load(path)
        assert "top_library" in sys.modules and sys.path == before
    finally:
        for name in ("top_library", "late_library", "minitrain_experiment_script"):
            sys.modules.pop(name, None)
