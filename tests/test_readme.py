"""The README's code runs: the API tour and the experiment-script contract."""

import re
from pathlib import Path

import minitrain as mt

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def block_containing(text: str) -> str:
    matches = [block for block in BLOCKS if text in block]
    assert len(matches) == 1, f"expected one README python block with {text!r}"
    return matches[0]


def test_api_tour_runs():
    namespace: dict = {}
    exec(block_containing("# Models are (init, apply) pairs"), namespace)
    assert namespace["backend"].name in mt.available_backends()
    assert mt.tree.size(namespace["params"]) == 4 * 8 + 8  # the from_module Linear(4, 8)


def test_experiment_contract_example_trains():
    namespace: dict = {}
    exec(block_containing("def experiment(config):"), namespace)
    config = dict(namespace["CONFIG"], steps=200, lr=0.1)
    experiment = namespace["experiment"](config)
    result = mt.fit(experiment, mt.get_backend("cpu"), progress=False)
    assert result.summary["steps"] == 200 and result.summary["final_loss"] < 1e-6
