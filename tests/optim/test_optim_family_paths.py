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
from tests.muon_harness import muon_run_against_torch

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


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"lr": 0.02, "weight_decay": 0.0, "nesterov": False},
        {"lr": 0.05, "weight_decay": 0.3, "adjust_lr_fn": "match_rms_adamw"},
        {"momentum": 0.5, "ns_steps": 3, "eps": 1e-5, "adjust_lr_fn": "original"},
    ],
)
@pytest.mark.parametrize("stack_bytes", [None, 2 * 2 * 48 * 32], ids=["one_stack", "stacks_of_2"])
def test_muon_fast_path_is_torch_optim_muon_bit_for_bit(kwargs, donate, stack_bytes, monkeypatch):
    """Matrices of one shape run one batched Newton-Schulz (bmm/baddbmm) per stack, and still
    equal torch's one-matrix-at-a-time loop bit for bit."""
    from minitrain.optim import _muon

    stacks = []
    run_stack = _muon._muon_stack
    monkeypatch.setattr(_muon, "_muon_stack", lambda ps, *a: stacks.append(len(ps))
                        or run_stack(ps, *a))
    if stack_bytes is not None:
        monkeypatch.setattr(_muon, "STACK_BYTES", stack_bytes)
    g = torch.Generator().manual_seed(3)
    shapes = {"tall": (48, 32), "wide": (32, 56), "tall2": (48, 32), "square": (40, 40),
              "wide2": (32, 56), "tall3": (48, 32)}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads_seq = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(4)]
    ref = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    torch_opt = torch.optim.Muon(list(ref.values()), **kwargs)
    opt = mt.optim.muon(**kwargs)
    ours = mt.tree.map(torch.clone, params)
    state = opt.init(ours)
    for grads in grads_seq:
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        ours, state = opt.update(grads, state, ours, donate=donate)
        for k, p in ref.items():
            assert torch.equal(ours[k], p.detach()), k
            assert torch.equal(state[0][0].momentum_buffer[k],
                               torch_opt.state[p]["momentum_buffer"]), k
    per_step = [3, 2, 1] if stack_bytes is None else [2, 1, 1, 1, 1]  # tall, wide, square
    assert stacks == per_step * len(grads_seq)
    assert int(state[0][0].count) == int(state[-1].count) == len(grads_seq)


_muon_run_against_torch = muon_run_against_torch


def _counting_newton_schulz(monkeypatch, batched_result):
    """Replace Newton-Schulz by one that counts its 2-D and stacked calls and computes a
    stack with ``batched_result(stack, one_at_a_time)``."""
    from minitrain.optim import _muon

    calls = []
    one = _muon.newton_schulz

    def counted(x, *args):
        calls.append(x.dim())
        if x.dim() == 2:
            return one(x, *args)
        return batched_result(x, torch.stack([one(m, *args) for m in x.unbind(0)]))

    monkeypatch.setattr(_muon, "newton_schulz", counted)
    monkeypatch.setattr(_muon, "_STACK_IS_EXACT", {})
    return calls, _muon


def test_muon_stacks_same_shape_matrices_once_a_batched_run_proved_exact(monkeypatch):
    calls, _muon = _counting_newton_schulz(monkeypatch, lambda stack, alone: alone)
    _muon_run_against_torch(steps=3)
    # step 1 first tries random matrices of the stack's shape both ways, then every step
    # runs the stack in one batched run
    assert calls == [3] + [2] * 4 + [3, 3, 3]
    assert list(_muon._STACK_IS_EXACT.values()) == [True]


def test_muon_runs_one_matrix_at_a_time_where_a_batched_run_rounds_differently(monkeypatch):
    """A GEMM library whose batched kernels round differently costs the stacking, never the
    bits: the result stays torch's."""
    calls, _muon = _counting_newton_schulz(
        monkeypatch, lambda stack, alone: alone + torch.finfo(torch.bfloat16).eps
    )
    _muon_run_against_torch(steps=3)
    assert calls == [3, 2] + [2] * 12  # the check stops at the first matrix that differs
    assert list(_muon._STACK_IS_EXACT.values()) == [False]


def test_a_first_update_of_zeros_does_not_decide_the_stacking(monkeypatch):
    """Zero grads (a zero-initialised projection) round alike either way: the check runs on
    random matrices, so a batched kernel that rounds other values differently is still
    caught."""
    calls, _muon = _counting_newton_schulz(
        monkeypatch, lambda stack, alone: alone + torch.finfo(torch.bfloat16).eps * alone.ne(0)
    )
    _muon_run_against_torch(steps=2, zero_first=True)
    assert list(_muon._STACK_IS_EXACT.values()) == [False]


