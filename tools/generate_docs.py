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
figures), unfenced. ``python tools/generate_docs.py`` rewrites the blocks;
``python tools/generate_docs.py --check`` exits 1 naming each block whose text differs from
what the code prints now (``tests/test_docs.py`` runs it).
"""

from __future__ import annotations

import argparse
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
        stale += [f"{path.relative_to(ROOT)}: {command}" for command in changed]
        if changed and not args.check:
            path.write_text(new)
    for line in stale:
        print(("stale " if args.check else "updated ") + line)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
