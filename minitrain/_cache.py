"""The one folder every cache of minitrain lives in: compiled kernels, the stdlib corpus, the
CPU's measured figures."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir(required: bool = False) -> Path | None:
    """The folder of minitrain's caches: ``$MINITRAIN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/minitrain`` or ``~/.cache/minitrain``. ``MINITRAIN_CACHE_DIR=off`` (or
    empty, ``0``, ``none``) turns the caches off: None, or a folder in the temporary directory
    where one is ``required`` (a compiled kernel, the corpus)."""
    chosen = os.environ.get("MINITRAIN_CACHE_DIR")
    if chosen is None:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minitrain"
    if chosen.strip().lower() not in {"", "0", "off", "none"}:
        return Path(chosen)
    return Path(tempfile.gettempdir()) / f"minitrain-{os.getuid()}" if required else None
