"""The layering of the package, read from the source with ``ast`` (no module is imported).

DESIGN.md: lower layers never import higher ones; library code never imports the command line
or click; accounting never imports the training loop; the core never imports the shipped
backends (it finds them through entry points); no import cycles; no file over 500 lines and no
function over 80; private torch names only in ``minitrain/_torch.py``; no attribute of a torch
module assigned.

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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minitrain"
BACKENDS = ROOT / "backends"


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


# DESIGN.md's layers, top first: a module imports (at any level, lazily too) only its own layer
# and those below it.
LAYERS = (
    ("minitrain.cli", "minitrain.__main__"),
    ("minitrain.train",),
    ("minitrain.data", "minitrain.checkpoint", "minitrain.checkpoint_state", "minitrain.metrics",
     "minitrain.rundir", "minitrain.atomic_io", "minitrain.rng", "minitrain.distributed"),
    ("minitrain.accounting",),
    ("minitrain.precision",),
    ("minitrain.optim",),
    ("minitrain.nn", "minitrain.models", "minitrain.random", "minitrain.init", "minitrain.func",
     "minitrain.losses"),
    ("minitrain.tree", "minitrain.typecheck", "minitrain.strides", "minitrain.errors",
     "minitrain._torch", "minitrain._cache", "minitrain._native"),
)


def layer(module: str) -> int | None:
    """The index of ``module``'s layer in :data:`LAYERS` (0 is the top), None for the package.

    >>> layer("minitrain.optim.kernels.lowering"), layer("minitrain")
    (5, None)
    """
    found = [i for i, names in enumerate(LAYERS) if any(_is_under(module, n) for n in names)]
    return found[0] if found else None


def test_every_test_module_a_test_imports_by_name_is_on_the_pythonpath():
    """pytest's ``pythonpath`` holds the folder of each tests/ module imported by bare name, so
    ``pytest tests/train/test_hostile_loop.py`` alone imports what the whole suite does."""
    import re

    listed = re.search(r"^pythonpath = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    on_path = {ROOT / folder for folder in re.findall(r'"([^"]+)"', listed.group(1))}
    modules = {path.stem: path.parent for path in (ROOT / "tests").rglob("*.py")}
    imported = {(path.relative_to(ROOT), node.module) for path in (ROOT / "tests").rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules}
    assert imported, "no test imports a sibling module: the check reads nothing"
    missing = sorted((str(path), name) for path, name in imported
                     if modules[name] not in on_path)
    assert not missing, f"add these modules' folders to pythonpath in pyproject.toml: {missing}"


def test_lower_layers_never_import_higher_ones():
    modules = [m for m in source_files() if m != "minitrain"]
    assert [m for m in modules if layer(m) is None] == [], "add these modules to LAYERS"
    upward = [i for i in all_imports() if layer(i.target) is not None
              and i.module != "minitrain" and layer(i.target) < layer(i.module)]
    assert not upward, "imports of a higher layer:\n" + _listing(upward)


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


# -- private torch names and torch's modules --------------------------------------------------
#
# Every private torch name (a ``torch...`` attribute chain, ``import torch...`` or
# ``from torch... import`` path with a component starting with "_", dunders aside; ``getattr``
# and ``importlib.import_module`` with such a string) is bound in minitrain/_torch.py and nowhere
# else, so tests/test_torch_compat.py can check each on every torch CI runs. And no library code
# assigns to an attribute of a torch module or object (``torch.x.y = ...``, ``setattr(torch...,
# ...)``, ``F.gelu = ...``): nothing reaches into torch to change it.

PRIVATE_TORCH_HOME = "minitrain/_torch.py"

# Files still naming private torch or assigning into torch (being migrated); remove each as it
# passes. A file listed here that passes both checks, or is gone, fails the test.
PENDING_MIGRATION: set[str] = set()

def library_files() -> dict[str, Path]:
    """Every .py file of minitrain/ and backends/, by its path relative to the repository."""
    paths = sorted([*PACKAGE.rglob("*.py"), *BACKENDS.rglob("*.py")])
    return {path.relative_to(ROOT).as_posix(): path for path in paths}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _is_torch_path(dotted: str) -> bool:
    return dotted == "torch" or dotted.startswith("torch.")


def _chain(node: ast.AST) -> list[str] | None:
    """``torch.utils._pytree.tree_map`` -> ``["torch", "utils", "_pytree", "tree_map"]``; None
    when the chain does not start at a name (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _root(node: ast.AST) -> str | None:
    """The name an attribute or subscript target hangs from: ``torch`` in ``torch.a[0].b``."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_bound_names(tree: ast.AST) -> set[str]:
    """Names a module binds to torch, its modules or their members: by ``import torch...``,
    ``from torch... import``, or assigning such a name's attribute chain
    (``F = torch.nn.functional``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                alias.asname or alias.name.split(".")[0]
                for alias in node.names if _is_torch_path(alias.name)
            }
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_torch_path(
            node.module or ""
        ):
            names |= {alias.asname or alias.name for alias in node.names}
    while True:  # aliases of aliases
        more = {
            node.targets[0].id for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and (_chain(node.value) or [""])[0] in names
        } - names
        if not more:
            return names
        names |= more


def _string_prefix(node: ast.AST) -> str | None:
    """A string constant, or the constant start of an f-string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _string_prefix(node.values[0])
    return None


def private_torch_uses(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` for each private torch name in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound = torch_bound_names(tree)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, alias.name) for alias in node.names
                if _is_torch_path(alias.name) and any(map(_private, alias.name.split(".")))
            ]
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_torch_path(
            node.module or ""
        ):
            found += [
                (node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                if any(map(_private, [*node.module.split("."), alias.name]))
            ]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in bound and any(map(_private, chain[1:])):
                found.append((node.lineno, ".".join(chain)))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            callee = ".".join(_chain(node.func) or [])
            text = _string_prefix(node.args[1])
            if callee in {"getattr", "hasattr"} and _root(node.args[0]) in bound and text and (
                _private(text)
            ):
                found.append((node.lineno, f"{callee}({ast.unparse(node.args[0])}, {text!r})"))
        if isinstance(node, ast.Call) and node.args:
            callee = ".".join(_chain(node.func) or [])
            text = _string_prefix(node.args[0])
            if callee in {"importlib.import_module", "import_module", "__import__"} and text and (
                _is_torch_path(text) and any(map(_private, text.split(".")))
            ):
                found.append((node.lineno, text))
    return sorted(set(found))


def torch_assignments(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` for each assignment into torch: to an attribute or item of a name
    bound to torch (``torch.a.b = x``, ``F.gelu = f``, ``del torch.a.b``, ``x += ...``), and
    ``setattr``/``delattr`` on one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound = torch_bound_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute | ast.Subscript) and isinstance(
                    part.ctx, ast.Store | ast.Del
                ) and _root(part) in bound:
                    found.append((node.lineno, ast.unparse(part)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {
            "setattr", "delattr"
        } and node.args and _root(node.args[0]) in bound:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def _migration_offenders() -> dict[str, list[str]]:
    offenders = {}
    for name, path in library_files().items():
        if name == PRIVATE_TORCH_HOME:
            continue
        found = [f"{line}: {what}" for line, what in private_torch_uses(path)]
        found += [f"{line}: assigns {what}" for line, what in torch_assignments(path)]
        if found:
            offenders[name] = found
    return offenders


def test_private_torch_names_live_in_one_module_and_torch_is_never_changed():
    offenders = _migration_offenders()
    new = {name: found for name, found in offenders.items() if name not in PENDING_MIGRATION}
    assert not new, (
        "private torch names outside minitrain/_torch.py, or assignments into torch (bind the "
        "name in minitrain/_torch.py with a test in tests/test_torch_compat.py; never assign "
        "into torch):\n" + "\n".join(
            f"  {name}:{line}" for name, found in new.items() for line in found
        )
    )
    done = sorted(PENDING_MIGRATION - set(offenders))
    assert not done, f"these files pass now: remove them from PENDING_MIGRATION: {done}"


def test_the_private_torch_check_sees_every_form(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(
        "import importlib\n"
        "import torch\n"
        "import torch.utils._pytree as pytree\n"
        "from torch import _C, nn\n"
        "from torch._subclasses.fake_tensor import FakeTensor\n"
        "from torch.utils import checkpoint\n"
        "import torch.nn.functional as F\n"
        "x = torch._foreach_norm([t], 2)\n"
        "y = torch.ops.aten._fused_adamw.default\n"
        "z = torch.__version__, torch.utils.checkpoint.checkpoint, nn.Linear\n"
        "w = getattr(torch, f'_foreach_{name}')\n"
        "importlib.import_module('torch._dynamo')\n"
        "v = checkpoint._checkpoint_without_reentrant_generator\n"
        "ok = obj._private, torch.Tensor.__torch_function__\n"
    )
    assert private_torch_uses(path) == [
        (3, "torch.utils._pytree"), (4, "torch._C"),
        (5, "torch._subclasses.fake_tensor.FakeTensor"), (8, "torch._foreach_norm"),
        (9, "torch.ops.aten._fused_adamw.default"),
        (11, "getattr(torch, '_foreach_')"), (12, "torch._dynamo"),
        (13, "checkpoint._checkpoint_without_reentrant_generator"),
    ]
    path.write_text(
        "import torch\n"
        "from torch.utils import checkpoint\n"
        "import torch.nn.functional as F\n"
        "cp = torch.utils.checkpoint\n"
        "torch.backends.cudnn.benchmark = True\n"
        "checkpoint.CheckpointFunction = object\n"
        "F.gelu = lambda x: x\n"
        "setattr(torch.nn, 'x', 1)\n"
        "cp.checkpoint = None\n"
        "del torch.Tensor.foo\n"
        "torch.x.__dict__['y'] = 1\n"
        "mine = torch.ones(1)\n"
        "obj.attr = torch.nn\n"
        "mine.grad = None\n"
    )
    assert [line for line, _ in torch_assignments(path)] == [5, 6, 7, 8, 9, 10, 11]


# -- sizes -------------------------------------------------------------------------------------

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_TOTAL_LINES = 20_000
MAX_OPTIM_LINES = 5_500  # Python; the C kernel apart
MAX_KERNEL_LINES = 800

# Over the limits today, with their size (being split): ``path`` for a file,
# ``path::Class.function`` for a function (its ``def`` line to its last). An entry may shrink;
# one that grows, or no longer exceeds the limit, fails the test (update or remove it).
OVERSIZE_PENDING: dict[str, int] = {}


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, lines)`` of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def oversize() -> dict[str, int]:
    """Files over MAX_FILE_LINES and functions over MAX_FUNCTION_LINES, with their lines."""
    found: dict[str, int] = {}
    for name, path in library_files().items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found[name] = lines
        for function, size in _functions(ast.parse(text, filename=str(path))):
            if size > MAX_FUNCTION_LINES:
                key = f"{name}::{function}"
                found[key] = max(size, found.get(key, 0))
    return found


def test_no_file_over_500_lines_and_no_function_over_80():
    found = oversize()
    new = {name: size for name, size in found.items() if name not in OVERSIZE_PENDING}
    assert not new, (
        f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function (split them by "
        f"concern): {new}"
    )
    grown = {
        name: (OVERSIZE_PENDING[name], size) for name, size in found.items()
        if name in OVERSIZE_PENDING and size > OVERSIZE_PENDING[name]
    }
    assert not grown, f"grown past their size in OVERSIZE_PENDING (listed, now): {grown}"
    done = sorted(set(OVERSIZE_PENDING) - set(found))
    assert not done, f"within the limits now: remove them from OVERSIZE_PENDING: {done}"


def _lines(paths: Iterable[Path]) -> int:
    return sum(len(path.read_text().splitlines()) for path in paths)


def test_the_library_and_its_optimizers_stay_small():
    total = _lines(library_files().values())
    assert total <= MAX_TOTAL_LINES, f"minitrain/ and backends/ hold {total} lines of Python"
    optim = _lines((PACKAGE / "optim").rglob("*.py"))
    assert optim <= MAX_OPTIM_LINES, f"minitrain/optim holds {optim} lines of Python"
    kernel = _lines((PACKAGE / "optim").rglob("*.c"))
    assert kernel <= MAX_KERNEL_LINES, f"the C kernel is {kernel} lines"


def test_the_size_check_counts_functions_by_qualified_name():
    tree = ast.parse(
        "def f():\n    def g():\n        pass\n    return g\n"
        "class C:\n    def m(self):\n        pass\n"
        "if True:\n    def h():\n        pass\n"
    )
    assert list(_functions(tree)) == [("f", 4), ("f.g", 2), ("C.m", 2), ("h", 2)]


if __name__ == "__main__":  # print the import graph: python tests/test_layers.py [module ...]
    graph = import_graph()
    for name in sys.argv[1:] or sorted(graph):
        print(name, "->", ", ".join(sorted(graph[name])) or "-")
