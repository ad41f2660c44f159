"""Regenerate every command output that README.md and docs/ quote; ``--check`` only compares.

A quoted output sits between two markers, and the first names the command (run with bash in
the repository root)::

    <!-- output: minitrain formats --values fp4_e2m1 -->
    ```text
    $ minitrain formats --values fp4_e2m1
    ...what it prints...
    ```
    <!-- /output -->

``output-md`` instead of ``output`` inserts what the command prints as Markdown (a table of
figures), unfenced. A ``pycon`` block (an example on an API page) gets, after each ``>>>``
statement, what that statement prints when the block runs alone, as a doctest shows it.
``python tools/generate_docs.py`` rewrites the blocks;
``python tools/generate_docs.py --check`` exits 1 naming each block whose text differs from
what the code prints now (``tests/test_docs.py`` runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(
    r"<!-- (?P<kind>output|output-md): (?P<command>.+?) -->\n(?P<body>.*?)<!-- /output -->",
    re.S,
)
# Fixed terminal width and no colour, so rich tables print the same everywhere.
ENV = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb", "PYTHONHASHSEED": "0"}


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def run(command: str) -> str:
    """What ``command`` prints on stdout, run in the repository root; a failure raises."""
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, **ENV}, timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"`{command}` exited {done.returncode}: {done.stderr.strip()}")
    return "\n".join(line.rstrip() for line in done.stdout.rstrip().split("\n"))


def render(kind: str, command: str, output: str) -> str:
    """The text between the markers."""
    if kind == "output-md":
        return f"{output}\n"
    shown = command.replace(" | ", " \\\n    | ") if len(command) > 90 else command
    return f"```text\n$ {shown}\n{output}\n```\n"


PYCON = re.compile(r"(?P<open>^```pycon\n)(?P<code>.*?)(?P<close>^```$)", re.S | re.M)


def run_pycon(code: str) -> str:
    r"""A pycon block's statements, each followed by what it prints (its value's repr at the
    prompt, as the interactive interpreter shows it); the old outputs are dropped.

    >>> run_pycon(">>> 1 + 2\n41\n>>> print('a\\n')\n").split("\n")
    ['>>> 1 + 2', '3', ">>> print('a\\n')", 'a', '<BLANKLINE>', '']
    """
    statements: list[list[str]] = []
    for line in code.split("\n"):
        if line.startswith(">>>"):
            statements.append([line])
        elif line.startswith("...") and statements:
            statements[-1].append(line)
    namespace: dict = {"__name__": "docs_example"}
    out: list[str] = []
    for lines in statements:
        source = "\n".join(line[4:] for line in lines)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(source + "\n", "<example>", "single"), namespace)
        out += lines
        text = printed.getvalue().removesuffix("\n")
        if printed.getvalue():
            out += [line.rstrip() or "<BLANKLINE>" for line in text.split("\n")]
    return "\n".join(out) + "\n"


def regenerate_examples(text: str) -> tuple[str, list[str]]:
    """The page with the outputs of every pycon block regenerated, and the first line of each
    block that changed."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        code = run_pycon(match["code"])
        if code != match["code"]:
            changed.append(match["code"].split("\n", 1)[0])
        return f"{match['open']}{code}{match['close']}"

    return PYCON.sub(replace, text), changed


def regenerate(text: str) -> tuple[str, list[str]]:
    """The page with every block regenerated, and the commands whose blocks changed."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        kind, command = match["kind"], match["command"]
        body = render(kind, command, run(command))
        if body != match["body"]:
            changed.append(command)
        return f"<!-- {kind}: {command} -->\n{body}<!-- /output -->"

    return BLOCK.sub(replace, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a diff")
    args = parser.parse_args(argv)
    stale = []
    for path in pages():
        text = path.read_text()
        new, changed = regenerate(text)
        new, changed_examples = regenerate_examples(new)
        changed += changed_examples
        stale += [f"{path.relative_to(ROOT)}: {command}" for command in changed]
        if changed and not args.check:
            path.write_text(new)
    for line in stale:
        print(("stale " if args.check else "updated ") + line)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
