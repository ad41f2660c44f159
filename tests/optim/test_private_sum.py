"""DP-SGD's private sum in C (``_streaming.c``'s minitrain_private_sum): float32 ``dpsgd`` and
``differentially_private_aggregate`` take it and match optax's formulas computed in float64;
it equals the torch ops it replaces for every shape; and every input it cannot take (another
dtype, a non-contiguous param, a traced or watched update, a tensor clip) takes the torch ops,
with the same numbers."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import minitrain as mt
from minitrain import _native
from minitrain.optim import _privacy

F32, F64, STEPS = torch.float32, torch.float64, 50

needs_library = pytest.mark.skipif(_native._library() is None,
                                   reason="no C compiler: the C library cannot be built")


@pytest.fixture
def c_calls(monkeypatch):
    """The number of updates the C pass took."""
    taken = []
    native = _privacy._native_private_sum

    def spy(*args):
        out = native(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_privacy, "_native_private_sum", spy)
    return taken


def tree(dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"s": torch.randn((), generator=g).to(dtype), "v": torch.randn(5, generator=g).to(dtype),
            "t": torch.randn(2, 3, 4, generator=g).to(dtype)}


def per_example(params, batch, seed):
    g = torch.Generator().manual_seed(seed)
    return mt.tree.map(lambda p: 2 * torch.randn(batch, *p.shape, generator=g).to(p.dtype), params)


@needs_library
@pytest.mark.parametrize("aggregate", [False, True], ids=["dpsgd", "aggregate"])
def test_float32_takes_the_c_pass_and_matches_optax(c_calls, aggregate):
    """50 steps; the reference in float64 from the same float32 grads and noise draws."""
    clip, multiplier, batch, lr = 1.5, 0.7, 8, 0.3
    params = tree()
    if aggregate:
        opt = mt.optim.as_optimizer(mt.optim.chain(
            mt.optim.differentially_private_aggregate(clip, multiplier, key=42),
            mt.optim.scale_by_learning_rate(lr)))
    else:
        opt = mt.optim.dpsgd(lr, clip, multiplier, key=42)
    state, key = opt.init(params), mt.random.key(42)
    reference = mt.tree.map(lambda t: t.double(), params)
    for step in range(STEPS):
        grads = per_example(params, batch, seed=step)
        params, state = opt.update(grads, state, params)
        leaves = [leaf.double() for leaf in mt.tree.leaves(grads)]
        norms = torch.sqrt(sum(leaf.reshape(batch, -1).pow(2).sum(1) for leaf in leaves))
        factors = 1 / torch.clamp(norms / clip, min=1.0)  # optax per_example_global_norm_clip
        key, noise_key = mt.random.split(key)
        sizes = [leaf[0].numel() for leaf in leaves]
        noises = iter(mt.random.normal(noise_key, (sum(sizes),), F32).double().split(sizes))
        for name, leaf in zip(reference, leaves, strict=True):
            private = (torch.tensordot(factors, leaf, dims=1)
                       + clip * multiplier * next(noises).reshape(leaf.shape[1:])) / batch
            reference[name] = reference[name] - lr * private
        for name, value in params.items():
            assert value.dtype == F32
            torch.testing.assert_close(value.double(), reference[name], rtol=1e-5, atol=1e-5,
                                       msg=name)
    assert c_calls == [True] * STEPS


def torch_ops(monkeypatch, call):
    with monkeypatch.context() as patch:
        patch.setattr(_privacy, "_native_private_sum", lambda *args: None)
        return call()


@needs_library
@settings(max_examples=40, deadline=None)
@given(batch=st.sampled_from([1, 2, 7, 64, 300]),
       shapes=st.lists(st.sampled_from([(), (1,), (0,), (5,), (3, 4), (255,), (257,), (2, 300)]),
                       min_size=1, max_size=5),
       base=st.booleans(), scale=st.sampled_from([1.0, -0.3]))
def test_the_c_pass_equals_the_torch_ops(batch, shapes, base, scale):
    g = torch.Generator().manual_seed(batch + len(shapes))
    leaves = [torch.randn(batch, *s, generator=g) * 10 ** (i % 3 - 1) for i, s in enumerate(shapes)]
    params = [torch.randn(s, generator=g) for s in shapes] if base else None
    key = mt.random.key(batch)
    ours, our_key = _privacy._private_mean(leaves, key, 1.0, 1.1, scale, params)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_privacy, "_native_private_sum", lambda *args: None)
        theirs, their_key = _privacy._private_mean(leaves, key, 1.0, 1.1, scale, params)
    assert torch.equal(our_key, their_key)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_library
@pytest.mark.parametrize("threads", [1, 2])
def test_a_sum_large_enough_for_threads_equals_the_torch_ops(threads):
    """Over 2**20 multiply-adds the C pass splits examples and columns over the threads."""
    g = torch.Generator().manual_seed(5)
    leaves = [torch.randn(64, 20_000, generator=g), torch.randn(64, 3, 7_001, generator=g)]
    params = [torch.randn(leaf.shape[1:], generator=g) for leaf in leaves]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = _privacy._private_mean(leaves, mt.random.key(1), 1.0, 1.1, -0.5, params)[0]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_privacy, "_native_private_sum", lambda *args: None)
            theirs = _privacy._private_mean(leaves, mt.random.key(1), 1.0, 1.1, -0.5, params)[0]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_library
def test_a_nan_example_gives_nan_as_the_torch_ops_do(monkeypatch):
    leaves = [torch.ones(4, 3), torch.ones(4)]
    leaves[0][2, 1] = float("nan")
    ours = _privacy._native_private_sum(
        leaves, [leaves[0], leaves[1].reshape(4, 1)], torch.zeros(4), None, 1.0, 0.25, 0.0)
    theirs = torch_ops(monkeypatch, lambda: _privacy._private_mean(
        leaves, mt.random.key(0), 1.0, 0.0)[0])
    for a, b in zip(ours, theirs, strict=True):
        assert a.isnan().all() and b.isnan().all()


def fallbacks():
    """Each input the C pass refuses: (name, params, per-example grads, update wrapper)."""
    params, grads = tree(), per_example(tree(), 4, seed=1)
    strided = {**params, "t": torch.randn(4, 3, 2).permute(2, 1, 0)}

    def vmapped(update):  # the whole update under vmap over a leading ensemble dim
        def call(g, s, p):
            stack = lambda tree_: mt.tree.map(lambda t: torch.stack([t, t]), tree_)  # noqa: E731
            return mt.vmap(lambda g_, p_: update(g_, s, p_)[0])(stack(g), stack(p))
        return call

    def watched(update):
        def call(g, s, p):
            with FlopCounterMode(display=False):
                return update(g, s, p)[0]
        return call

    plain = lambda update: lambda g, s, p: update(g, s, p)[0]  # noqa: E731
    return [
        ("float64", *(mt.tree.map(lambda t: t.double(), x) for x in (params, grads)), plain),
        ("strided param", strided, per_example(strided, 4, seed=1), plain),
        ("grads require grad", params, mt.tree.map(lambda t: t.requires_grad_(), grads), plain),
        ("under vmap", params, grads, vmapped),
        ("under a FLOP counter", params, grads, watched),
    ]


@needs_library
@pytest.mark.parametrize("case", fallbacks(), ids=lambda case: case[0])
def test_what_the_c_pass_refuses_takes_the_torch_ops(monkeypatch, c_calls, case):
    _, params, grads, wrap = case
    opt = mt.optim.dpsgd(0.3, 1.5, 0.7, key=7)
    state = opt.init(params)
    ours = wrap(opt.update)(grads, state, params)
    assert c_calls and not any(c_calls)
    theirs = torch_ops(monkeypatch, lambda: wrap(opt.update)(grads, state, params))
    for a, b in zip(mt.tree.leaves(ours), mt.tree.leaves(theirs), strict=True):
        assert torch.equal(a.detach(), b.detach())


@needs_library
def test_a_tensor_clip_takes_the_torch_ops(c_calls):
    params = tree()
    opt = mt.optim.dpsgd(0.3, torch.tensor(1.5), 0.7, key=7)
    opt.update(per_example(params, 4, seed=1), opt.init(params), params)
    assert c_calls == [False]


@contextlib.contextmanager
def torch_defaults(default):
    """torch's default dtype (a dtype's name) or default device ("meta") changed."""
    if default == "meta":
        with torch.device("meta"):
            yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, default))
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@needs_library
@pytest.mark.parametrize("default", ["float64", "bfloat16", "meta"])
def test_a_changed_default_dtype_or_device_gives_the_same_update(c_calls, default):
    """The C pass and the noise write into float32 CPU tensors whatever torch's defaults."""
    params, grads = tree(), per_example(tree(), 4, seed=1)
    opt = mt.optim.dpsgd(0.3, 1.5, 0.7, key=7)
    state = opt.init(params)
    want = opt.update(grads, state, params)[0]
    with torch_defaults(default):
        got = opt.update(grads, state, params)[0]
    assert c_calls == [True, True]
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and got[name].device.type == "cpu"
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7)
