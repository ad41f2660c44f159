"""A run directory has one owner: an advisory lock held for the life of the run.

``claim(path, resume=..., overwrite=...)`` creates the directory, checks it can be written (the
checkpoints folder included) before any step runs, takes ``<out>/.lock`` with ``fcntl.flock``
(released by the kernel when the process dies, so a killed run never leaves a stale lock), and
refuses a fresh run into a directory that already holds a run unless told to resume or
overwrite. The lock file holds the owner's pid and command line, so the refusal names it.

>>> import tempfile
>>> from pathlib import Path
>>> out = Path(tempfile.mkdtemp()) / "run"
>>> owner = claim(out, resume=False, overwrite=False)
>>> claim(out, resume=True, overwrite=False)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
minitrain.errors.UserError: ... is in use by another run (pid ...); wait for it to finish, ...
>>> owner.release()
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
from pathlib import Path

from minitrain.atomic_io import check_writable_dir
from minitrain.errors import StorageError, UserError

__all__ = ["LOCK_FILE", "RunOwner", "claim", "holds_a_run"]

LOCK_FILE = ".lock"
# What a previous run leaves behind; a fresh run refuses to mix its files with them.
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "tensorboard", "sweep.png")

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, the directory is still checked
    fcntl = None


class RunOwner:
    """The held lock of one run directory; :meth:`release` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def holds_a_run(path: Path) -> bool:
    """Whether ``path`` holds metrics or checkpoints of an earlier run."""
    checkpoints = path / "checkpoints"
    metrics = path / "metrics.jsonl"
    try:
        if checkpoints.is_dir() and any(checkpoints.iterdir()):
            return True
        return metrics.is_file() and metrics.stat().st_size > 0
    except OSError as exc:
        raise StorageError.from_os_error(exc, exc.filename or path, "read") from None


def claim(path: str | os.PathLike, *, resume: bool, overwrite: bool) -> RunOwner:
    """Make ``path`` this run's directory: create, lock, check it is writable and free.

    Raises :class:`UserError` when another live run holds it, or when it holds an earlier run
    and neither ``resume`` nor ``overwrite`` is given; :class:`StorageError` when it cannot be
    created or written.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {path} is a file, not a directory; pass a directory path")
    if path.is_symlink() and not path.exists():
        raise UserError(
            f"--out {path} is a symbolic link to {os.readlink(path)}, which does not exist; "
            "create that directory, or pass another --out"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except NotADirectoryError as exc:
        raise UserError(
            f"--out {path}: a part of the path is a file, not a directory; pass another --out"
        ) from exc
    except OSError as exc:
        raise StorageError.from_os_error(exc, path, "create the run directory") from None
    owner = RunOwner(path, fd)
    try:
        _lock(fd, path)
        if holds_a_run(path) and not (resume or overwrite):
            raise UserError(
                f"--out {path} already holds a run (metrics or checkpoints); pass --resume to "
                "continue it, --overwrite to replace it, or another --out"
            )
        if overwrite and not resume:
            _clear(path)
        _probe_writable(path)
        _write_owner(fd)
    except BaseException:
        owner.release()
        raise
    return owner


def _lock(fd: int, path: Path) -> None:
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        raise UserError(
            f"--out {path} is in use by another run ({holder}); wait for it to finish, or "
            "pass another --out"
        ) from None
    except OSError as exc:
        raise StorageError.from_os_error(exc, path / LOCK_FILE, "lock") from None


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    pid, _, command = text.partition("\n")
    if not pid.strip().isdigit():
        return "pid unknown"
    return f"pid {pid.strip()}" + (f": {command.strip()[:120]}" if command.strip() else "")


def _write_owner(fd: int) -> None:
    text = f"{os.getpid()}\n{' '.join(sys.argv)}\n".encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)
    except OSError:
        pass  # the lock itself is what matters; the note only makes the refusal clearer


def _clear(path: Path) -> None:
    """``--overwrite``: remove an earlier run's metrics, checkpoints, summary and plots."""
    for name in RUN_FILES:
        target = path / name
        try:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
        except OSError as exc:
            raise StorageError.from_os_error(exc, target, "remove") from None


def _probe_writable(path: Path) -> None:
    """Prove the run directory and its checkpoints folder take new files, and that the files
    the run writes at the end are not in the way, so an unwritable ``--out`` fails before the
    first step instead of after the last."""
    check_writable_dir(path)
    check_writable_dir(path / "checkpoints")
    for name in ("summary.json", "metrics.jsonl"):
        target = path / name
        if target.is_dir():
            raise StorageError.from_os_error(
                IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target)),
                target,
                "write",
            )
