"""Crash-safe writes: build aside, fsync, rename into place.

A reader sees the old file or directory or the new one, never half of one (POSIX ``rename`` is
atomic within one filesystem). :func:`write_atomic`, :func:`check_writable_dir` and
:func:`storage_errors` turn every ``OSError`` into one :class:`~minitrain.errors.StorageError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from minitrain.errors import StorageError

__all__ = ["fsync_dir", "write_new_file", "staged_dir", "write_atomic", "check_writable_dir",
           "remove_stale_staging", "storage_errors"]


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike, what: str = "write", mkdir: bool = False
                   ) -> Iterator[None]:
    """An ``OSError`` inside is a :class:`~minitrain.errors.StorageError` ``cannot <what> <path>``.

    >>> with storage_errors("/x", "read"):
    ...     raise PermissionError(13, "Permission denied")
    Traceback (most recent call last):
    ...
    minitrain.errors.StorageError: cannot read /x: permission denied
    """
    try:
        yield
    except OSError as exc:
        if mkdir and isinstance(exc, FileExistsError):
            exc = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        raise StorageError.from_os_error(exc, path, what) from None


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: str | os.PathLike, data: bytes) -> None:
    """Create ``path`` (it must not exist), write all of ``data`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A new directory beside ``target`` to build in; when the block ends without error, its
    files are fsynced and it is renamed to ``target`` (an older ``target`` is moved aside,
    deleted once replaced). Its name starts ``.tmp-<pid>-`` for :func:`remove_stale_staging`.
    """
    prefix = f".tmp-{os.getpid()}-{target.name}-"
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield staging
        for path in staging.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(staging)
        old = target.with_name(f".tmp-{os.getpid()}-old-{target.name}")
        replaced = target.exists()
        if replaced:
            os.replace(target, old)
        try:
            os.replace(staging, target)
            fsync_dir(target.parent)
        except BaseException:
            if replaced and not target.exists():
                os.replace(old, target)
            raise
        if replaced:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_atomic(path: str | os.PathLike, data: bytes | str, what: str = "write") -> Path:
    """Replace ``path``'s content with ``data`` atomically (temp file, fsync, rename, fsync dir).

    >>> import tempfile
    >>> from pathlib import Path
    >>> path = Path(tempfile.mkdtemp()) / "summary.json"
    >>> write_atomic(path, '{"steps": 3}').read_text()
    '{"steps": 3}'
    """
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    with storage_errors(path, what):
        try:  # rename refuses to replace a directory (EISDIR)
            write_new_file(temp, data.encode() if isinstance(data, str) else bytes(data))
            os.replace(temp, path)
        except BaseException:
            _unlink_quietly(temp)
            raise
        fsync_dir(path.parent)
    return path


def check_writable_dir(directory: str | os.PathLike, what: str = "write to") -> Path:
    """Create ``directory`` if needed and prove it takes a new file (so ``--out`` fails at once)."""
    directory = Path(directory)
    with storage_errors(directory, what, mkdir=True):
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        try:
            write_new_file(probe, b"minitrain\n")
        finally:
            _unlink_quietly(probe)
    return directory


def remove_stale_staging(root: Path) -> None:
    """Delete the ``.tmp-<pid>-*`` entries in ``root`` left by writers whose process has died
    (this process's own leftovers too: a failed write here has already given up on them)."""
    try:
        stale = list(root.glob(".tmp-*"))
    except OSError:
        return
    for path in stale:
        match = re.match(r"\.tmp-(\d+)-", path.name)
        if match and not _process_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _unlink_quietly(path: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
