"""A run directory has one owner: an advisory lock (``<out>/.lock``, ``flock``) held for the run.

:meth:`RunOwner.gone` says whether the path is still the directory claimed, so a run whose
directory was removed or moved notices.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

from minitrain.atomic_io import check_writable_dir, storage_errors
from minitrain.errors import StorageError, UserError

__all__ = ["LOCK_FILE", "Gone", "RunOwner", "claim", "held", "holds_a_run"]

LOCK_FILE = ".lock"
# What a previous run leaves behind; a fresh run refuses to mix its files with them.
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "tensorboard", "sweep.png")

# The run directories this process has claimed and not released (for a forced exit's message).
_HELD: list[RunOwner] = []

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, the directory is still checked
    fcntl = None


class Gone(NamedTuple):
    """What became of a claimed run directory: ``how`` is ``"removed"`` (deleted, or in part:
    its lock file is gone) or ``"moved"`` (renamed to ``moved_to``, when that can be told)."""

    how: str
    moved_to: Path | None = None


class RunOwner:
    """The held lock of one run directory; :meth:`release` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.pid, self._fd = path, os.getpid(), fd
        try:  # the directory itself, which a descriptor follows through a rename
            self._dir_fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            self._dir_fd = None
        self._identity = _identity(self._dir_fd if self._dir_fd is not None else path)

    def gone(self) -> Gone | None:
        """None while ``path`` is still the claimed directory with its lock file, else what
        became of it (two ``stat`` calls). A forked child calling it is a :class:`UserError`."""
        if os.getpid() != self.pid:
            raise UserError(
                f"process {os.getpid()} (forked from the run, pid {self.pid}) tried to write to "
                f"the run directory {self.path}; only the run's own process writes there"
            )
        if self._identity is None:
            return None
        try:
            same = _identity(self.path, strict=True) == self._identity
        except (FileNotFoundError, NotADirectoryError):
            same = False
        except OSError:  # cannot tell (e.g. permission denied): the next write will say
            return None
        if same:  # a deleted lock file: the directory was removed in part
            return Gone("removed") if _links(self._fd) == 0 else None
        moved_to = self._moved_to()
        return Gone("moved", moved_to) if moved_to is not None else Gone("removed")

    def _moved_to(self) -> Path | None:
        """Where the claimed directory lives now (Linux's ``/proc/self/fd``), else None."""
        if self._dir_fd is None or _links(self._dir_fd) == 0:
            return None
        try:
            where = os.readlink(f"/proc/self/fd/{self._dir_fd}")
        except OSError:
            return None
        if where.endswith(" (deleted)") or _identity(where) != self._identity:
            return None
        return Path(where)

    def release(self) -> None:
        if self in _HELD:
            _HELD.remove(self)
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._dir_fd = None


def _identity(where: int | str | Path, strict: bool = False) -> tuple[int, int] | None:
    """``(device, inode)`` of a path or descriptor; None (``strict``: raise) if unreadable."""
    try:
        st = os.stat(where)
    except OSError:
        if strict:
            raise
        return None
    return st.st_dev, st.st_ino


def _links(fd: int | None) -> int | None:
    """How many names the file open as ``fd`` has (0: deleted); None if unknown."""
    try:
        return None if fd is None else os.fstat(fd).st_nlink
    except OSError:
        return None


def held() -> list[Path]:
    """The run directories this process claimed and still holds, oldest first."""
    return [owner.path for owner in _HELD if owner.pid == os.getpid()]


def holds_a_run(path: Path) -> bool:
    """Whether ``path`` holds metrics or checkpoints of an earlier run."""
    checkpoints, metrics = path / "checkpoints", path / "metrics.jsonl"
    try:
        if checkpoints.is_dir() and any(checkpoints.iterdir()):
            return True
        return metrics.is_file() and metrics.stat().st_size > 0
    except OSError as exc:
        raise StorageError.from_os_error(exc, exc.filename or path, "read") from None


def claim(path: str | os.PathLike, *, resume: bool, overwrite: bool) -> RunOwner:
    """Make ``path`` this run's directory: create, lock, check it is writable and free."""
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
    _HELD.append(owner)
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
        with storage_errors(target, "remove"):
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()


def _probe_writable(path: Path) -> None:
    """Prove the run directory takes new files and its end files are not in the way."""
    check_writable_dir(path)
    check_writable_dir(path / "checkpoints")
    for name in ("summary.json", "metrics.jsonl"):
        target = path / name
        with storage_errors(target, "write"):
            if target.is_dir():
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
