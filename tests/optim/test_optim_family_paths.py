"""The family's fast path (the same rules into recycled buffers) against its chains, state
bytes against the references' own state, and Muon routed by multi_transform."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lion_pytorch import Lion
from schedulefree import AdamWScheduleFree

import minitrain as mt

ALIASES = {
    "adadelta": (mt.optim.adadelta, dict(weight_decay=0.1, maximize=True)),
    "adamax": (mt.optim.adamax, dict(weight_decay=0.1)),
    "asgd": (mt.optim.asgd, dict(t0=2, weight_decay=0.1)),
    "nadam": (mt.optim.nadam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
    "radam": (mt.optim.radam, dict(weight_decay=0.1)),
    "rprop": (mt.optim.rprop, dict(maximize=True)),
    "lion": (mt.optim.lion, dict(weight_decay=0.1, lr=mt.optim.cosine_schedule(1e-3, 10))),
    "schedule_free_adamw": (mt.optim.schedule_free_adamw, dict(warmup_steps=3, weight_decay=0.1)),
}


def make(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (8, 6), "b": (6,), "s": ()}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(8)]
    return params, grads


@pytest.mark.parametrize("name", list(ALIASES))
def test_fast_path_equals_the_chain(name):
    """The same rule either way; the fast path folds ``-lr`` (and decoupled decay) into the
    final add, as torch.optim does, so the two agree to rounding."""
    factory, kwargs = ALIASES[name]
    fast = factory(**kwargs)
    chain = mt.optim.as_optimizer(fast.update.transformation)
    params, grads_seq = make()
    p1, s1 = params, fast.init(params)
    p2, s2 = params, chain.init(params)
    with torch.no_grad():
        for grads in grads_seq:
            p1, s1 = fast.update(grads, s1, p1)
            p2, s2 = chain.update(grads, s2, p2)
    for a, b in zip(mt.tree.leaves((p1, s1)), mt.tree.leaves((p2, s2)), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(ALIASES))
def test_results_kept_by_the_caller_are_never_reused(name):
    factory, kwargs = ALIASES[name]
    opt = factory(**kwargs)
    params, grads_seq = make(1)
    state = opt.init(params)
    kept = []
    with torch.no_grad():
        for grads in grads_seq:
            params, state = opt.update(grads, state, params)
            kept.append((params, state, [t.clone() for t in mt.tree.leaves((params, state))]))
    for params, state, copies in kept:
        assert all(torch.equal(a, b) for a, b in
                   zip(mt.tree.leaves((params, state)), copies, strict=True))


def torch_state_bytes(optimizer) -> int:
    """Bytes of per-param state tensors a reference optimizer keeps (O(1) scalars aside)."""
    return sum(
        value.nbytes for state in optimizer.state.values() for key, value in state.items()
        if isinstance(value, torch.Tensor) and key not in ("step", "mu_product", "eta", "mu")
    )


REFERENCES = [
    ("sgd", torch.optim.SGD, dict(momentum=0.9)),
    ("sgd", torch.optim.SGD, {}),
    ("adam", torch.optim.Adam, dict(amsgrad=True)),
    ("adamw", torch.optim.AdamW, {}),
    ("adagrad", torch.optim.Adagrad, {}),
    ("rmsprop", torch.optim.RMSprop, dict(momentum=0.9, centered=True)),
    ("adadelta", torch.optim.Adadelta, {}),
    ("adafactor", torch.optim.Adafactor, {}),
    ("adamax", torch.optim.Adamax, {}),
    ("asgd", torch.optim.ASGD, {}),
    ("nadam", torch.optim.NAdam, {}),
    ("radam", torch.optim.RAdam, {}),
    ("rprop", torch.optim.Rprop, {}),
    ("lion", Lion, {}),
    ("schedule_free_adamw", AdamWScheduleFree, {}),
]


@pytest.mark.parametrize(("name", "cls", "kwargs"), REFERENCES,
                         ids=[f"{n}-{'-'.join(k) or 'default'}" for n, _, k in REFERENCES])
def test_state_bytes_equal_the_reference_optimizers_state(name, cls, kwargs):
    shapes = [(16, 8), (3, 4, 5), (7,), ()]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    optimizer = cls(params, **kwargs)
    if hasattr(optimizer, "train"):
        optimizer.train()
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert mt.optim.state_bytes(name, params, **kwargs) == torch_state_bytes(optimizer)
    assert mt.optim.state_bytes(name, shapes, **kwargs) == torch_state_bytes(optimizer)


def test_state_bytes_of_muon_and_on_the_meta_device():
    params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(4, 4))]
    optimizer = torch.optim.Muon(params)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert mt.optim.state_bytes("muon", params) == torch_state_bytes(optimizer)
    meta = [torch.empty(1024, 1024, device="meta", dtype=torch.bfloat16)]
    assert mt.optim.state_bytes("adafactor", meta) == (1024 + 1024) * 2


@pytest.mark.parametrize("factory", [mt.optim.adadelta, mt.optim.adafactor, mt.optim.nadam,
                                     mt.optim.lion, mt.optim.schedule_free_adamw])
def test_state_bytes_equal_what_init_allocates(factory):
    name = factory.__name__
    params = {"w": torch.zeros(16, 8), "v": torch.zeros(3, 4, 5), "b": torch.zeros(7)}
    state = factory().init(params)
    per_leaf = [t for t in mt.tree.leaves(state) if t.dim() > 0]
    assert mt.optim.state_bytes(name, params) == sum(t.nbytes for t in per_leaf)


def test_state_bytes_of_an_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(ValueError, match="adafactor"):
        mt.optim.state_bytes("adamwx", [(2,)])


def test_muon_for_matrices_and_adamw_for_the_rest_equals_two_torch_optimizers():
    g = torch.Generator().manual_seed(0)
    params = {"embed": torch.randn(10, 8, generator=g), "hidden": torch.randn(8, 8, generator=g),
              "norm": torch.ones(8)}
    grads_seq = [{k: torch.randn(p.shape, generator=g) for k, p in params.items()}
                 for _ in range(5)]
    hidden = mt.optim.chain(mt.optim.scale_by_muon(), mt.optim.add_decayed_weights(0.1),
                            mt.optim.scale_by_learning_rate(0.02))
    rest = mt.optim.chain(mt.optim.scale_by_adam(), mt.optim.add_decayed_weights(0.01),
                          mt.optim.scale_by_learning_rate(1e-3))
    labels = lambda name, p: "muon" if name == "hidden" else "adamw"  # noqa: E731
    opt = mt.optim.as_optimizer(mt.optim.multi_transform({"muon": hidden, "adamw": rest}, labels))
    state = opt.init(params)
    leaves = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    muon = torch.optim.Muon([leaves["hidden"]], lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW([leaves["embed"], leaves["norm"]], lr=1e-3, weight_decay=0.01)
    for grads in grads_seq:
        params, state = opt.update(grads, state, params)
        for k, p in leaves.items():
            p.grad = grads[k].clone()
        muon.step()
        adamw.step()
    for k, p in leaves.items():
        torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-6)
    # learning_rate() looks inside multi_transform's dict of states: the first group's lr
    assert mt.optim.learning_rate(state) == pytest.approx(muon.param_groups[0]["lr"])


def _load_example(name: str):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bytelm_muon_reports_its_learning_rate_in_the_run_loop(tmp_path):
    """The example's optimizer (multi_transform then one schedule) gives learning_rate() the
    warmup's values, and ``minitrain run`` logs them for 3 steps of a small model."""
    import json
    import subprocess
    import sys

    from minitrain.data import source_files, stdlib_dir

    example = _load_example("bytelm_muon")
    config = {**example.CONFIG, "steps": 3, "warmup_steps": 2, "lr": 0.01}
    opt = example.muon_and_adamw(config)
    params = {"blocks.0.w": torch.randn(4, 4), "embed": torch.randn(3, 4)}
    state = opt.init(params)
    seen = []
    for _ in range(3):
        params, state = opt.update({k: torch.ones_like(p) for k, p in params.items()},
                                   state, params)
        seen.append(mt.optim.learning_rate(state))
    want = [0.0, 0.005, 0.01]  # linear warmup from 0 over 2 steps, then the cosine's peak
    assert seen == pytest.approx(want)

    source = tmp_path / "src"
    source.mkdir()
    for path in source_files(stdlib_dir())[:20]:
        (source / path.name).write_bytes(path.read_bytes())
    sets = ["d_model=32", "n_layers=1", "n_heads=2", "seq_len=32", "batch_size=4",
            "eval_every=0", "eval_batches=1", "lr=0.01", "warmup_steps=2",
            f"source_dir={source}", f"data_dir={tmp_path / 'data'}"]
    script = str(Path(__file__).resolve().parents[2] / "examples" / "bytelm_muon.py")
    done = subprocess.run(
        [sys.executable, "-m", "minitrain", "run", script, "--steps", "3", "--log-every", "1",
         "--out", str(tmp_path / "run"), "--json", *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [row["lr"] for row in rows if "lr" in row] == pytest.approx(want)


def test_concurrent_updates_on_one_optimizer_equal_sequential_ones():
    import threading

    opt = mt.optim.nadam(lr=0.01)
    runs = [make(seed) for seed in range(4)]
    want = []
    for params, grads_seq in runs:
        state = opt.init(params)
        for grads in grads_seq:
            params, state = opt.update(grads, state, params)
        want.append(params)
    got: dict[int, dict] = {}

    def work(index: int) -> None:
        params, grads_seq = runs[index]
        state = opt.init(params)
        for grads in grads_seq:
            params, state = opt.update(grads, state, params)
        got[index] = params

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, params in enumerate(want):
        for key in params:
            assert torch.equal(got[index][key], params[key])


@pytest.mark.parametrize("factory", [mt.optim.nadam, mt.optim.radam, mt.optim.asgd,
                                     mt.optim.rprop, mt.optim.schedule_free_adamw,
                                     mt.optim.adafactor])
def test_updates_vmap_over_an_ensemble(factory):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, 2, generator=g)}
    grads = {"w": torch.randn(3, 4, 2, generator=g)}
    opt = factory()

    def run(p, grad):
        state = opt.init(p)
        for _ in range(7):  # past RAdam's rectification threshold
            p, state = opt.update(grad, state, p)
        return p

    batched = torch.func.vmap(run)(params, grads)["w"]
    members = torch.stack([run({"w": params["w"][i]}, {"w": grads["w"][i]})["w"]
                           for i in range(3)])
    torch.testing.assert_close(batched, members, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factory", [mt.optim.adafactor, mt.optim.nadam, mt.optim.adamw])
def test_a_batched_state_updates_under_vmap(factory):
    """A state made by ``vmap(opt.init)`` carries a batched count, so each update's step is
    traced (Adafactor's lerp weight then follows the leaf's dtype); it updates as each member
    does on its own."""
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(3, 4, 2, generator=g)}
    grads = {"w": torch.randn(3, 4, 2, generator=g)}
    opt = factory()
    batched, state = params, torch.func.vmap(opt.init)(params)
    for _ in range(3):
        batched, state = torch.func.vmap(opt.update)(grads, state, batched)
    members = []
    for i in range(3):
        member, member_state = {"w": params["w"][i]}, opt.init({"w": params["w"][i]})
        for _ in range(3):
            member, member_state = opt.update({"w": grads["w"][i]}, member_state, member)
        members.append(member["w"])
    torch.testing.assert_close(batched["w"], torch.stack(members), rtol=1e-5, atol=1e-6)


