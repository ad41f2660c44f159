"""Updates trace whole under torch.compile: building an optimizer allocates nothing and creates
no lock, and init/update are plain tensor code there (``torch._dynamo.explain`` counts graphs
and graph breaks; a break would fall back to eager silently).

Each case runs in a fresh interpreter, as a user's program would: the suite's runtime type
checks (jaxtyping's import hook over the package) draw random numbers, which dynamo refuses to
trace, and are not part of the library.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COMMON = """
import json, torch, torch._dynamo as dynamo
import minitrain as mt

def loss(params, x, y):
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()

def explain(fn, *args):
    out = dynamo.explain(fn)(*args)
    print(json.dumps({"graphs": out.graph_count, "breaks": out.graph_break_count,
                      "reasons": [b.reason for b in out.break_reasons]}))
"""

CASES = {
    "functional AdamW step": """
opt = mt.optim.adamw(lr=1e-2)
params = {"w": torch.randn(8), "b": torch.zeros(())}
x, y = torch.randn(16, 8), torch.randn(16)
def step(params, state):
    return opt.update(torch.func.grad(loss)(params, x, y), state, params)
explain(step, params, opt.init(params))
""",
    "make_train_step": """
from minitrain.train import load_experiment, make_train_step
experiment, _ = load_experiment(ROOT + "/examples/linreg.py")
step = make_train_step(experiment, mt.get_backend("cpu"))
params = experiment.init(torch.Generator().manual_seed(0))
batch = experiment.next_batch(torch.Generator().manual_seed(1))
explain(lambda p, s, b: step(p, s, b).loss, params, experiment.optimizer.init(params), batch)
""",
    "vmapped ensemble that builds adam inside": """
x, y = torch.randn(16, 8), torch.randn(16)
def member(p, lr):
    opt = mt.optim.adam(lr=lr)
    return opt.update(torch.func.grad(loss)(p, x, y), opt.init(p), p)[0]
def ensemble(params, lrs):
    return torch.func.vmap(member)(params, lrs)
params = {"w": torch.randn(4, 8), "b": torch.zeros(4)}
lrs = torch.tensor([1e-3, 3e-3, 1e-2, 3e-2])
explain(ensemble, params, lrs)
torch.testing.assert_close(torch.compile(ensemble, fullgraph=True)(params, lrs),
                           ensemble(params, lrs))
""",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_traces_as_one_graph_without_breaks(case):
    code = f"ROOT = {str(ROOT)!r}\n{COMMON}\n{CASES[case]}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    explained = json.loads(done.stdout.strip().splitlines()[-1])
    assert explained["graphs"] >= 1 and explained["breaks"] == 0, explained["reasons"]
