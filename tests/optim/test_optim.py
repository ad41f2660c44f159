"""mt.optim against torch.optim, step for step, plus invariants, paths, donation and errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

import minitrain as mt

OPTIMIZERS = {
    "sgd": (mt.optim.sgd, torch.optim.SGD),
    "adagrad": (mt.optim.adagrad, torch.optim.Adagrad),
    "rmsprop": (mt.optim.rmsprop, torch.optim.RMSprop),
    "adam": (mt.optim.adam, torch.optim.Adam),
    "adamw": (mt.optim.adamw, torch.optim.AdamW),
}
BUFFERS = {
    "sgd": ("momentum_buffer",),
    "adagrad": ("sum",),
    "rmsprop": ("square_avg", "momentum_buffer", "grad_avg"),
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
}
RTOL, ATOL = 1e-5, 1e-6


def hyperparameters(name: str) -> st.SearchStrategy[dict]:
    """Random valid hyperparameters for optimizer ``name`` (torch.optim keyword names)."""
    lr = st.floats(1e-4, 0.1)
    decay = st.sampled_from([0.0, 1e-3, 0.1])
    if name == "sgd":
        return st.builds(
            lambda lr, momentum, dampening, nesterov, weight_decay: dict(
                lr=lr, momentum=momentum, weight_decay=weight_decay,
                dampening=0.0 if nesterov else dampening,
                nesterov=nesterov and momentum > 0,
            ),
            lr, st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.0, 0.3]), st.booleans(), decay,
        )
    if name == "adagrad":
        return st.fixed_dictionaries(dict(
            lr=lr, lr_decay=st.sampled_from([0.0, 0.01]), weight_decay=decay,
            initial_accumulator_value=st.sampled_from([0.0, 0.1]),
            eps=st.sampled_from([1e-10, 1e-6]),
        ))
    if name == "rmsprop":
        return st.fixed_dictionaries(dict(
            lr=st.floats(1e-4, 1e-2), alpha=st.sampled_from([0.9, 0.99]),
            eps=st.sampled_from([1e-8, 1e-6]), weight_decay=decay,
            momentum=st.sampled_from([0.0, 0.9]), centered=st.booleans(),
        ))
    return st.fixed_dictionaries(dict(
        lr=lr, betas=st.tuples(st.sampled_from([0.0, 0.8, 0.9]), st.sampled_from([0.99, 0.999])),
        eps=st.sampled_from([1e-8, 1e-6]), weight_decay=decay, amsgrad=st.booleans(),
    ))


shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=4)


def make_tree(shape_list: list[list[int]], seed: int) -> dict:
    """A nested pytree (dicts and lists, 0-d leaves allowed) of random fp32 tensors."""
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(tuple(shape), generator=g) for shape in shape_list]
    return {"layers": [{"weight": leaf} for leaf in leaves[1:]], "head": leaves[0]}


def random_grads(params, g: torch.Generator):
    return mt.tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)


def run_torch(name, kwargs, params, grads_seq, param_groups=None):
    leaves = [torch.nn.Parameter(p.detach().clone()) for p in mt.tree.leaves(params)]
    groups = param_groups(leaves) if param_groups else leaves
    optimizer = OPTIMIZERS[name][1](groups, **kwargs, foreach=False)
    for grads in grads_seq:
        for p, g in zip(leaves, mt.tree.leaves(grads), strict=True):
            p.grad = g.clone()
        optimizer.step()
    return leaves, optimizer


def run_minitrain(name, kwargs, params, grads_seq, impl="auto", **extra):
    opt = OPTIMIZERS[name][0](**kwargs, impl=impl, **extra)
    state = opt.init(params)
    for grads in grads_seq:
        params, state = opt.update(grads, state, params)
    return params, state


def assert_matches_torch(name, params, state, leaves, optimizer):
    for ours, theirs in zip(mt.tree.leaves(params), leaves, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=RTOL, atol=ATOL)
    for buffer in BUFFERS[name]:
        ours = getattr(state, buffer)
        if ours == ():
            continue
        for leaf, p in zip(mt.tree.leaves(ours), leaves, strict=True):
            torch.testing.assert_close(leaf, optimizer.state[p][buffer], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl", ["fast", "plain"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@settings(deadline=None, max_examples=6)
@given(data=st.data(), shape_list=shapes, seed=st.integers(0, 2**16))
def test_matches_torch_optim_for_30_steps(name, impl, data, shape_list, seed):
    kwargs = data.draw(hyperparameters(name))
    params = make_tree(shape_list, seed)
    g = torch.Generator().manual_seed(seed + 1)
    grads_seq = [random_grads(params, g) for _ in range(30)]
    ours, state = run_minitrain(name, kwargs, params, grads_seq, impl=impl)
    leaves, optimizer = run_torch(name, kwargs, params, grads_seq)
    assert_matches_torch(name, ours, state, leaves, optimizer)
    assert int(state.count) == 30


class ChapterSGD(torch.optim.Optimizer):
    """The chapter's SGD (3.5.5), verbatim but for the class name."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                grad = p.grad.data
                p.data -= lr * grad