COMPILED_UPDATE = """
import torch, minitrain as mt
g = torch.Generator().manual_seed(2)
params = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g)}
grads_seq = [{k: torch.randn(p.shape, generator=g) for k, p in params.items()} for _ in range(8)]
for factory, kwargs in [(mt.optim.asgd, dict(t0=2, weight_decay=0.1)),
                        (mt.optim.schedule_free_adamw, dict(warmup_steps=3, weight_decay=0.1))]:
    fast, compiled = factory(**kwargs), factory(**kwargs, impl="compiled")
    p1, s1 = params, fast.init(params)
    p2, s2 = params, compiled.init(params)
    with torch.no_grad():
        for grads in grads_seq:  # one compile: new steps and scalars are tensor inputs
            p1, s1 = fast.update(grads, s1, p1)
            p2, s2 = compiled.update(grads, s2, p2)
    for a, b in zip(mt.tree.leaves((p1, s1)), mt.tree.leaves((p2, s2)), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_compiled_update_equals_the_fast_path():
    # A fresh interpreter: under pytest the jaxtyping import hook wraps every function in
    # checks that dynamo cannot trace (as tests/optim/test_optim.py does for the aliases).
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", COMPILED_UPDATE], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MINITRAIN_TYPECHECK": "0"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("name", list(ALIASES))
def test_the_counter_counts_the_first_update_like_every_other(name, monkeypatch):
    """The fast path learns on first use which ops take ``out=`` by running them once more;
    under the accounting Counter that second run is not the update's, so it is not made."""
    from minitrain.accounting import Counter
    from minitrain.optim import _pooled

    monkeypatch.setattr(_pooled, "_OUT_SPECS", {})
    factory, kwargs = ALIASES[name]
    opt = factory(**kwargs)
    params, grads = make()
    state = opt.init(params)
    counts = []
    for g in grads[:2]:
        with Counter() as counter:
            params, state = opt.update(g, state, params)
        counts.append((counter.flops, dict(counter.unknown)))
    assert counts[0] == counts[1] and counts[0][1] == {}


def _strided_grad(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if kind == "expanded":  # the gradient of 0.0 * p.sum(): stride 0, one element of storage
        return torch.randn((), generator=g).expand(shape)
    if kind == "transposed":
        return torch.randn(cols, rows, generator=g).t()
    if kind == "sliced":
        return torch.randn(rows, 2 * cols, generator=g)[:, ::2]
    return torch.randn(rows + cols, generator=g).as_strided(shape, (1, 1))  # overlapping rows


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(ALIASES)),
       kind=st.sampled_from(["expanded", "transposed", "sliced", "overlapping"]),
       shape=st.tuples(st.integers(1, 19), st.integers(1, 19)), seed=st.integers(0, 2**16))
def test_strided_grads_update_like_contiguous_ones(name, kind, shape, seed):
    factory, kwargs = ALIASES[name]
    opt = factory(**kwargs)
    params = {"w": torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))}
    grad = _strided_grad(kind, shape, seed)
    state = opt.init(params)
    strided, strided_state = opt.update({"w": grad}, state, params)
    contiguous, contiguous_state = opt.update({"w": grad.contiguous()}, state, params)
    for a, b in zip(mt.tree.leaves((strided, strided_state)),
                    mt.tree.leaves((contiguous, contiguous_state)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
