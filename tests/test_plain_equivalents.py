"""Each research program written with minitrain is shorter than the same program in plain
PyTorch (``torch.func``, ``torch.optim``, ``torch.utils.flop_counter``), and each plain
equivalent in ``benchmarks/plain/`` really runs. Counted in code lines: not blank, not a comment,
not a docstring."""

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREDICT_SECTION = "## Predict, then measure, its step"
SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
           tokenize.ENDMARKER)
STATEMENT_START = (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL, tokenize.DEDENT)


def code_lines(source: str) -> int:
    """Lines holding code: a bare string statement (a docstring) and comments do not count."""
    lines, previous = set(), tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        docstring = token.type == tokenize.STRING and previous in STATEMENT_START
        if not docstring and token.type not in SKIPPED:
            lines.update(range(token.start[0], token.end[0] + 1))
        previous = token.type
    return len(lines)


def predict_block() -> str:
    """The GPT tutorial's predict-then-measure program (the python block after its heading)."""
    text = (ROOT / "docs" / "tutorials" / "gpt.md").read_text()
    section = text[text.index(PREDICT_SECTION):]
    return re.search(r"```python\n(.*?)\n```", section, re.S)[1]


PROGRAMS = {  # ours -> (its source, the plain equivalent)
    "examples/gpt.py": lambda: (ROOT / "examples/gpt.py").read_text(),
    "examples/dp_sgd.py": lambda: (ROOT / "examples/dp_sgd.py").read_text(),
    "examples/maml_sine.py": lambda: (ROOT / "examples/maml_sine.py").read_text(),
    "examples/ensemble.py": lambda: (ROOT / "examples/ensemble.py").read_text(),
    "docs/tutorials/gpt.md (predict, then measure)": predict_block,
}
PLAIN = dict(zip(PROGRAMS, ["gpt", "dp_sgd", "maml_sine", "ensemble", "predict"], strict=True))


def test_code_lines_skip_docstrings_and_comments_only():
    source = ('def f():\n    """Doc\n    more."""\n'
              '    s = """not a\n    docstring"""\n    return s\n')
    assert code_lines(source) == 4  # def, the two lines of s, return; not the docstring


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_program_is_shorter_than_its_plain_equivalent(program):
    ours = code_lines(PROGRAMS[program]())
    plain = code_lines((ROOT / "benchmarks" / "plain" / f"{PLAIN[program]}.py").read_text())
    assert ours < plain, f"{program}: {ours} code lines, its plain equivalent {plain}"


@pytest.mark.parametrize("name", sorted(PLAIN.values()))
def test_each_plain_equivalent_runs(name):
    done = subprocess.run([sys.executable, f"benchmarks/plain/{name}.py", "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "it printed nothing"
