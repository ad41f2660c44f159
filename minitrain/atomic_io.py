"""Crash-safe directory writes: build aside, fsync, rename into place.

A reader sees the old directory or the new one, never half of one: the new content is written
into a staging directory next to the target, flushed to disk, then renamed over the target
(POSIX ``rename`` is atomic within one filesystem). Used by checkpoints and prepared data.

>>> import tempfile
>>> from pathlib import Path
>>> root = Path(tempfile.mkdtemp())
>>> staging = root / ".tmp-new"; staging.mkdir(); _ = (staging / "a.txt").write_text("v2")
>>> replace_dir(staging, root / "data")
>>> (root / "data" / "a.txt").read_text()
'v2'
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["fsync_dir", "fsync_tree", "replace_dir"]


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file directly in ``directory``, then the directory itself."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fsync_dir(directory)


def replace_dir(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``, moving an older ``target`` aside first, then fsync.

    The older copy is renamed to ``.tmp-<pid>-old-<name>`` (so a cleaner that knows the
    ``.tmp-<pid>-`` prefix can remove it if this process dies) and deleted afterwards.
    """
    old = None
    if target.exists():
        old = target.with_name(f".tmp-{os.getpid()}-old-{target.name}")
        os.replace(target, old)
    os.replace(staging, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
