"""What ``minitrain run`` and ``minitrain sweep`` share: their options, checks and summary."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from minitrain.cli.errors import UserError, output_errors, rich_console

# Step numbers name checkpoints (step-NNNNNNNN) and seeds feed numpy's SeedSequence and torch:
# both take values below 2**63.
MAX_STEPS = 2**63 - 1
MAX_SEED = 2**63 - 1


def _parsed(number_type: Any, value: Any, param: Any, ctx: Any, whole: bool) -> Any:
    from minitrain.accounting.units import parse_number

    try:  # click names the option in its message
        return parse_number(str(value), "", whole=whole)
    except ValueError as exc:
        number_type.fail(str(exc), param, ctx)


class Whole(click.IntRange):
    """An int option read by the one number parser (``accounting.units.parse_number``: ``1e3``,
    ``4k``, ``1_000``; finite); click checks its range and shows it in ``--help``."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return super().convert(_parsed(self, value, param, ctx, whole=True), param, ctx)


class Real(click.FloatRange):
    """A float option read by the one number parser (``70e9``, ``70B``, ``1.5k``; finite)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return super().convert(_parsed(self, value, param, ctx, whole=False), param, ctx)


SEED = Whole(min=0, max=MAX_SEED)

class PngPath(click.ParamType):
    """A path for a plot: it must end in ``.png`` (plots are written as PNG)."""

    name = "FILE.png"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        if not str(value).lower().endswith(".png"):
            option = param.opts[0] if param is not None else "the plot path"
            raise UserError(f"{option} {value} does not end in .png; plots are written as PNG: "
                            "give a path ending in .png")
        return str(value)


PNG = PngPath()


_SHARED = (
    click.option("--backend", default="cpu",
                 help="cpu (fp32), cpu-bf16, cpu-fp16, cpu-fp8, cpu-mxfp8, cpu-mxfp4, cpu-nvfp4, "
                      "cuda (bf16 autocast), cuda-fp16, cuda-fp8, auto, or an installed backend "
                      "(see minitrain backends)."),
    click.option("--steps", type=Whole(min=0, max=MAX_STEPS), default=None,
                 help="Override the step count."),
    click.option("--out", type=click.Path(path_type=Path), default=None, help="Run directory."),
    click.option("--log-every", type=Whole(min=1), default=1, help="Log every N steps."),
    click.option("--checkpoint-every", type=Whole(min=0), default=0,
                 help="Checkpoint every N steps (0: only at the end and on Ctrl-C). Needs --out."),
    click.option("--keep", type=Whole(min=1), default=3, help="Checkpoints to keep."),
    click.option("--resume", is_flag=True,
                 help="Continue from the latest valid checkpoint in --out."),
    click.option("--overwrite", is_flag=True,
                 help="Replace the earlier run in --out (its metrics, checkpoints and summary)."),
    click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout."),
)


def training_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add --backend, --steps, --out, --log-every, --checkpoint-every, --keep, --resume,
    --overwrite and --json."""
    for option in reversed(_SHARED):
        command = option(command)
    return command


def script_argument(command: Callable[..., Any]) -> Callable[..., Any]:
    """The SCRIPT argument; the command runs with the script's folder on ``sys.path`` (its
    sibling modules import, also inside the loss), as it was afterwards."""

    @functools.wraps(command)
    def in_script_folder(*args: Any, script: Path, **kwargs: Any) -> Any:
        from minitrain.train.experiment import script_folder

        with script_folder(script):
            return command(*args, script=script, **kwargs)

    return click.argument("script", type=click.Path(path_type=Path))(in_script_folder)


def check_out(out: Path | None, resume: bool, overwrite: bool) -> None:
    """Refuse an --out that is a file, and --resume with --overwrite."""
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory; pass a directory path")
    if resume and overwrite:
        raise UserError("--resume continues the run in --out and --overwrite replaces it; pass one")


def echo_json(value: Any) -> None:
    """``value`` as strict JSON on stdout: NaN and infinities become null, which every JSON
    parser reads (``json.dumps`` would write ``NaN``, which strict parsers refuse)."""
    from minitrain.train.loop import dumps_finite

    click.echo(dumps_finite(value, indent=2))


def emit(result: Any, lines: list[str], as_json: bool) -> None:
    """``result`` (JSON data) as JSON, or ``lines`` as text."""
    if as_json:
        echo_json(result)
    else:
        click.echo("\n".join(lines))


def number(value: float | None, digits: int = 6) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def print_summary(summary: dict[str, Any], out: Path | None, as_json: bool,
                  show: Callable[[Any, dict[str, Any]], None], resources_title: str) -> None:
    """The summary as JSON, or as ``show(console, summary)`` prints it and the resource report;
    a failed write to stdout is one line naming the saved summary."""
    with output_errors(out / "summary.json" if out is not None else None):
        if as_json:
            echo_json(summary)
            return
        console = rich_console()
        try:
            show(console, summary)
            if "resources" in summary:
                from minitrain.accounting.report import format_report

                text = format_report(summary["resources"])
                console.print(f"[bold]resources[/bold] {resources_title}")
                console.print(text, markup=False, highlight=False, soft_wrap=True)
        except (OSError, click.ClickException):
            raise
        except Exception as exc:  # a summary short of a field: print what there is
            from minitrain.train.experiment import one_line

            click.echo(f"warning: could not compute the summary table: {one_line(exc)}",
                       err=True)
            echo_json(summary)
