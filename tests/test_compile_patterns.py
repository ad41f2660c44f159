"""Research patterns built from the public API trace whole under torch.compile: at least one
graph and no graph break (``torch._dynamo.explain``; a break would fall back to eager silently).

Each pattern runs in a fresh interpreter: dynamo's caches and config outlive a test, and the
suite's runtime type checks (jaxtyping's import hook) draw random numbers dynamo refuses to
trace; they are not part of the library.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMMON = """
import importlib.util, json, sys, torch, torch._dynamo as dynamo
import minitrain as mt
from minitrain.train import load_experiment

def example(name):
    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dynamo looks a function's module up by name
    spec.loader.exec_module(module)
    return module

def explain(fn, *args, **kwargs):
    out = dynamo.explain(fn)(*args, **kwargs)
    print(json.dumps({"graphs": out.graph_count, "breaks": out.graph_break_count,
                      "reasons": [str(b.reason) for b in out.break_reasons]}))
"""

PATTERNS = {
    "value_and_grad + adamw": """
opt = mt.optim.adamw(lr=1e-2, weight_decay=0.1)
params = {"w": torch.randn(8, 4), "b": torch.zeros(4)}
x, y = torch.randn(16, 8), torch.randn(16, 4)
def loss(p, x, y):
    return mt.losses.mse(x @ p["w"] + p["b"], y)
def step(params, state, x, y):
    value, grads = mt.value_and_grad(loss)(params, x, y)
    params, state = opt.update(grads, state, params)
    return params, state, value
explain(step, params, opt.init(params), x, y)
""",
    "mt.train.make_train_step": """
experiment, _ = load_experiment(ROOT + "/examples/linreg.py")
step = mt.train.make_train_step(experiment, mt.get_backend("cpu"))
params = experiment.init(torch.Generator().manual_seed(0))
batch = experiment.next_batch(torch.Generator().manual_seed(1))
explain(lambda p, s, b: step(p, s, b).loss, params, experiment.optimizer.init(params), batch)
""",
    "vmapped ensemble building adam inside": """
ensemble, lrs = example("ensemble"), torch.logspace(-3, -1, 8)
def member_step(params, state, lr, x, y):
    value, grads = mt.value_and_grad(ensemble.loss)(params, x, y)
    params, state = mt.optim.adam(lr=lr).update(grads, state, params)
    return params, state, value
step = mt.vmap(member_step, in_dims=(0, 0, 0, None, None))
params = mt.tree.stack([ensemble.init(k) for k in mt.random.split(mt.random.key(0), 8)])
state = mt.vmap(lambda p: mt.optim.adam(lr=1e-3).init(p))(params)
x, y = ensemble.data(64, seed=0)
explain(step, params, state, lrs, x, y)
compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
torch.testing.assert_close(compiled(params, state, lrs, x, y), step(params, state, lrs, x, y))
""",
    "ensemble with a learning rate per member": """
ensemble, lrs = example("ensemble"), torch.logspace(-3, -1, 8)
params = mt.tree.stack([ensemble.init(k) for k in mt.random.split(mt.random.key(0), 8)])
adam = ensemble.adam_per_member(lrs)
state, step = adam.init(params), ensemble.make_ensemble_step(adam)
x, y = ensemble.data(64, seed=0)
explain(step, params, state, x, y)
compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
torch.testing.assert_close(compiled(params, state, x, y), step(params, state, x, y))
""",
    "MAML with unroll": """
experiment, _ = load_experiment(ROOT + "/examples/maml_sine.py", {"tasks": "4"})
generator = torch.Generator().manual_seed(0)
params = experiment.init(generator)
tasks = experiment.next_batch(generator)
def meta_step(params, state, tasks):
    (value, aux), grads = mt.value_and_grad(experiment.loss, has_aux=True)(params, tasks)
    params, state = experiment.optimizer.update(grads, state, params)
    return params, state, value
explain(meta_step, params, experiment.optimizer.init(params), tasks)
""",
    "DP-SGD step": """
experiment, _ = load_experiment(ROOT + "/examples/dp_sgd.py", {"batch_size": "16"})
generator = torch.Generator().manual_seed(0)
params = experiment.init(generator)
batch = experiment.next_batch(generator)
def dp_step(params, state, batch, key):
    (value, aux), grads = mt.value_and_grad(experiment.loss, has_aux=True)(params, batch,
                                                                           key=key)
    params, state = experiment.optimizer.update(grads, state, params)
    return params, state, value
explain(dp_step, params, experiment.optimizer.init(params), batch, mt.random.key(1))
""",
    "mt.models.gpt forward and backward": """
config = mt.models.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                             dropout=0.1)
params = mt.models.gpt_init(mt.random.key(0), config)
ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
def loss(params, ids, key):
    logits = mt.models.gpt(params, ids[:, :-1], key, config=config)
    return mt.losses.cross_entropy(logits, ids[:, 1:])
explain(mt.value_and_grad(loss), params, ids, mt.random.key(1))
""",
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_traces_as_graphs_without_breaks(pattern):
    code = f"ROOT = {str(ROOT)!r}\n{COMMON}\n{PATTERNS[pattern]}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    explained = json.loads(done.stdout.strip().splitlines()[-1])
    assert explained["graphs"] >= 1 and explained["breaks"] == 0, explained["reasons"]
