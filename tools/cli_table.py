"""The README's table of commands, read from the click group: each command, its subcommands and
the first sentence of its help. ``tools/generate_docs.py`` pastes it into the README."""

from __future__ import annotations

import click

from minitrain.cli import cli


def rows(group: click.Group, ctx: click.Context, prefix: str) -> list[tuple[str, str]]:
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        out.append((f"{prefix} {name}", command.get_short_help_str(limit=120)))
        if isinstance(command, click.Group):
            sub = click.Context(command, parent=ctx, info_name=name)
            out += rows(command, sub, f"{prefix} {name}")
    return out


def main() -> None:
    ctx = click.Context(cli, info_name="minitrain")
    print("| command | what it does |")
    print("|---|---|")
    for name, summary in rows(cli, ctx, "minitrain"):
        print(f"| `{name}` | {summary.replace('|', '/')} |")


if __name__ == "__main__":
    main()
