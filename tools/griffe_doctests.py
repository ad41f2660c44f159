"""A griffe extension for the API pages: fence each docstring's ``>>>`` examples as code.

minitrain's docstrings carry doctests in plain text (pytest runs them); Markdown would read
``tensor([1.])`` as a link and ``*`` as emphasis, so each run of ``>>>``/``...`` lines and the
output after them becomes a ``pycon`` block before rendering.
"""

from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    r"""Wrap every doctest (prompt lines plus output, up to a blank line) in a pycon fence.

    >>> fence_doctests("Adds one.\n\n>>> 1 + 1\n2\n\nMore.").split("\n")
    ['Adds one.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
    """
    out: list[str] = []
    inside = False
    indent = ""
    for line in text.split("\n"):
        stripped = line.lstrip()
        if not inside and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            inside = True
        elif inside and not stripped:
            out.append(f"{indent}```")
            inside = False
        out.append(line)
    if inside:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctests of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:  # noqa: ARG002 - griffe API
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