class ChapterAdaGrad(torch.optim.Optimizer):
    """The chapter's AdaGrad (3.5.5, first listing): std = sqrt(sum) + 1e-10."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.data
                state = self.state[p]
                if "sum_squared_grad" not in state:
                    state["sum_squared_grad"] = torch.zeros_like(p.data)
                state["sum_squared_grad"] += grad**2
                std = state["sum_squared_grad"].sqrt() + 1e-10
                p.data -= group["lr"] * grad / std


@pytest.mark.parametrize("impl", ["fast", "plain"])
@pytest.mark.parametrize(
    "factory, chapter_class", [(mt.optim.sgd, ChapterSGD), (mt.optim.adagrad, ChapterAdaGrad)]
)
def test_matches_the_chapters_optimizers(factory, chapter_class, impl):
    params = make_tree([[4, 3], [3], []], seed=0)
    g = torch.Generator().manual_seed(1)
    grads_seq = [random_grads(params, g) for _ in range(30)]
    leaves = [torch.nn.Parameter(p.clone()) for p in mt.tree.leaves(params)]
    chapter = chapter_class(leaves, lr=0.05)
    opt = factory(lr=0.05, impl=impl)
    state = opt.init(params)
    for grads in grads_seq:
        for p, grad in zip(leaves, mt.tree.leaves(grads), strict=True):
            p.grad = grad.clone()
        chapter.step()
        params, state = opt.update(grads, state, params)
    for ours, theirs in zip(mt.tree.leaves(params), leaves, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=RTOL, atol=ATOL)


ALL_CONFIGS = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.5)),
    ("adagrad", dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
    ("rmsprop", dict(lr=0.01)),
    ("rmsprop", dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1)),
    ("adam", dict(lr=0.01, weight_decay=0.1)),
    ("adam", dict(lr=0.01, amsgrad=True)),
    ("adamw", dict(lr=0.01)),
    ("adamw", dict(lr=0.01, amsgrad=True, betas=(0.5, 0.9))),
]


@pytest.mark.parametrize("name, kwargs", ALL_CONFIGS)
def test_fast_and_plain_paths_agree_on_mixed_dtypes(name, kwargs):
    g = torch.Generator().manual_seed(0)
    params = {
        "a": [torch.randn(3, 4, generator=g), torch.randn((), generator=g)],
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 2, generator=g, dtype=torch.float64),
    }
    grads_seq = [random_grads(params, g) for _ in range(5)]
    fast, fast_state = run_minitrain(name, kwargs, params, grads_seq, impl="fast")
    plain, plain_state = run_minitrain(name, kwargs, params, grads_seq, impl="plain")
    assert fast["b"].dtype == torch.bfloat16 and fast["c"].dtype == torch.float64
    for (key, x), y in zip(mt.tree.named_leaves((fast, fast_state)),
                           mt.tree.leaves((plain, plain_state)), strict=True):
        assert x.dtype == y.dtype, key
        low_precision = x.dtype == torch.bfloat16
        tol = dict(rtol=0.1, atol=0.1) if low_precision else dict(rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(x, y, **tol, msg=lambda m, key=key: f"{key}: {m}")


def versions(*trees):
    return [t._version for t in mt.tree.leaves(trees) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("impl", ["fast", "plain"])
@pytest.mark.parametrize("name, kwargs", ALL_CONFIGS)
def test_update_never_mutates_its_inputs(name, kwargs, impl):
    params = make_tree([[3, 2], [4], []], seed=0)
    opt = OPTIMIZERS[name][0](**kwargs, impl=impl)
    state = opt.init(params)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = random_grads(params, g)
        snapshot = [t.clone() for t in mt.tree.leaves((params, grads, state))]
        before = versions(params, grads, state)
        new_params, new_state = opt.update(grads, state, params)
        assert versions(params, grads, state) == before
        for old, now in zip(snapshot, mt.tree.leaves((params, grads, state)), strict=True):
            assert torch.equal(old, now)
        params, state = new_params, new_state


@pytest.mark.parametrize("name, kwargs", ALL_CONFIGS)
def test_donation_reuses_buffers_and_gives_the_same_numbers(name, kwargs):
    params = make_tree([[3, 2], [4], []], seed=0)
    opt = OPTIMIZERS[name][0](**kwargs, impl="fast")
    g = torch.Generator().manual_seed(0)
    grads_seq = [random_grads(params, g) for _ in range(4)]
    pure_params, pure_state = params, opt.init(params)
    donated = mt.tree.map(torch.clone, params)
    donated_state = opt.init(donated)
    for grads in grads_seq:
        pure_params, pure_state = opt.update(grads, pure_state, pure_params)
        pointers = [t.data_ptr() for t in mt.tree.leaves(donated)]
        donated, donated_state = opt.update(grads, donated_state, donated, donate=True)
        assert [t.data_ptr() for t in mt.tree.leaves(donated)] == pointers
    for x, y in zip(mt.tree.leaves((pure_params, pure_state)),
                    mt.tree.leaves((donated, donated_state)), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_sgd_with_zero_grads_and_no_weight_decay_changes_nothing():
    params = make_tree([[3, 3], [2]], seed=0)
    for impl in ("fast", "plain"):
        opt = mt.optim.sgd(lr=0.5, momentum=0.9, impl=impl)
        new, state = params, opt.init(params)
        for _ in range(5):
            new, state = opt.update(mt.tree.zeros_like(params), state, new)
        for x, y in zip(mt.tree.leaves(new), mt.tree.leaves(params), strict=True):
            assert torch.equal(x, y)


@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_adagrad_accumulator_never_decreases(seed, scale):
    params = make_tree([[4], [2, 2]], seed)
    opt = mt.optim.adagrad(lr=0.1, weight_decay=0.1)
    state = opt.init(params)
    g = torch.Generator().manual_seed(seed)
    for _ in range(10):
        grads = mt.tree.map(lambda p: p * scale, random_grads(params, g))
        old_sum = state.sum
        params, state = opt.update(grads, state, params)
        for old, new in zip(mt.tree.leaves(old_sum), mt.tree.leaves(state.sum), strict=True):
            assert bool((new >= old).all())


@pytest.mark.parametrize("name", ["adam", "adamw"])
@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16), lr=st.floats(1e-4, 1.0), scale=st.floats(1e-3, 1e3))
def test_adams_first_step_moves_each_coordinate_by_at_most_lr(name, seed, lr, scale):
    params = make_tree([[5], [3, 3]], seed)
    opt = OPTIMIZERS[name][0](lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    grads = mt.tree.map(lambda p: p * scale, random_grads(params, g))
    new, _ = opt.update(grads, opt.init(params), params)
    for x, y in zip(mt.tree.leaves(new), mt.tree.leaves(params), strict=True):
        assert float((x - y).abs().max()) <= lr * (1 + 1e-5) + 1e-7


def save_state(state) -> tuple[bytes, str]:
    """Tensor leaves to safetensors by name, the rest to JSON (as the checkpoint code does)."""
    named = mt.tree.named_leaves(state)
    tensors = {name: leaf for name, leaf in named if isinstance(leaf, torch.Tensor)}
    numbers = {name: leaf for name, leaf in named if not isinstance(leaf, torch.Tensor)}
    return save(tensors), json.dumps(numbers)


def load_state(template, blob: bytes, text: str):
    tensors, numbers = load(blob), json.loads(text)
    leaves = [tensors[name] if name in tensors else numbers[name]
              for name, _ in mt.tree.named_leaves(template)]
    return mt.tree.unflatten(mt.tree.structure(template), leaves)


@pytest.mark.parametrize("name, kwargs", ALL_CONFIGS)
def test_state_round_trips_through_safetensors_and_json(name, kwargs):
    params = make_tree([[3, 2], [4], []], seed=0)
    opt = OPTIMIZERS[name][0](**kwargs)
    state = opt.init(params)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        params, state = opt.update(random_grads(params, g), state, params)
    restored = load_state(opt.init(params), *save_state(state))
    grads = random_grads(params, g)
    a = opt.update(grads, state, params)
    b = opt.update(grads, restored, params)
    for x, y in zip(mt.tree.leaves(a), mt.tree.leaves(b), strict=True):
        assert torch.equal(x, y)


def rosenbrock(params):
    x, y = params["x"], params["y"]
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def quadratic(params):
    return ((params["x"] - 2.0) ** 2).sum() + ((params["y"] + 1.0) ** 2).sum()


CONVERGENCE = [  # factory, hyperparameters, steps
    (mt.optim.sgd, dict(lr=1e-3, momentum=0.9), 2000),
    (mt.optim.adagrad, dict(lr=0.3), 3000),  # AdaGrad's shrinking steps crawl along the valley
    (mt.optim.rmsprop, dict(lr=3e-3, momentum=0.5), 2000),
    (mt.optim.adam, dict(lr=2e-2), 2000),
    (mt.optim.adamw, dict(lr=2e-2, weight_decay=0.0), 2000),
]


@pytest.mark.parametrize("loss_fn, tolerance", [(quadratic, 1e-6), (rosenbrock, 1e-3)])
@pytest.mark.parametrize("factory, kwargs, steps", CONVERGENCE)
def test_converges_on_quadratic_and_rosenbrock(factory, kwargs, steps, loss_fn, tolerance):
    # optax alias_test.py: every optimizer drives a parabola and Rosenbrock's valley to their
    # minimum (0 at (2, -1) and at (1, 1)); from (-1, 1.5) the losses start at 10.25 and 29.
    params = {"x": torch.tensor(-1.0, dtype=torch.float64),
              "y": torch.tensor(1.5, dtype=torch.float64)}
    start = float(loss_fn(params))
    opt = factory(**kwargs)
    state = opt.init(params)
    grad_fn = torch.func.grad(loss_fn)
    for _ in range(steps):
        params, state = opt.update(grad_fn(params), state, params)
    assert float(loss_fn(params)) < tolerance * start


@pytest.mark.parametrize("impl", ["fast", "plain"])
@pytest.mark.parametrize("as_function", [True, False])
def test_weight_decay_mask_matches_torch_param_groups(impl, as_function):
    params = {"w": torch.randn(4, 3), "b": torch.randn(3), "v": torch.randn(3, 3)}
    mask = (lambda name, p: p.ndim >= 2) if as_function else {"w": True, "b": False, "v": True}
    g = torch.Generator().manual_seed(0)
    grads_seq = [random_grads(params, g) for _ in range(10)]
    kwargs = dict(lr=0.05, weight_decay=0.3)
    ours, state = run_minitrain("adamw", kwargs, params, grads_seq, impl=impl, mask=mask)

    def groups(leaves):
        return [{"params": [leaves[0], leaves[2]]}, {"params": [leaves[1]], "weight_decay": 0.0}]

    leaves, optimizer = run_torch("adamw", kwargs, params, grads_seq, param_groups=groups)
    assert_matches_torch("adamw", ours, state, leaves, optimizer)


def test_schedules_match_torch_lr_schedulers():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    schedule = mt.optim.step_schedule(0.5, step_size=3, gamma=0.5)
    for step in range(10):
        assert math.isclose(schedule(step), optimizer.param_groups[0]["lr"])
        optimizer.step()
        step_lr.step()
    optimizer = torch.optim.SGD([param], lr=0.5)
    cosine_lr = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20, eta_min=0.05)
    schedule = mt.optim.cosine_schedule(0.5, decay_steps=20, end_value=0.05)
    for step in range(20):
        assert math.isclose(schedule(step), optimizer.param_groups[0]["lr"], rel_tol=1e-9)
        assert math.isclose(float(schedule(torch.tensor(step))), schedule(step), rel_tol=1e-6)
        optimizer.step()
        cosine_lr.step()


def test_learning_rate_is_read_from_the_state_and_follows_the_schedule():
    schedule = mt.optim.cosine_schedule(1.0, decay_steps=10, warmup_steps=3)
    for impl in ("fast", "plain"):
        opt = mt.optim.sgd(lr=schedule, momentum=0.9, impl=impl)
        params = {"w": torch.zeros(2)}
        state = opt.init(params)
        assert mt.optim.learning_rate(state) == schedule(0)
        for step in range(12):
            params, state = opt.update({"w": torch.ones(2)}, state, params)
            assert math.isclose(mt.optim.learning_rate(state), schedule(step), rel_tol=1e-6)


def test_clip_by_global_norm_matches_torch():
    grads = {"a": torch.randn(4, 3) * 10, "b": [torch.randn(5), torch.randn(())]}
    leaves = [torch.nn.Parameter(torch.zeros_like(g)) for g in mt.tree.leaves(grads)]
    for p, g in zip(leaves, mt.tree.leaves(grads), strict=True):
        p.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(leaves, max_norm=1.0)
    clipped, norm = mt.optim.clip_by_global_norm(grads, 1.0)
    torch.testing.assert_close(norm, expected_norm)
    for ours, p in zip(mt.tree.leaves(clipped), leaves, strict=True):
        torch.testing.assert_close(ours, p.grad)
    small, _ = mt.optim.clip_by_global_norm(grads, 1e6)
    for x, y in zip(mt.tree.leaves(small), mt.tree.leaves(grads), strict=True):
        assert torch.equal(x, y)


def test_vmap_over_an_ensemble_with_per_member_hyperparameters():
    members = 3
    params = {"w": torch.randn(members, 4, 2), "b": torch.randn(members, 2)}
    grads = {"w": torch.randn(members, 4, 2), "b": torch.randn(members, 2)}
    lrs = torch.tensor([0.1, 0.01, 0.001])
    decays = torch.tensor([0.0, 0.1, 0.5])

    def member_update(params, grads, lr, weight_decay):
        opt = mt.optim.adamw(lr=lr, weight_decay=weight_decay)
        state = opt.init(params)
        for _ in range(3):
            params, state = opt.update(grads, state, params)
        return params, state

    batched, batched_state = torch.func.vmap(member_update)(params, grads, lrs, decays)
    for k in range(members):
        one = mt.tree.map(lambda t, k=k: t[k], params)
        one_grads = mt.tree.map(lambda t, k=k: t[k], grads)
        opt = mt.optim.adamw(lr=float(lrs[k]), weight_decay=float(decays[k]), impl="fast")
        state = opt.init(one)
        for _ in range(3):
            one, state = opt.update(one_grads, state, one)
        torch.testing.assert_close(batched["w"][k], one["w"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(batched_state.exp_avg_sq["b"][k], state.exp_avg_sq["b"])


COMPILED_UPDATE = """
import torch, minitrain as mt
params = {"w": torch.randn(4, 3), "b": [torch.randn(3), torch.randn(())]}
grads = mt.tree.map(torch.randn_like, params)
opt = mt.optim.adamw(lr=mt.optim.cosine_schedule(0.01, decay_steps=10), weight_decay=0.1)
state = opt.init(params)
compiled = torch.compile(opt.update, backend="aot_eager", fullgraph=True)
for _ in range(3):
    expected = opt.update(grads, state, params)
    got = compiled(grads, state, params)
    for x, y in zip(mt.tree.leaves(expected), mt.tree.leaves(got), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    params, state = expected
# impl="compiled": the plain math fused by inductor into recycled buffers, same numbers.
for factory, kwargs in [(mt.optim.adamw, dict(lr=0.01, amsgrad=True)),
                        (mt.optim.sgd, dict(lr=0.1, momentum=0.9, nesterov=True))]:
    fast, compiled = factory(**kwargs, impl="fast"), factory(**kwargs, impl="compiled")
    a = b = params
    sa, sb = fast.init(a), compiled.init(b)
    for _ in range(3):
        before = [t._version for t in mt.tree.leaves((b, sb, grads))]
        a, sa = fast.update(grads, sa, a)
        new_b, new_sb = compiled.update(grads, sb, b)
        assert [t._version for t in mt.tree.leaves((b, sb, grads))] == before
        b, sb = new_b, new_sb
    for x, y in zip(mt.tree.leaves((a, sa)), mt.tree.leaves((b, sb)), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_compiled_update_traces_whole_and_matches_eager():
    # A fresh interpreter: under pytest the jaxtyping import hook wraps every function in
    # checks that dynamo cannot trace.
    result = subprocess.run(
        [sys.executable, "-c", COMPILED_UPDATE], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MINITRAIN_TYPECHECK": "0"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_auto_takes_the_plain_path_when_tracing_or_differentiating(monkeypatch):
    from minitrain.optim.base import use_plain_path

    leaf = torch.ones(2)
    assert not use_plain_path("auto", [leaf], [0.1])
    assert use_plain_path("plain", [leaf], [0.1]) and not use_plain_path("fast", [leaf], [0.1])
    assert use_plain_path("auto", [torch.ones(2, requires_grad=True)], [0.1])
    torch.func.vmap(lambda x: x + float(use_plain_path("auto", [x], [0.1])))(torch.ones(3, 2))
    seen = []
    torch.func.vmap(lambda x: seen.append(use_plain_path("auto", [x], [0.1])) or x)(leaf)
    assert seen == [True]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert use_plain_path("auto", [leaf], [0.1])


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: mt.optim.sgd(lr=-1.0), "lr"),
        (lambda: mt.optim.sgd(lr=0.1, nesterov=True), "nesterov"),
        (lambda: mt.optim.sgd(lr=0.1, momentum=-0.5), "momentum"),
        (lambda: mt.optim.adam(betas=(1.0, 0.999)), "betas[0]"),
        (lambda: mt.optim.adamw(betas=(0.9, -0.1)), "betas[1]"),
        (lambda: mt.optim.adam(eps=-1e-8), "eps"),
        (lambda: mt.optim.adamw(weight_decay=-0.1), "weight_decay"),
        (lambda: mt.optim.adagrad(lr_decay=-1.0), "lr_decay"),
        (lambda: mt.optim.rmsprop(alpha=1.5), "alpha"),
        (lambda: mt.optim.adam(impl="gpu"), "impl"),
        (lambda: mt.optim.cosine_schedule(1.0, decay_steps=5, warmup_steps=5), "decay_steps"),
        (lambda: mt.optim.clip_by_global_norm({"a": torch.ones(1)}, 0.0), "max_norm"),
    ],
)
def test_invalid_hyperparameters_raise_value_error_naming_them(call, needle):
    with pytest.raises(ValueError, match=re.escape(f"invalid {needle}")):
        call()


