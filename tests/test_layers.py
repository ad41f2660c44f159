"""The layering of the package, read from the source with ``ast`` (no module is imported).

DESIGN.md: lower layers never import higher ones; library code never imports the command line
or click; accounting never imports the training loop; the core never imports the shipped
backends (it finds them through entry points); no import cycles; no file over about 600 lines.

Edges of the import graph are the ``import`` statements executed when a module is imported:
those at module level, including inside ``try``/``if`` blocks, but not those under
``if TYPE_CHECKING:`` (never executed) nor those inside functions or methods (run on call, after
every module has finished importing, so they cannot form an import-time cycle; lazy imports are
how the CLI and ``minitrain/__init__`` stay cheap). ``import a.b.c`` also runs ``a/__init__``
and ``a/b/__init__``; those parent edges are left out, as every submodule has them. The checks on
*what* is imported (click, the CLI, the loop, the backends) count imports at every level.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minitrain"
MAX_LINES = 650  # "about 600" (DESIGN.md), with room for a docstring or two


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "minitrain.train.loop"
    target: str  # what it imports, resolved: "minitrain.errors", "click", "torch.nn"
    line: int
    top_level: bool  # executed when the importing module is imported


def module_name(path: Path) -> str:
    """``minitrain/train/loop.py`` -> ``minitrain.train.loop``; a package's ``__init__.py`` -> its
    package.

    >>> module_name(PACKAGE / "train" / "__init__.py")
    'minitrain.train'
    """
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, top_level: bool):
    """(import node, top_level) pairs below ``node``; ``TYPE_CHECKING`` blocks are skipped."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, top_level
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _walk(other, top_level)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, False)
        else:
            yield from _walk(child, top_level)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of ``from ... import``, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import in ``path``; ``from pkg import sub`` names the submodule when it is one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node, top_level in _walk(tree, True):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _resolve(module, path.name == "__init__.py", node)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        found += [Import(module, t, node.lineno, top_level) for t in dict.fromkeys(targets)]
    return found


def all_imports() -> list[Import]:
    files = source_files()
    return [i for module, path in files.items() for i in imports_of(module, path, set(files))]


def import_graph(top_level_only: bool = True) -> dict[str, set[str]]:
    """minitrain module -> the minitrain modules it imports."""
    graph: dict[str, set[str]] = {module: set() for module in source_files()}
    for imp in all_imports():
        if imp.target in graph and (imp.top_level or not top_level_only):
            graph[imp.module].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm, iterative).

    >>> cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def _is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _listing(offenders: list[Import]) -> str:
    return "\n".join(f"  {i.module}:{i.line} imports {i.target}" for i in offenders)


def test_no_import_cycles_at_module_level():
    found = cycles(import_graph())
    assert not found, "import cycles among minitrain modules:\n" + "\n".join(
        "  " + " <-> ".join(component) for component in found
    )


def test_library_code_never_imports_the_command_line_or_click():
    offenders = [
        i for i in all_imports()
        if not _is_under(i.module, "minitrain.cli") and i.module != "minitrain.__main__"
        and (_is_under(i.target, "click") or _is_under(i.target, "minitrain.cli"))
    ]
    assert not offenders, "library modules that import click or minitrain.cli:\n" + _listing(
        offenders
    )


def test_accounting_never_imports_the_training_loop():
    direct = [
        i for i in all_imports()
        if _is_under(i.module, "minitrain.accounting") and _is_under(i.target, "minitrain.train")
    ]
    assert not direct, "minitrain.accounting imports minitrain.train:\n" + _listing(direct)
    graph = import_graph()
    indirect = {
        module: sorted(m for m in reachable(graph, module) if _is_under(m, "minitrain.train"))
        for module in graph if _is_under(module, "minitrain.accounting")
    }
    indirect = {module: found for module, found in indirect.items() if found}
    assert not indirect, f"minitrain.accounting reaches minitrain.train through imports: {indirect}"


def test_the_core_never_imports_the_shipped_backends():
    offenders = [
        i for i in all_imports()
        if _is_under(i.target, "minitrain_backends") or _is_under(i.target, "backends")
    ]
    assert not offenders, "the core imports the backends package (use entry points):\n" + (
        _listing(offenders)
    )


def test_no_file_is_too_long():
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in source_files().values()
    }
    long = {name: count for name, count in lengths.items() if count > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"


def test_every_package_is_installed_and_the_backends_under_their_own_name():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert config["package-dir"] == {"minitrain_backends": "backends"}
    assert "backends" not in listed and "minitrain_backends" in listed


def test_the_graph_sees_imports_the_way_python_runs_them(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "import minitrain.errors\n"
        "from . import loop, Stepper\n"
        "from ..optim import base\n"
        "if TYPE_CHECKING:\n"
        "    import minitrain.cli\n"
        "try:\n"
        "    import click\n"
        "except ImportError:\n"
        "    pass\n"
        "class A:\n"
        "    def f(self):\n"
        "        from minitrain.accounting import memory\n"
    )
    known = {"minitrain.train.loop", "minitrain.optim.base", "minitrain.accounting.memory"}
    found = [(i.target, i.top_level) for i in imports_of("minitrain.train.example", path, known)]
    assert found == [
        ("typing", True), ("minitrain.errors", True), ("minitrain.train.loop", True),
        ("minitrain.train", True), ("minitrain.optim.base", True), ("click", True),
        ("minitrain.accounting.memory", False),
    ]


if __name__ == "__main__":  # print the import graph: python tests/test_layers.py [module ...]
    graph = import_graph()
    for name in sys.argv[1:] or sorted(graph):
        print(name, "->", ", ".join(sorted(graph[name])) or "-")