def test_muon_takes_empty_and_non_contiguous_matrices():
    """A 0-size matrix (torch steps it) and a transposed grad: one at a time, torch's bits."""
    params = {"empty": torch.zeros(0, 40), "a": torch.randn(40, 48), "b": torch.randn(40, 48)}
    ref = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    grads = {"empty": torch.zeros(0, 40), "a": torch.randn(48, 40).T, "b": torch.randn(40, 48)}
    for k, p in ref.items():
        p.grad = grads[k].clone()
    torch.optim.Muon(list(ref.values()), lr=0.02).step()
    opt = mt.optim.muon(lr=0.02)
    new, _ = opt.update(grads, opt.init(params), params)
    for k, p in ref.items():
        assert torch.equal(new[k], p.detach()), k


def test_muon_stacks_are_exact_on_this_machines_gemms_or_not_taken():
    """The real kernels, over shapes where oneDNN's batched bfloat16 GEMMs were seen to round
    both ways (tall, wide, one side of 17, tiny): equal to torch.optim.Muon either way."""
    _muon_run_against_torch(steps=2, shapes=[(300, 17)] * 8 + [(5, 12)] * 2 + [(64, 96)] * 3
                            + [(96, 64)] * 3)


def test_muon_stacks_are_predicted_and_counted_one_matrix_at_a_time(monkeypatch):
    """The step predictor (meta and fake tensors) and the accounting Counter see Muon's
    one-at-a-time ops, whatever a real update learned: the prediction equals the count, and
    nothing is compared (counted twice) under them."""
    from minitrain.accounting import Counter
    from minitrain.accounting.predict import TensorSpec, predict_step
    from minitrain.optim import _muon

    monkeypatch.setattr(_muon, "_STACK_IS_EXACT", {})
    params = {f"w{i}": torch.randn(48, 40) for i in range(4)}
    loss = lambda p, x: sum((x @ w).tanh().sum() for w in p.values())  # noqa: E731
    opt = mt.optim.muon(lr=0.02)
    predicted = predict_step(loss, params, TensorSpec((8, 48)), optimizer=opt)
    without_update = predict_step(loss, params, TensorSpec((8, 48)))
    assert _muon._STACK_IS_EXACT == {}
    assert "aten.bmm" not in predicted.per_op
    grads = mt.tree.map(torch.randn_like, params)
    state = opt.init(params)
    opt.update(grads, state, params)  # a real update: checks the stack once
    assert len(_muon._STACK_IS_EXACT) == 1
    with Counter(keep_records=False) as counter:
        opt.update(grads, state, params)
    assert counter.flops == predicted.flops - without_update.flops
    assert "aten.bmm" not in str(counter.flop_counts())
    monkeypatch.setattr(_muon, "_STACK_IS_EXACT", {})
    with Counter(keep_records=False) as first:  # a first update, counted: not checked twice
        opt.update(grads, state, params)
    assert first.flops == counter.flops and _muon._STACK_IS_EXACT == {}
    # per matrix and step: X X^T, then the two addmms (the tall 48 x 40 runs transposed)
    assert counter.matmul_flops == 4 * 5 * (2 * 40 * 48 * 40 + 2 * 40**3 + 2 * 40 * 40 * 48)


def test_muon_fast_path_with_a_schedule_equals_its_chain():
    opt = mt.optim.muon(lr=mt.optim.cosine_schedule(0.05, 5), weight_decay=0.1)
    g = torch.Generator().manual_seed(4)
    params = {"a": torch.randn(5, 3, generator=g), "b": torch.randn(3, 3, generator=g)}
    fast, plain = mt.tree.map(torch.clone, params), mt.tree.map(torch.clone, params)
    fast_state, plain_state = opt.init(fast), opt.init(plain)
    chain = opt.update.transformation  # the chain itself: no lowering
    for _ in range(5):
        grads = {k: torch.randn(p.shape, generator=g) for k, p in params.items()}
        fast, fast_state = opt.update(grads, fast_state, fast)
        updates, plain_state = chain.update(grads, plain_state, plain)
        plain = mt.optim.apply_updates(plain, updates)
        for k in params:
            torch.testing.assert_close(fast[k], plain[k], rtol=1e-6, atol=1e-7)
    assert float(fast_state[-1].lr) == float(plain_state[-1].lr)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_stacking_check_is_redone_for_another_cuda_gemm_library(monkeypatch):
    """cuBLAS and cuBLASLt may round a batched run differently: the check's cache key holds
    the GEMM library torch prefers."""
    _, _muon = _counting_newton_schulz(monkeypatch, lambda stack, alone: alone)
    assert "cublas" in _muon._blas_library().lower()  # the real query, before it is replaced
    matrices = [torch.randn(64, 64, device="cuda") for _ in range(2)]
    for library in ("cublas", "cublaslt"):
        monkeypatch.setattr(_muon, "_blas_library", lambda library=library: library)
        _muon.newton_schulz_each(matrices)
    assert len(_muon._STACK_IS_EXACT) == 2
