"""The README is a front page that keeps its promises: the tour runs, the install and test
commands are the ones CI uses, and its links lead somewhere. (Every python block of the README
also runs alone in tests/test_docs.py, and its tables are regenerated there.)"""

import re
from pathlib import Path

import minitrain as mt

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def block_containing(text: str) -> str:
    matches = [block for block in BLOCKS if text in block]
    assert len(matches) == 1, f"expected one README python block with {text!r}"
    return matches[0]


def test_api_tour_runs():
    namespace: dict = {}
    tour = block_containing("# Models are (init, apply) pairs")
    assert len(tour.strip().splitlines()) <= 30
    exec(tour, namespace)
    assert namespace["backend"].name in mt.available_backends()
    assert mt.tree.size(namespace["params"]) == 4 * 8 + 8  # the from_module Linear(4, 8)
    assert namespace["pred"].peak_bytes > mt.tree.nbytes(namespace["state"])


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) <= 200


def test_the_cpu_torch_hint_comes_before_the_install_line():
    hint = README.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert hint < README.index("pip install -e '.[test]'")
    assert README.index("python -m venv") < hint


def test_the_test_command_is_the_one_ci_runs():
    command = "python -m pytest -q -n 2"
    assert f"\n{command}\n" in README and f"\n{command}\n" in CI
    assert "-n 2" in CI and "2 cores" in README


def test_the_torch_versions_named_are_the_ones_ci_tests():
    pyproject = (ROOT / "pyproject.toml").read_text()
    bound = re.search(r'"(torch>=[0-9.]+)"', pyproject).group(1)
    assert bound in README
    oldest = re.search(r'"torch==([0-9.]+)"', CI).group(1)
    newest = re.search(r"\(([0-9.]+) when this was written\)", CI).group(1)
    assert bound == f"torch>={oldest.rsplit('.', 1)[0]}"
    assert oldest in README and newest in README


def test_the_commands_shown_exist():
    for command in ("minitrain run examples/linreg.py",):
        assert f"\n{command}\n" in README
    assert (ROOT / "examples" / "linreg.py").exists()


def test_every_relative_link_leads_to_a_file():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert len(links) >= 15
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
