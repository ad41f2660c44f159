"""Errors raised by the user's own code (init, next_batch, the loss, evaluate), shown as such.

The user sees the frames of their own files, then one line naming the function and the step.
"""

from __future__ import annotations

import contextlib
import sysconfig
import traceback
from collections.abc import Iterator
from pathlib import Path

from minitrain.errors import MinitrainError, ScriptError

__all__ = ["LIBRARY", "ScriptError", "one_line", "raised_at", "script_call", "script_line",
           "user_frames"]

# Folders of code that is not the user's: minitrain, the standard library, installed packages.
LIBRARY = tuple(
    {str(Path(__file__).resolve().parents[1])}
    | {str(Path(sysconfig.get_paths()[k]).resolve())
       for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The traceback frames of ``exc`` that lie in the user's files (not in :data:`LIBRARY`)."""
    return [frame for frame in traceback.extract_tb(exc.__traceback__)
            if not frame.filename.startswith("<")
            and not str(Path(frame.filename).resolve()).startswith(LIBRARY)]


def raised_at(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc`` in the user's own files (None: it rose in libraries)."""
    frames = user_frames(exc)
    return frames[-1] if frames else None


def script_line(exc: BaseException) -> str:
    """`` (script.py line 12)``: where the user's code raised ``exc``, if it did."""
    frame = raised_at(exc)
    return f" ({Path(frame.filename).name} line {frame.lineno})" if frame is not None else ""


def one_line(exc: BaseException) -> str:
    r"""``"Type: message"`` on one line; a jaxtyping shape error keeps the names of its dims.

    >>> one_line(ValueError("bad\nmore detail"))
    'ValueError: bad'
    """
    if isinstance(exc, SystemExit):
        return f"SystemExit (sys.exit({exc.code!r}))"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if type(exc).__name__ == "TypeCheckError" and lines:
        return _shape_error_line(lines)
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _shape_error_line(lines: list[str]) -> str:
    """Condense jaxtyping's report: where, which argument, its shape, the expected dims."""
    where = lines[0].removeprefix("Type-check error whilst checking the ").rstrip(".")
    fields = {}
    for line in lines:
        for key in ("The problem arose whilst typechecking", "Actual value:", "Expected type:"):
            if line.startswith(key):
                fields[key] = line.removeprefix(key).strip().rstrip(".")
    marker = "The current values for each jaxtyping axis annotation are as follows."
    dims = lines[lines.index(marker) + 1 :] if marker in lines else []
    parts = [f"shape mismatch in the {where}"]
    if fields:
        parts.append(
            f"{fields.get('The problem arose whilst typechecking', 'a value')} is "
            f"{fields.get('Actual value:', '?')}, expected {fields.get('Expected type:', '?')}"
        )
    if dims:
        parts.append("bound so far: " + ", ".join(dims))
    return "; ".join(parts)


@contextlib.contextmanager
def script_call(what: str, step: int | None = None) -> Iterator[None]:
    """Re-raise an exception of user code (``sys.exit()`` too) as :class:`ScriptError`.

    >>> try:
    ...     with script_call("next_batch", step=5):
    ...         raise KeyError("x")
    ... except ScriptError as exc:
    ...     print(exc)
    next_batch raised KeyError: 'x' at step 5
    """
    try:
        yield
    except (MinitrainError, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:
        frames = user_frames(exc)
        shown = "".join(traceback.format_list(frames)) if frames else ""
        where = f" at step {step}" if step is not None else ""
        raise ScriptError(f"{what} raised {one_line(exc)}{where}", shown) from exc