def test_mismatched_grads_name_the_first_differing_leaf():
    params = {"layers": [{"weight": torch.ones(2, 2)}, {"weight": torch.ones(2)}]}
    opt = mt.optim.adamw()
    state = opt.init(params)
    with pytest.raises(ValueError, match="layers.1.weight"):
        opt.update({"layers": [{"weight": torch.ones(2, 2)}, {"weight": torch.ones(3)}]},
                   state, params)
    with pytest.raises(ValueError, match="layers.1"):
        opt.update({"layers": [{"weight": torch.ones(2, 2)}]}, state, params)
    with pytest.raises(ValueError, match="floating-point"):
        opt.init({"steps": torch.ones(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="lr"):
        bad = mt.optim.sgd(lr=lambda step: -1.0)
        bad.update({"w": torch.ones(1)}, bad.init({"w": torch.ones(1)}), {"w": torch.ones(1)})


def test_state_of_another_optimizer_is_rejected():
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="AdamState"):
        mt.optim.adam().update(params, mt.optim.sgd().init(params), params)


@pytest.mark.parametrize("name, kwargs", [ALL_CONFIGS[1], ALL_CONFIGS[5], ALL_CONFIGS[9]])
def test_pure_updates_recycle_only_buffers_nobody_holds(name, kwargs):
    params = make_tree([[16, 8], [8]], seed=0)
    opt = OPTIMIZERS[name][0](**kwargs, impl="fast")
    state = opt.init(params)
    g = torch.Generator().manual_seed(0)
    kept, snapshots, pointers = [], [], set()
    for step in range(8):
        params, state = opt.update(random_grads(params, g), state, params)
        pointers.update(t.data_ptr() for t in mt.tree.leaves((params, state)) if t.numel() > 1)
        if step % 3 == 0:  # keep some whole generations, and of one only a view
            kept.append((params, state) if step != 3 else params["head"][1:])
            snapshots.append(mt.tree.map(torch.clone, kept[-1]))
    for held, snapshot in zip(kept, snapshots, strict=True):
        for x, y in zip(mt.tree.leaves(held), mt.tree.leaves(snapshot), strict=True):
            assert torch.equal(x, y)
    # Memory that nobody holds is reused: far fewer distinct buffers than 8 generations.
    per_generation = sum(1 for t in mt.tree.leaves((params, state)) if t.numel() > 1)
    assert len(pointers) <= 6 * per_generation
