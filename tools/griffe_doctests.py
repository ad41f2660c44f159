"""griffe extensions for the API pages: fence each docstring's ``>>>`` examples as code, and
make the names a package loads lazily (``__getattr__``) visible under its public path.

minitrain's docstrings carry doctests in plain text (pytest runs them); Markdown would read
``tensor([1.])`` as a link and ``*`` as emphasis, so each run of ``>>>``/``...`` lines and the
output after them becomes a ``pycon`` block before rendering.
"""

from __future__ import annotations

import sys
from pathlib import Path

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mkdocs_hooks  # noqa: E402


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


class LazyNames(griffe.Extension):
    """Adds to each API module the public names its source does not bind (those its
    ``__getattr__`` loads on first use), as aliases of where they are defined, so that
    ``::: minitrain.accounting.Counter`` resolves like ``mt.accounting.Counter`` does."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:  # noqa: ARG002 - griffe API
        for module_name in ["minitrain", *mkdocs_hooks.PAGES]:
            path = module_name.split(".")[1:]
            if path[0:1] and path[0] not in pkg.members:
                continue
            module = pkg[".".join(path)] if path else pkg
            for name, identifier, is_module in mkdocs_hooks.api_entries(module_name):
                if name not in module.members and not is_module:
                    module.set_member(name, griffe.Alias(name, identifier, parent=module))
