"""The exception types minitrain raises on purpose; a leaf module that imports nothing.

Only the command line turns them into exit codes; each message is one line.

>>> err = StorageError.from_os_error(OSError(28, "No space left on device"), "m.jsonl", "write")
>>> str(err), isinstance(err, RunFailed)
('cannot write m.jsonl: no space left on device', True)
"""

from __future__ import annotations

import os

__all__ = [
    "MinitrainError", "UserError", "RunFailed", "Interrupted", "StorageError", "ExperimentError",
    "ResumeError", "NonFiniteLoss", "ScriptError", "DistributedError", "ShardError", "os_cause",
]


class MinitrainError(Exception):
    """Base of every error minitrain raises on purpose (never a bug in minitrain itself)."""


class UserError(MinitrainError, ValueError):
    """A mistake the user can fix: a bad flag, config value, script or file (exit code 2)."""


class RunFailed(MinitrainError, RuntimeError):
    """The run could not go on: a non-finite loss, a dead worker, a full disk (exit code 1)."""


class Interrupted(MinitrainError, RuntimeError):
    """Ctrl-C or SIGTERM stopped the run; the message says what was saved (exit code 130)."""


class StorageError(RunFailed):
    """An OSError while reading or writing a path, as one line naming the path and the cause."""

    def __init__(self, message: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)

    @classmethod
    def from_os_error(cls, exc: OSError, path: str | os.PathLike | None = None,
                      action: str = "write") -> StorageError:
        """``cannot <action> <path>: <cause>`` from an OSError (the cause in lower case)."""
        where = path if path is not None else exc.filename
        cause = os_cause(exc)
        message = f"cannot {action} {os.fspath(where)}: {cause}" if where else f"{action}: {cause}"
        return cls(message, where)


class ExperimentError(UserError):
    """A mistake in an experiment script or its overrides, with a one-line message."""


class ResumeError(ExperimentError):
    """``--resume`` cannot continue this run (no run directory, a different config, ...)."""


class NonFiniteLoss(RunFailed):
    """The loss (or the gradient norm) became NaN or infinite; the run stopped."""


class ScriptError(RunFailed):
    """The user's own code raised; ``frames`` holds the traceback frames of the user's files."""

    def __init__(self, message: str, frames: str = "") -> None:
        super().__init__(message)
        self.frames = frames


class DistributedError(RunFailed):
    """A data-parallel job failed: a worker died, ranks disagree, a collective timed out."""


class ShardError(UserError):
    """A batch cannot be split over the requested number of ranks."""


def os_cause(exc: OSError) -> str:
    """A short, lower-case cause for an OSError: ``no space left on device``.

    >>> os_cause(PermissionError(13, "Permission denied"))
    'permission denied'
    """
    if exc.errno is not None:
        return os.strerror(exc.errno).lower()
    return (str(exc) or type(exc).__name__).lower()

