"""Exit codes and one-line errors for the command line: the one place that maps errors to codes.

0 success; 1 a failed run (non-finite loss, script error, OSError, dead worker); 2 a user
mistake; 130 stopped by Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

import click

from minitrain import errors

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


class LostPeer(RunFailed):
    """A worker lost its peers (exit 1): a consequence, left to the launcher to name the cause."""


class ScriptFailed(RunFailed):
    """The user's script raised: its own frames first, then the one ``error:`` line."""

    def __init__(self, message: str, frames: str) -> None:
        super().__init__(message)
        self.frames = frames

    def show(self, file=None) -> None:
        if self.frames:
            click.echo("Traceback of your code (most recent call last):", err=True, file=file)
            click.echo(self.frames.rstrip("\n"), err=True, file=file)
        super().show(file)


def as_cli_error(exc: BaseException) -> click.ClickException | None:
    """The CLI error for a library error (None: not one of ours)."""
    message = str(exc)
    if isinstance(exc, errors.ScriptError):
        return ScriptFailed(message, exc.frames)
    if isinstance(exc, errors.Interrupted):
        return RunInterrupted(message)
    if isinstance(exc, errors.DistributedError) and getattr(exc, "lost_peer", False):
        return LostPeer(message)
    if isinstance(exc, errors.RunFailed):
        return RunFailed(message)
    if isinstance(exc, errors.UserError):
        return UserError(message)
    return None


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn library errors, OSErrors and a Ctrl-C that reached here (a run's own handlers save
    and stop it before) into one-line CLI errors; anything else propagates."""
    try:
        yield
    except KeyboardInterrupt:
        raise RunInterrupted("interrupted before anything was saved") from None
    except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, BrokenPipeError):
        raise  # click's own, and a closed stdout (run_cli words it)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise RunFailed(f"{where}{errors.os_cause(exc)}") from None
    except Exception as exc:
        mapped = as_cli_error(exc)
        if mapped is None:
            raise
        raise mapped from None


class Command(click.Command):
    """A click command that runs under :func:`cli_errors` (also when invoked on its own)."""

    def invoke(self, ctx: click.Context) -> object:
        with cli_errors():
            return super().invoke(ctx)


class Group(click.Group):
    """A click group whose subcommands run under :func:`cli_errors`."""

    command_class = Command


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _early_sigterm() -> Iterator[None]:
    """Until the fit loop installs its handlers, SIGTERM and SIGHUP stop as Ctrl-C does (exit 130).
    """
    # SIGHUP only where the process was not started to ignore it (nohup); the fit loop's
    # handlers (minitrain.train.signals, which imports torch) make the same choice later.
    stops = [signal.SIGTERM]
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:
        stops.append(hangup)
    try:
        previous = {sig: signal.signal(sig, _terminate_as_interrupt) for sig in stops}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is _terminate_as_interrupt:
                signal.signal(sig, handler)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _raise_broken_pipe() -> None:
    raise BrokenPipeError(32, os.strerror(32))


@contextlib.contextmanager
def output_errors(saved_in: str | os.PathLike | None = None) -> Iterator[None]:
    """A failed write of a result to stdout is one line (exit 1) naming where the result is saved.
    """
    try:
        yield
        sys.stdout.flush()
    except OSError as exc:
        _silence_stdout()
        where = f"; the summary is saved in {saved_in}" if saved_in is not None else ""
        raise RunFailed(f"cannot write to standard output: {errors.os_cause(exc)}{where}") from None


def rich_console():  # noqa: ANN201 (rich is imported lazily)
    """A rich Console whose closed pipe raises BrokenPipeError (rich exits 1 silently)."""
    from rich.console import Console

    console = Console()
    console.on_broken_pipe = _raise_broken_pipe
    return console


def run_cli(command: click.Command, argv: list[str] | None = None) -> None:
    """Invoke ``command``; print click usage errors and :class:`UserError` on one line."""
    for name in ("stdout", "stderr"):  # a stream the shell closed (>&-) is None: discard its text
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 (lives as long as the process)
    with _early_sigterm():
        try:
            with cli_errors():
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
        except click.exceptions.Abort:  # click's word for a Ctrl-C outside a command
            click.echo("error: interrupted before anything was saved", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # e.g. `minitrain backends | head -1`
            _silence_stdout()
            click.echo("error: cannot write to standard output: broken pipe", err=True)
            sys.exit(EXIT_FAILED)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        sys.exit(EXIT_OK)
