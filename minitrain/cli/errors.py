"""Exit codes and one-line errors for the command line.

Exit codes: 0 success; 1 a failed run (e.g. a non-finite loss); 2 a user mistake (bad flag,
missing file, bad config value); 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import click

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# click >= 8.2 raises this for a group called without a subcommand.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class UserError(click.ClickException):
    """A mistake the user can fix: printed as one line ``error: ...``, exit code 2."""

    exit_code = EXIT_USAGE

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True, file=file)


class RunFailed(UserError):
    """The run itself failed (e.g. the loss became non-finite): exit code 1."""

    exit_code = EXIT_FAILED


class RunInterrupted(UserError):
    """Ctrl-C or SIGTERM stopped the run (after saving a checkpoint): exit code 130."""

    exit_code = EXIT_INTERRUPTED


@contextlib.contextmanager
def training_errors() -> Iterator[None]:
    """Turn what a training run raises into CLI errors: NaN -> exit 1, Ctrl-C -> 130, user
    mistakes (config, checkpoints, missing extras) -> exit 2, each as one line."""
    from minitrain.checkpoint import CheckpointError
    from minitrain.metrics import MetricsError, MissingExtra
    from minitrain.train import ExperimentError, Interrupted, NonFiniteLoss

    try:
        yield
    except NonFiniteLoss as exc:
        raise RunFailed(str(exc)) from None
    except Interrupted as exc:
        raise RunInterrupted(str(exc)) from None
    except KeyboardInterrupt:
        raise RunInterrupted("interrupted twice; stopped without a checkpoint") from None
    except (ExperimentError, CheckpointError, MetricsError, MissingExtra) as exc:
        raise UserError(str(exc)) from None


def run_cli(command: click.Command, argv: list[str] | None = None) -> None:
    """Invoke ``command``; print click usage errors and :class:`UserError` on one line."""
    try:
        command.main(args=argv, standalone_mode=False)
    except _NO_ARGS_IS_HELP as exc:  # `minitrain` alone: show the help
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(EXIT_USAGE)
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        click.echo(f"error: {exc.format_message()}{hint}", err=True)
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(EXIT_OK)
