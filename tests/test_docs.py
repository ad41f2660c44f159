"""The docs stay true: every code block runs, every quoted output is what the code prints now,
the site builds strictly, and every public name has an API entry."""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from benchmarks_harness import load_benchmark, scripts
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import generate_docs  # noqa: E402
import griffe_doctests  # noqa: E402
import mkdocs_hooks  # noqa: E402

# A fenced block (possibly indented in a list) and the line before it.
FENCE = re.compile(r"(?P<before>[^\n]*)\n(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n"
                   r"(?P<code>.*?)\n(?P=indent)```", re.S)
SNIPPET = re.compile(r'^(?P<indent>[ \t]*)--8<-- "(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"$',
                     re.M)
SKIP = re.compile(r"^[ \t]*<!-- skip: (?P<reason>.+?) -->[ \t]*$", re.M)
MAX_SKIPPED = 3
# The modules with an API page of their own (DESIGN.md's public API).
API_MODULES = ["minitrain", "minitrain.optim", "minitrain.nn", "minitrain.random",
               "minitrain.accounting", "minitrain.precision", "minitrain.tree",
               "minitrain.models"]


def pages() -> list[Path]:
    return generate_docs.pages()


def expand_snippets(text: str) -> str:
    """``--8<-- "path"`` and ``--8<-- "path:section"`` lines replaced by what they include,
    as pymdownx.snippets does."""

    def include(match: re.Match) -> str:
        body = (ROOT / match["path"]).read_text()
        if match["section"]:
            start = body.index(f"--8<-- [start:{match['section']}]")
            end = body.index(f"--8<-- [end:{match['section']}]")
            body = body[body.index("\n", start) + 1: body.rindex("\n", 0, end)]
        return textwrap.indent(body.rstrip("\n"), match["indent"])

    return SNIPPET.sub(include, text)


def python_blocks() -> list[tuple[str, str, str | None]]:
    """``(where, code, skip reason or None)`` of every distinct python block."""
    blocks, seen = [], set()
    for path in pages():
        text = expand_snippets(path.read_text())
        for match in FENCE.finditer(text):
            if match["lang"] != "python":
                continue
            code = textwrap.dedent(match["code"])
            if code in seen:
                continue
            seen.add(code)
            line = text[: match.start("code")].count("\n")
            skip = SKIP.search(match["before"])
            blocks.append((f"{path.relative_to(ROOT)}:{line}", code,
                           skip["reason"] if skip else None))
    return blocks


BLOCKS = python_blocks()


def test_the_pages_hold_python_blocks():
    assert len(BLOCKS) >= 20, len(BLOCKS)  # the extraction finds them (indented ones too)
    assert any(where.startswith("README.md") for where, _, _ in BLOCKS)
    assert any("def experiment(config: dict)" in code for _, code, _ in BLOCKS)  # an example


