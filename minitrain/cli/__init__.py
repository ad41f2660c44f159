"""The ``minitrain`` command line; each command is imported only when invoked (``COMMANDS``)."""

from __future__ import annotations

import importlib

import click

from minitrain.cli.errors import Group, run_cli

# name -> "module:attribute" of a click command; loaded lazily.
COMMANDS: dict[str, str] = {
    "run": "minitrain.cli.run:run",
    "backends": "minitrain.cli.run:backends",
    "estimate": "minitrain.cli.estimate:estimate",
    "hardware": "minitrain.cli.roofline:hardware",
    "prepare": "minitrain.cli.run:prepare",
    "plot": "minitrain.cli.run:plot",
    "formats": "minitrain.cli.formats:formats",
    "roofline": "minitrain.cli.roofline:roofline",
    "profile": "minitrain.cli.roofline:profile",
    "sweep": "minitrain.cli.run:sweep",
}


class LazyGroup(Group):
    """A click group whose subcommands are imported on first use."""

    def __init__(self, *args, lazy_commands: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            module_name, attribute = self.lazy_commands[name].split(":")
            return getattr(importlib.import_module(module_name), attribute)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, context_settings={"show_default": True})
@click.version_option(package_name="minitrain")
def cli() -> None:
    """minitrain: functional training on PyTorch with resource accounting built in."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the CLI, turning user mistakes into exit code 2."""
    run_cli(cli, argv)
