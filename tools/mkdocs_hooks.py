"""mkdocs hooks: API reference pages generated from each module's ``__all__`` at build time.

A page holding ``<!-- api: minitrain.optim -->`` gets one mkdocstrings entry (``::: path``) per
public name of ``minitrain.optim``, under its public path and grouped by the module that
defines it, so a name added to ``__all__`` appears in the docs with no edit to the page. A name
whose docstring has no example gets the one the page holds for it (``<!-- example: name -->``
and a pycon block). ``api_entries`` and ``page_examples`` are what ``tests/test_docs.py``
checks.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import types
from functools import cache
from pathlib import Path

MARKER = re.compile(r"<!-- api: ([\w.]+) -->")
# An example for a public name whose docstring has none: the pycon block after the marker (and
# a summary before it, for a constant the library leaves without a docstring) is moved into
# that name's entry.
EXAMPLE = re.compile(r"<!-- example: (?P<name>\w+) -->\n"
                     r"(?P<block>(?:[^`\n][^\n]*\n\n)?```pycon\n.*?\n```)\n", re.S)
BENCHMARK_PAGES = "<!-- benchmark-pages -->"
ROOT = Path(__file__).resolve().parents[1]
# Modules with an API page of their own: the top-level page links to them.
PAGES = {
    "minitrain.optim": "optim.md",
    "minitrain.nn": "nn.md",
    "minitrain.random": "random.md",
    "minitrain.accounting": "accounting.md",
    "minitrain.precision": "precision.md",
    "minitrain.tree": "tree.md",
    "minitrain.models": "models.md",
}


def public_names(module: types.ModuleType) -> list[str]:
    """``__all__``, or, for a package that loads names lazily without one, its ``__dir__``."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in dir(module) if not name.startswith("_")]
    return list(names)


@cache
def _parsed(module_name: str) -> tuple[frozenset[str], dict[str, str]]:
    """Names a module's source defines at top level, and ``name -> module`` of its imports."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return frozenset(), {}
    tree = ast.parse(Path(spec.origin).read_text())
    names: set[str] = set()
    imports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imports.update({alias.asname or alias.name: node.module for alias in node.names})
    return frozenset(names), imports


def submodule_names(package: types.ModuleType) -> list[str]:
    """Every module under a package (the package itself first)."""
    if not hasattr(package, "__path__"):
        return [package.__name__]
    paths = sorted(Path(package.__path__[0]).rglob("*.py"))
    names = []
    for path in paths:
        parts = path.relative_to(Path(package.__path__[0])).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.append(".".join([package.__name__, *parts]))
    return names


def defining_module(module: types.ModuleType, name: str, obj: object) -> str:
    """The module whose source defines ``name``: the object's ``__module__`` when its source
    defines that name, else the first module of the package that does, else the module one of
    them imports it from."""
    own = getattr(obj, "__module__", None)
    candidates = [own] if isinstance(own, str) and own.startswith("minitrain") else []
    candidates += submodule_names(module)
    for candidate in candidates:
        if name in _parsed(candidate)[0]:
            return candidate
    for candidate in candidates:
        source = _parsed(candidate)[1].get(name)
        if source and source.startswith("minitrain") and source != module.__name__:
            return defining_module(importlib.import_module(source), name, obj)
    raise LookupError(f"{module.__name__}.{name}: no module of the package defines it")


def api_entries(module_name: str) -> list[tuple[str, str, bool]]:
    """``(name, identifier, is_module)`` for every public name of a module."""
    module = importlib.import_module(module_name)
    entries = []
    for name in public_names(module):
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            entries.append((name, obj.__name__, True))
        else:
            entries.append((name, f"{defining_module(module, name, obj)}.{name}", False))
    return entries


def _first_line(module_name: str) -> str:
    """The first paragraph of a module's docstring, its reST roles made Markdown code."""
    doc = importlib.import_module(module_name).__doc__ or ""
    text = doc.strip().split("\n\n")[0].replace("\n", " ")
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)


def page_examples(markdown: str) -> dict[str, str]:
    """``name -> summary and pycon block`` of the examples a page holds.

    >>> page_examples("<!-- example: Foo -->\\n```pycon\\n>>> 1\\n1\\n```\\n")
    {'Foo': '```pycon\\n>>> 1\\n1\\n```'}
    """
    return {match["name"]: match["block"] for match in EXAMPLE.finditer(markdown)}


def _title(summary: str) -> str:
    """A heading from a module's summary: its words up to the first colon, parenthesis or
    sentence end.

    >>> _title("Lookahead (Zhang et al. 2019): a slow copy of the params.")
    'Lookahead'
    """
    return re.split(r": | \(|\. ", summary, maxsplit=1)[0].rstrip(".")


def _is_private(module_name: str) -> bool:
    return any(part.startswith("_") for part in module_name.split("."))


def api_markdown(module_name: str, examples: dict[str, str] | None = None) -> str:
    """The page body: names grouped by defining module, each documented under its public path
    (``minitrain.optim.adam``, not the private module that defines it), an example from the
    page after the entry of a name whose docstring has none, submodules linked or summarised."""
    examples = examples or {}
    groups: dict[str, list[str]] = {}
    modules = []
    for name, identifier, is_module in api_entries(module_name):
        if is_module:
            modules.append((name, identifier))
        else:
            groups.setdefault(identifier.rsplit(".", 1)[0], []).append(name)
    lines = []
    if modules:
        lines += ["## Modules", "", "| name | what it holds |", "|---|---|"]
        for name, identifier in modules:
            page = PAGES.get(identifier)
            label = f"[`{name}`]({page})" if page else f"[`{name}`](#{identifier})"
            lines.append(f"| {label} | {_first_line(identifier)} |")
        lines.append("")
    for source, names in groups.items():
        summary = _first_line(source) if source != module_name else ""
        if _is_private(source):  # headed by what it holds, not by a path nobody imports
            lines += [f"## {_title(summary)}", "", summary, ""]
        else:
            lines += [f"## `{source}`", "", summary, ""]
        for name in names:
            lines += [f"::: {module_name}.{name}", ""]
            if name in examples:
                lines += [examples[name], ""]
    for name, identifier in modules:
        if identifier in PAGES:
            continue
        # A submodule whose names the page already lists gets its docstring only.
        members = ["      members: false"] if identifier in groups else []
        lines += [f"## `{identifier}`", "", f"::: {identifier}", "    options:",
                  "      show_root_heading: false", *members, ""]
        if name in examples:
            lines += [examples[name], ""]
    return "\n".join(lines)


def benchmark_pages(docs_dir: Path) -> str:
    """A list of the dated pages the benchmark scripts wrote (``--page``), with their titles."""
    lines = []
    for path in sorted((docs_dir / "benchmarks").glob("*.md")):
        if path.name == "index.md":
            continue
        title = path.read_text().split("\n", 1)[0].lstrip("# ").strip()
        date = re.search(r"^\| date \| (.+?) \|$", path.read_text(), re.M)
        when = f" (measured {date.group(1)})" if date else ""
        lines.append(f"- [{title}]({path.name}){when}")
    return "\n".join(lines) or "No page has been written yet: run a script with `--page`."


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - mkdocs API
    if MARKER.search(markdown):
        examples = page_examples(markdown)
        markdown = EXAMPLE.sub("", markdown)
        markdown = MARKER.sub(lambda m: api_markdown(m.group(1), examples), markdown)
    if BENCHMARK_PAGES in markdown:
        markdown = markdown.replace(BENCHMARK_PAGES, benchmark_pages(Path(config["docs_dir"])))
    return markdown