@pytest.mark.parametrize("where, code, skip", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_python_block_runs_alone(where, code, skip, tmp_path):
    if skip:
        pytest.skip(skip)
    script = tmp_path / "block.py"
    script.write_text(code)
    # Run as a module, not as __main__: an included example script defines, it does not train.
    runner = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='docs_block')"
    proc = subprocess.run([sys.executable, "-c", runner, str(script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"


def test_skipped_blocks_are_few_and_say_why():
    skipped = [(where, reason) for where, _, reason in BLOCKS if reason]
    assert len(skipped) <= MAX_SKIPPED, skipped
    assert all(len(reason) > 10 for _, reason in skipped), skipped


def test_a_skip_marker_sits_right_before_a_python_block():
    for path in pages():
        text = path.read_text()
        for match in SKIP.finditer(text):
            after = text[match.end():].lstrip(" \t").lstrip("\n").lstrip(" \t")
            assert after.startswith("```python"), f"{path}: {match[0]} is not before a block"


def test_the_experiment_contract_trains():
    """The contract on the getting-started page trains linreg to a tiny loss."""
    import minitrain as mt

    [code] = [code for where, code, _ in BLOCKS
              if where.startswith("docs/getting-started.md") and "def experiment(config):" in code]
    namespace: dict = {}
    exec(code, namespace)
    experiment = namespace["experiment"](dict(namespace["CONFIG"], steps=200, lr=0.1))
    result = mt.fit(experiment, mt.get_backend("cpu"), progress=False)
    assert result.summary["steps"] == 200 and result.summary["final_loss"] < 1e-6


# -- quoted outputs ---------------------------------------------------------------------------

QUOTED = [(path, match) for path in pages()
          for match in generate_docs.BLOCK.finditer(path.read_text())]


def test_the_pages_quote_outputs():
    commands = " ".join(match["command"] for _, match in QUOTED)
    assert len(QUOTED) >= 10 and "tools/figures.py" in commands and "cli_table" in commands


@pytest.mark.parametrize("path, match", QUOTED,
                         ids=[f"{p.relative_to(ROOT)}:{m['command'][:40]}" for p, m in QUOTED])
def test_every_quoted_output_is_what_the_code_prints(path, match):
    expected = generate_docs.render(match["kind"], match["command"],
                                    generate_docs.run(match["command"]))
    assert match["body"] == expected, (
        f"{path.relative_to(ROOT)}: the output of `{match['command']}` changed; "
        f"run python tools/generate_docs.py")


def test_the_check_notices_a_stale_output():
    stale = "<!-- output: echo fresh -->\n```text\n$ echo fresh\nstale\n```\n<!-- /output -->"
    new, changed = generate_docs.regenerate(stale)
    assert changed == ["echo fresh"] and "\nfresh\n" in new
    assert generate_docs.regenerate(new)[1] == []


# -- the site and the API reference ------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is missing: pip install -e '.[test]' (it includes the docs extra)")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").exists() and (site / "reference" / "cli" / "index.html").exists()


def test_every_api_module_has_a_page():
    marked = {m for path in (ROOT / "docs" / "api").glob("*.md")
              for m in mkdocs_hooks.MARKER.findall(path.read_text())}
    assert marked == set(API_MODULES)


@pytest.mark.parametrize("module_name", API_MODULES)
def test_every_public_name_has_an_entry(module_name, site):
    module = importlib.import_module(module_name)
    names = mkdocs_hooks.public_names(module)
    entries = mkdocs_hooks.api_entries(module_name)
    assert [name for name, _, _ in entries] == names
    page = site / "api" if module_name == "minitrain" else site / "api" / module_name[10:]
    html = (page / "index.html").read_text()
    for name, identifier, is_module in entries:
        obj = getattr(module, name)
        if is_module:
            assert obj.__name__ == identifier
            target = mkdocs_hooks.PAGES.get(identifier)
            assert (target and f'href="{target[:-3]}/"' in html) or f'id="{identifier}"' in html
            continue
        source, _, attr = identifier.rpartition(".")
        defined = getattr(importlib.import_module(source), attr)
        assert defined is obj or defined == obj, f"{identifier} is not {module_name}.{name}"
        # Under its public path: the private module that defines it shows nowhere.
        assert f'id="{module_name}.{name}"' in html, f"no API entry for {module_name}.{name}"
    private = re.search(r'id="minitrain(\.\w+)*\._(?!_)[^"]*"', html)
    assert not private, f"a private path in a heading: {private and private[0]}"


def test_precision_lists_the_names_of_its_modules():
    """``mt.precision`` loads its names lazily; its ``__all__`` is every module's, no more."""
    import minitrain.precision as precision

    union = [name for module in mkdocs_hooks.submodule_names(precision)[1:]
             for name in getattr(importlib.import_module(module), "__all__", [])]
    assert sorted(precision.__all__) == sorted(union) and len(set(union)) == len(union)
    namespace: dict = {}
    exec("from minitrain.precision import *", namespace)
    assert set(precision.__all__) <= set(namespace) & set(dir(precision))


def own_docstring(module_name: str, name: str, obj: object) -> str:
    """The docstring written for a public name: a class's, function's or module's own, or the
    string literal after the assignment that defines a constant or type alias."""
    if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
        return obj.__doc__ or ""
    identifier = dict((n, i) for n, i, _ in mkdocs_hooks.api_entries(module_name))[name]
    source = importlib.util.find_spec(identifier.rpartition(".")[0]).origin
    body = ast.parse(Path(source).read_text()).body
    for node, after in zip(body, body[1:], strict=False):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                return str(after.value.value)
    return ""


def api_page(module_name: str) -> Path:
    [path] = [p for p in (ROOT / "docs" / "api").glob("*.md")
              if f"<!-- api: {module_name} -->" in p.read_text()]
    return path


@pytest.mark.parametrize("module_name", API_MODULES)
def test_every_public_name_has_a_summary_and_an_example(module_name):
    """In its docstring, or, where the library keeps it short, in its entry on the API page;
    so is a one-line summary."""
    module = importlib.import_module(module_name)
    names = mkdocs_hooks.public_names(module)
    examples = mkdocs_hooks.page_examples(api_page(module_name).read_text())
    assert not set(examples) - set(names), "an example for a name the module does not have"
    without = [name for name in names if name not in examples
               and ">>>" not in own_docstring(module_name, name, getattr(module, name))]
    assert not without, f"{module_name}: no example for {without}"
    summaries = {name: not example.startswith("```") for name, example in examples.items()}
    unsummarised = [name for name in names if not summaries.get(name)
                    and not own_docstring(module_name, name, getattr(module, name)).strip()]
    assert not unsummarised, f"{module_name}: no one-line summary for {unsummarised}"
    twice = [name for name in examples if ">>>" in own_docstring(module_name, name,
                                                                getattr(module, name))]
    assert not twice, f"{module_name}: an example on the page and in the docstring: {twice}"


PYCON = {path: [textwrap.dedent(m["code"]) for m in FENCE.finditer(path.read_text())
                if m["lang"] == "pycon"] for path in pages()}
PYCON = {path: blocks for path, blocks in PYCON.items() if blocks}
# Each block a doctest of its own, with fresh globals, in a process apart from the tests'
# (an example may register a backend).
RUN_EXAMPLES = """
import doctest, json, sys
failed = []
for i, code in enumerate(json.load(sys.stdin)):
    test = doctest.DocTestParser().get_doctest(code, {}, f"block {i}", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    failed += [code] if runner.failures else []
sys.exit(1 if failed else 0)
"""


def test_the_api_pages_hold_examples():
    assert sum(len(blocks) for path, blocks in PYCON.items() if path.parent.name == "api") >= 70


@pytest.mark.parametrize("path", list(PYCON), ids=[str(p.relative_to(ROOT)) for p in PYCON])
def test_every_example_prints_what_it_shows(path):
    """Each ``pycon`` block runs alone (fresh globals) and prints what it quotes."""
    proc = subprocess.run([sys.executable, "-c", RUN_EXAMPLES], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, input=json.dumps(PYCON[path]))
    assert proc.returncode == 0, (f"{path.relative_to(ROOT)}: run python tools/generate_docs.py"
                                  f"\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")


def test_the_cli_reference_lists_every_command(site):
    from minitrain.cli import COMMANDS

    html = (site / "reference" / "cli" / "index.html").read_text()
    for name in COMMANDS:
        assert f'id="minitrain-{name}"' in html, name
    assert "--rank-by" in html and 'id="minitrain-estimate-step"' in html


def test_doctests_become_code_in_the_api_pages():
    text = "Doubles.\n\n    >>> 2 * 2\n    4\n"
    assert griffe_doctests.fence_doctests(text) == (
        "Doubles.\n\n    ```pycon\n    >>> 2 * 2\n    4\n    ```\n")
    for module in (griffe_doctests, mkdocs_hooks, generate_docs, load_benchmark("_pages")):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__


# -- the benchmark pages ------------------------------------------------------------------------


def test_a_benchmark_page_names_its_host_and_command(tmp_path):
    pages = load_benchmark("_pages")
    about = pages.host()
    assert {"date", "CPU", "torch", "minitrain commit"} <= set(about)
    path = pages.write_page("demo", "Demo against nothing", "ratio 1.00x", about,
                            command="python benchmarks/demo.py --page", pages=tmp_path)
    text = path.read_text()
    assert text.startswith("# Demo against nothing\n") and "ratio 1.00x" in text
    assert f"| torch | {about['torch']} |" in text and "benchmarks/demo.py --page" in text


def test_the_page_flag_writes_what_the_command_prints(tmp_path, monkeypatch):
    import click

    pages = load_benchmark("_pages")
    monkeypatch.setattr(pages, "PAGES", tmp_path)

    @click.command()
    @pages.page("demo", "Demo")
    @click.option("--n", default=2)
    def demo(n):
        click.echo(f"ratio {n}.00x")

    result = CliRunner().invoke(demo, ["--n", "3"])
    assert result.exit_code == 0 and not (tmp_path / "demo.md").exists()
    result = CliRunner().invoke(demo, ["--n", "3", "--page"])
    assert result.exit_code == 0, result.output
    assert "ratio 3.00x" in result.output and "ratio 3.00x" in (tmp_path / "demo.md").read_text()


@pytest.mark.parametrize("name", [s for s in scripts() if s != "research"])
def test_every_benchmark_can_write_its_page(name):
    module = load_benchmark(name)
    result = CliRunner().invoke(getattr(module, name), ["--help"])
    assert "--page" in result.output
    assert f"docs/benchmarks/{name}.md" in " ".join(result.output.split())
