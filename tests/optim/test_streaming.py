"""The streaming-store kernels behind pure fp32 CPU updates: against torch.optim, on leaves big
enough to split across threads, on misaligned views, and switched off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain.optim.kernels import streaming

needs_kernels = pytest.mark.skipif(
    not streaming.available(), reason="no C compiler: the streaming kernels cannot be built"
)

CONFIGS = [
    ("sgd", mt.optim.sgd, torch.optim.SGD, dict(lr=0.1)),
    ("sgd", mt.optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    ("sgd", mt.optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd", mt.optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.3)),
    ("adagrad", mt.optim.adagrad, torch.optim.Adagrad,
     dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
    ("rmsprop", mt.optim.rmsprop, torch.optim.RMSprop, dict(lr=0.01)),
    ("rmsprop", mt.optim.rmsprop, torch.optim.RMSprop,
     dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1)),
    ("rmsprop", mt.optim.rmsprop, torch.optim.RMSprop, dict(lr=0.01, centered=True)),
    ("rmsprop", mt.optim.rmsprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.9)),
    ("adam", mt.optim.adam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    ("adam", mt.optim.adam, torch.optim.Adam, dict(lr=0.01, betas=(0.0, 0.99), amsgrad=True)),
    ("adamw", mt.optim.adamw, torch.optim.AdamW, dict(lr=0.01)),
    ("adamw", mt.optim.adamw, torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.99), amsgrad=True)),
]
IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CONFIGS)]


def spy_rules(monkeypatch) -> list[str]:
    """Record the rule of every streaming kernel run from now on (``streaming.update`` and the
    optimizers' fast path both go through ``prepare``, whose ``launch()`` runs the kernel)."""
    calls: list[str] = []
    original = streaming.prepare

    def recording(rule, *args, **kwargs):
        results, launch = original(rule, *args, **kwargs)

        def recorded_launch():
            calls.append(rule)
            launch()

        return results, recorded_launch

    monkeypatch.setattr(streaming, "prepare", recording)
    return calls


def torch_reference(cls, kwargs, params, grads_seq):
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = cls(leaves, **kwargs, foreach=False)
    for grads in grads_seq:
        for p, g in zip(leaves, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in leaves]


@needs_kernels
@pytest.mark.parametrize("name, factory, cls, kwargs", CONFIGS, ids=IDS)
@pytest.mark.parametrize("streams", [True, False], ids=["streaming-stores", "plain-stores"])
def test_pure_updates_of_large_leaves_match_torch_optim(name, factory, cls, kwargs, streams,
                                                        monkeypatch):
    monkeypatch.setattr(streaming, "STREAMING_BYTES", 0 if streams else 2**62)
    # Leaf sizes with ragged tails, and enough elements in all that the update splits across
    # threads (slices of 64-byte blocks laid end to end across the leaves).
    g = torch.Generator().manual_seed(0)
    shapes = [(300, 257), (33,), (), (70001,)]
    params = [torch.randn(shape, generator=g) for shape in shapes]
    grads_seq = [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(5)]
    calls = spy_rules(monkeypatch)
    opt = factory(**kwargs, impl="fast")
    ours, state = params, opt.init(params)
    for grads in grads_seq:
        snapshot = [t.clone() for t in (*ours, *grads)]
        new, state = opt.update(grads, state, ours)
        for before, after in zip(snapshot, (*ours, *grads), strict=True):
            assert torch.equal(before, after)  # the inputs are untouched
        ours = new
    assert calls and set(calls) == {"adam" if name.startswith("adam") else name}
    for mine, theirs in zip(ours, torch_reference(cls, kwargs, params, grads_seq), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@needs_kernels
@settings(deadline=None, max_examples=15)
@given(offset=st.integers(0, 15), size=st.integers(1, 40000), threads=st.sampled_from([1, 2, 3]),
       nontemporal=st.sampled_from([None, True, False]))
def test_misaligned_views_and_any_thread_count_give_the_same_numbers(offset, size, threads,
                                                                     nontemporal):
    # Inputs that start mid cache line, sizes that end mid vector: the streaming kernel agrees
    # with torch's fused kernel on every element, whatever the number of threads.
    g = torch.Generator().manual_seed(size)
    storage = torch.randn(3, offset + size, generator=g)
    p, grad, m = (row[offset:] for row in storage)
    v = torch.rand(size, generator=g)
    expected = [t.clone() for t in (p, m, v)]
    expected_p, expected_m, expected_v = expected
    torch._fused_adam_([expected_p], [grad], [expected_m], [expected_v], [],
                       [torch.tensor(3.0)], lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1,
                       eps=1e-8, amsgrad=False, maximize=False)
    hp = [0.9, 0.99, 1e-8, 0.1, 0.01, 0.01 / (1 - 0.9**3), (1 - 0.99**3) ** 0.5, False, False,
          1.0]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        new_p, new_m, new_v, unused = streaming.update(
            "adam", hp, [[p], [grad], [m], [v], None], streaming.fresh, nontemporal=nontemporal
        )
    finally:
        torch.set_num_threads(previous)
    assert unused is None
    for ours, theirs in zip((new_p, new_m, new_v), expected, strict=True):
        torch.testing.assert_close(ours[0], theirs, rtol=2e-6, atol=1e-7)


@needs_kernels
@settings(deadline=None, max_examples=15)
@given(offset=st.integers(0, 16), size=st.integers(1, 70000))
def test_streaming_stores_into_misaligned_outputs_fall_back_to_plain_stores(offset, size):
    # A 64-byte streaming store (AVX-512) faults on an address that is not 64-byte aligned:
    # outputs that start mid cache line are written with plain stores, to the same bits.
    g = torch.Generator().manual_seed(size)
    p, grad, m, v = (torch.randn(size, generator=g) for _ in range(4))
    v = v.abs()
    hp = [0.9, 0.99, 1e-8, 0.1, 0.01, 0.01 / (1 - 0.9**3), (1 - 0.99**3) ** 0.5, True, False,
          1.0]
    slots = [[p], [grad], [m], [v], None]

    def misaligned(like):
        return [torch.empty(offset + t.numel())[offset:].view_as(t) for t in like]

    aligned = streaming.update("adam", hp, slots, streaming.fresh, nontemporal=True)
    shifted = streaming.update("adam", hp, slots, misaligned, nontemporal=True)
    for ours, theirs in zip(shifted[:3], aligned[:3], strict=True):
        assert ours[0].data_ptr() % 64 == (4 * offset) % 64
        assert torch.equal(ours[0], theirs[0])


@needs_kernels
def test_leaves_it_cannot_take_stay_on_the_fused_kernels(monkeypatch):
    calls = spy_rules(monkeypatch)
    opt = mt.optim.adamw(lr=0.01, impl="fast")
    for params in ([torch.ones(4, 4, dtype=torch.bfloat16)], [torch.ones(4, 4).t()],
                   [torch.ones(4, dtype=torch.float64)]):
        state = opt.init(params)
        new, _ = opt.update([torch.ones_like(p) for p in params], state, params)
        assert new[0].dtype == params[0].dtype and not torch.equal(new[0], params[0])
    assert calls == []


@needs_kernels
def test_donated_rmsprop_updates_in_place_with_the_streaming_kernel(monkeypatch):
    calls = spy_rules(monkeypatch)
    opt = mt.optim.rmsprop(lr=0.01, momentum=0.9, centered=True, impl="fast")
    params = [torch.randn(1000)]
    state = opt.init(params)
    def buffers(params, state):
        return [params, state.square_avg, state.momentum_buffer, state.grad_avg]

    pointers = [t.data_ptr() for t in mt.tree.leaves(buffers(params, state))]
    params, state = opt.update([torch.randn(1000)], state, params, donate=True)
    assert [t.data_ptr() for t in mt.tree.leaves(buffers(params, state))] == pointers
    assert calls == ["rmsprop"]


def test_the_environment_switch_turns_the_kernels_off():
    code = "from minitrain.optim.kernels import streaming; print(streaming.available())"
    env = {**os.environ, "MINITRAIN_STREAMING": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


WITHOUT_COMPILER = """
import torch, minitrain as mt
from minitrain.optim.kernels import streaming
assert not streaming.available()
params = [torch.randn(300, 7, generator=torch.Generator().manual_seed(0))]
grads = [torch.ones(300, 7)]
opt = mt.optim.adamw(lr=0.1)
new, _ = opt.update(grads, opt.init(params), params)
leaf = torch.nn.Parameter(params[0].clone())
leaf.grad = grads[0]
torch.optim.AdamW([leaf], lr=0.1).step()
torch.testing.assert_close(new[0], leaf.detach())
print("fused")
"""


def test_without_a_compiler_the_optimizers_keep_torchs_kernels(tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"),
           "MINITRAIN_CACHE_DIR": str(tmp_path / "cache"), "MINITRAIN_STREAMING": "1"}
    out = subprocess.run([sys.executable, "-c", WITHOUT_COMPILER], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "fused"


@needs_kernels
@settings(deadline=None, max_examples=15)
@given(sizes=st.lists(st.integers(0, 70000), min_size=1, max_size=5),
       threads=st.sampled_from([1, 2, 3]))
def test_sum_of_squares_is_the_float64_sum_for_any_thread_count(sizes, threads):
    g = torch.Generator().manual_seed(sum(sizes))
    leaves = [torch.randn(n, generator=g) for n in sizes]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = streaming.sum_of_squares(leaves)
    finally:
        torch.set_num_threads(previous)
    want = [float(t.double().square().sum()) for t in leaves]
    assert ours == pytest.approx(want, rel=1e-6, abs=1e-12)


@needs_kernels
def test_the_kernels_global_norm_matches_clip_grad_norm_and_its_edge_cases():
    g = torch.Generator().manual_seed(0)
    shapes = [(300, 257), (33,), (), (0,), (70001,)]
    grads = [torch.randn(s, generator=g) * 3 for s in shapes]
    ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(ps, grads, strict=True):
        p.grad = t.clone()
    want = torch.nn.utils.clip_grad_norm_(ps, 1.0)
    ours = streaming.global_norm(grads)
    assert ours.dtype == torch.float32 and ours.shape == ()
    torch.testing.assert_close(ours, want, rtol=2e-5, atol=0)
    exact = torch.cat([t.reshape(-1).double() for t in grads]).norm()
    assert abs(float(ours) - float(exact)) <= 2e-7 * float(exact)  # float64 sums, then fp32
    # Overflow of a float32 sum of squares is inf, as torch's float32 accumulation gives.
    assert torch.isinf(streaming.global_norm([torch.full((10,), 1e20)]))
    assert torch.isnan(streaming.global_norm([torch.tensor([float("nan")]), torch.ones(3)]))
    # clip_by_global_norm on CPU float32 takes this norm, and the clipped grads equal torch's.
    clipped, norm = mt.optim.clip_by_global_norm(grads, 1.0)
    assert torch.equal(norm, ours)
    for c, p in zip(clipped, ps, strict=True):
        torch.testing.assert_close(c, p.grad, rtol=2e-5, atol=1e-8)


@needs_kernels
def test_a_lowered_clip_takes_the_kernels_norm_and_no_other_pass(monkeypatch):
    calls = []
    original = streaming.sum_of_squares
    monkeypatch.setattr(streaming, "sum_of_squares",
                        lambda leaves: calls.append(len(leaves)) or original(leaves))
    monkeypatch.setattr(torch, "_foreach_norm", None)  # the torch norm must not run
    opt = mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.clip_by_global_norm(1.0), mt.optim.scale_by_adam(),
        mt.optim.add_decayed_weights(0.1), mt.optim.scale_by_learning_rate(0.01)))
    params = [torch.randn(100, 10), torch.randn(10)]
    new, _ = opt.update([torch.randn(100, 10), torch.randn(10)], opt.init(params), params)
    assert calls == [2] and new[0].shape == (100, 10)


# The family's streaming kernels: against the references (torch.optim, lion-pytorch,
# schedulefree) and against the same chain run op by op, on leaves that split across threads.
def _lion_reference():
    from lion_pytorch import Lion

    return Lion


def _schedule_free_reference():
    from schedulefree import AdamWScheduleFree

    return AdamWScheduleFree


FAMILY = [
    ("nadam", mt.optim.nadam, lambda: torch.optim.NAdam, dict(lr=0.01, weight_decay=0.1), {}),
    ("nadam", mt.optim.nadam, lambda: torch.optim.NAdam,
     dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, maximize=True,
          momentum_decay=0.01), {}),
    ("radam", mt.optim.radam, lambda: torch.optim.RAdam, dict(lr=0.01, weight_decay=0.1), {}),
    ("radam", mt.optim.radam, lambda: torch.optim.RAdam,
     dict(lr=0.01, betas=(0.8, 0.5), weight_decay=0.1, decoupled_weight_decay=True), {}),
    ("adamax", mt.optim.adamax, lambda: torch.optim.Adamax,
     dict(lr=0.01, weight_decay=0.1, maximize=True), {}),
    ("lion", mt.optim.lion, _lion_reference, dict(lr=1e-3, weight_decay=0.1), {}),
    ("lion", mt.optim.lion, _lion_reference, dict(lr=1e-3, betas=(0.3, 0.8)), {}),
    ("schedule_free_adamw", mt.optim.schedule_free_adamw, _schedule_free_reference,
     dict(lr=0.01, weight_decay=0.1, warmup_steps=3), {"foreach": False}),
    ("adadelta", mt.optim.adadelta, lambda: torch.optim.Adadelta,
     dict(lr=0.5, weight_decay=0.1, maximize=True), {}),
    ("asgd", mt.optim.asgd, lambda: torch.optim.ASGD, dict(lr=0.01, t0=2, weight_decay=0.1), {}),
    ("asgd", mt.optim.asgd, lambda: torch.optim.ASGD, dict(lr=0.01, lambd=0.0), {}),
    ("rprop", mt.optim.rprop, lambda: torch.optim.Rprop, dict(lr=0.01, maximize=True), {}),
    ("rprop", mt.optim.rprop, lambda: torch.optim.Rprop,
     dict(lr=0.01, etas=(0.3, 1.5), step_sizes=(1e-3, 0.02)), {}),
]
FAMILY_IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(FAMILY)]


def _family_reference(cls, kwargs, params, grads_seq):
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = cls(leaves, **kwargs)
    if hasattr(optimizer, "train"):
        optimizer.train()
    for grads in grads_seq:
        for p, g in zip(leaves, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in leaves]


@needs_kernels
@pytest.mark.parametrize("name, factory, reference, kwargs, only_reference", FAMILY,
                         ids=FAMILY_IDS)
@pytest.mark.parametrize("donate, streams", [(False, True), (False, False), (True, False)],
                         ids=["streaming-stores", "plain-stores", "donated"])
def test_family_kernels_match_the_references_and_the_chain(
        name, factory, reference, kwargs, only_reference, donate, streams, monkeypatch):
    # Streaming stores for any size, or plain stores for any size.
    monkeypatch.setattr(streaming, "STREAMING_BYTES", 0 if streams else 2**62)
    g = torch.Generator().manual_seed(0)
    shapes = [(300, 257), (33,), (), (70001,)]
    params = [torch.randn(shape, generator=g) for shape in shapes]
    grads_seq = [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(6)]
    calls = spy_rules(monkeypatch)
    opt = factory(**kwargs)
    ours, state = [p.clone() for p in params], opt.init(params)
    for grads in grads_seq:
        snapshot = [t.clone() for t in (*ours, *grads)]
        pointers = [t.data_ptr() for t in ours]
        new, state = opt.update(grads, state, ours, donate=donate)
        if donate:  # written in place
            assert [t.data_ptr() for t in new] == pointers
        else:  # the inputs are untouched
            for before, after in zip(snapshot, (*ours, *grads), strict=True):
                assert torch.equal(before, after)
        ours = new
    assert calls == [name] * len(grads_seq)
    # The same chain, op by op (the transformation's own update).
    chain = mt.optim.as_optimizer(opt.update.transformation)
    theirs, chain_state = [p.clone() for p in params], chain.init(params)
    for grads in grads_seq:
        theirs, chain_state = chain.update(grads, chain_state, theirs)
    for a, b in zip(mt.tree.leaves((ours, state)), mt.tree.leaves((theirs, chain_state)),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    want = _family_reference(reference(), {**kwargs, **only_reference}, params, grads_seq)
    for mine, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)


@needs_kernels
def test_family_kernels_decay_only_the_masked_leaves_and_skip_odd_layouts(monkeypatch):
    calls = spy_rules(monkeypatch)
    params = {"w": torch.randn(40, 30), "b": torch.randn(30)}
    grads = {"w": torch.randn(40, 30), "b": torch.randn(30)}
    mask = lambda name, p: p.ndim >= 2  # noqa: E731
    opt = mt.optim.nadam(lr=0.01, weight_decay=0.5, decoupled_weight_decay=True, mask=mask)
    new, state = opt.update(grads, opt.init(params), params)
    chain = mt.optim.as_optimizer(opt.update.transformation)
    want, _ = chain.update(grads, chain.init(params), params)
    assert calls == ["nadam", "nadam"]  # one call per decay group
    for key in params:
        torch.testing.assert_close(new[key], want[key], rtol=1e-6, atol=1e-7)
    # A transposed grad, a bf16 leaf: the rule runs op by op instead.
    calls.clear()
    for odd_params, odd_grads in (
        ([torch.randn(5, 4)], [torch.randn(4, 5).t()]),
        ([torch.randn(5, 4, dtype=torch.bfloat16)], [torch.randn(5, 4, dtype=torch.bfloat16)]),
    ):
        new, _ = opt.update(odd_grads, opt.init(odd_params), odd_params)
        chain_new, _ = chain.update(odd_grads, chain.init(odd_params), odd_params)
        torch.testing.assert_close(new[0], chain_new[0])
    assert calls == []


ADAFACTOR = [dict(), dict(weight_decay=0.1, maximize=True),
             dict(lr=mt.optim.step_schedule(0.05, 2, gamma=0.5), beta2_decay=-0.5,
                  eps=(1e-30, 1e-2), d=2.0)]


@needs_kernels
@pytest.mark.parametrize("kwargs", ADAFACTOR, ids=["default", "decay-maximize", "schedule"])
@pytest.mark.parametrize("donate, streams", [(False, True), (False, False), (True, False)],
                         ids=["streaming-stores", "plain-stores", "donated"])
def test_adafactor_kernels_match_torch_and_the_chain(kwargs, donate, streams, monkeypatch):
    monkeypatch.setattr(streaming, "STREAMING_BYTES", 0 if streams else 2**62)
    calls = []
    original = streaming.adafactor_stats
    monkeypatch.setattr(streaming, "adafactor_stats",
                        lambda g, p: calls.append(tuple(g.shape)) or original(g, p))
    g = torch.Generator().manual_seed(0)
    # A matrix that splits across threads with a ragged row, small and 1-D/0-d/3-D leaves
    # (those take the chain's own ops).
    shapes = [(300, 257), (64, 3), (33,), (), (2, 3, 4)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads_seq = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]
    opt = mt.optim.adafactor(**kwargs)
    ours, state = [p.clone() for p in params], opt.init(params)
    for grads in grads_seq:
        snapshot = [t.clone() for t in (*ours, *grads)]
        pointer = ours[0].data_ptr()
        new, state = opt.update(grads, state, ours, donate=donate)
        assert (new[0].data_ptr() == pointer) == donate
        if not donate:
            for before, after in zip(snapshot, (*ours, *grads), strict=True):
                assert torch.equal(before, after)
        ours = new
    assert calls == [(300, 257), (64, 3)] * len(grads_seq)
    transformation = opt.update.transformation
    theirs, chain_state = [p.clone() for p in params], transformation.init(params)
    for grads in grads_seq:
        updates, chain_state = transformation.update(grads, chain_state, theirs)
        theirs = mt.optim.apply_updates(theirs, updates)
    for a, b in zip(mt.tree.leaves((ours, state)), mt.tree.leaves((theirs, chain_state)),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    reference = dict(kwargs)
    if callable(reference.get("lr")):
        reference["lr"] = 0.05  # the schedule as torch's StepLR, stepped below
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = torch.optim.Adafactor(leaves, **reference)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5) \
        if callable(kwargs.get("lr")) else None
    for grads in grads_seq:
        for p, grad in zip(leaves, grads, strict=True):
            p.grad = grad.clone()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    for mine, expected in zip(ours, leaves, strict=True):
        torch.testing.assert_close(mine, expected.detach(), rtol=1e-5, atol=1e-6)


# (rule name, pointer slots per leaf: its inputs, then its outputs), as _streaming.c's RULES
SLOTS = {"adam": (5, 9), "sgd": (3, 5), "adagrad": (3, 5), "rmsprop": (5, 9), "nadam": (4, 7),
         "radam": (4, 7), "adamax": (4, 7), "lion": (3, 5), "schedule_free_adamw": (4, 7),
         "adadelta": (4, 7), "asgd": (3, 5), "rprop": (4, 7)}


def _eight_float_build() -> object:
    """The kernels built without AVX-512 (8-float vectors), loaded beside the running ones."""
    import ctypes

    flags = [flag for flag in streaming._flags() if flag != "-mavx512f"]
    library = streaming._load(streaming._build(os.environ.get("CC", "cc"), flags),
                              "-fopenmp" in flags)
    library.minitrain_update.restype = ctypes.c_int
    library.minitrain_update.argtypes = streaming._library().minitrain_update.argtypes
    return library


@needs_kernels
@pytest.mark.skipif("-mavx512f" not in streaming._flags(),
                    reason="torch runs no AVX-512 code here: the kernels have one width only")
@settings(deadline=None, max_examples=24)
@given(rule=st.sampled_from(sorted(SLOTS)), size=st.integers(1, 70000),
       nontemporal=st.booleans(), seed=st.integers(0, 2**16))
def test_the_16_float_kernels_give_the_8_float_kernels_bits(rule, size, nontemporal, seed):
    """Every elementwise rule, on random state and hyperparameters (flags included), with
    ragged tails, threads and both kinds of stores: the AVX-512 build writes the same bits as
    the 8-float build (NaNs included, compared as integers)."""
    import array

    assert len(SLOTS) == len(streaming.RULES)
    inputs, pointers = SLOTS[rule]
    g = torch.Generator().manual_seed(seed)
    ins = [torch.randn(size, generator=g) for _ in range(inputs)]
    hp = array.array("d", torch.rand(streaming.HYPERPARAMETERS[rule], generator=g).tolist())
    results = []
    for library in (streaming._library(), _eight_float_build()):
        outs = [torch.full((size,), float("nan")) for _ in range(pointers - inputs)]
        table = array.array("Q", [t.data_ptr() for t in (*ins, *outs)])
        sizes = array.array("q", [size])
        status = library.minitrain_update(
            streaming.RULES[rule], hp.buffer_info()[0], table.buffer_info()[0],
            sizes.buffer_info()[0], 1, pointers, 2, int(nontemporal))
        assert status == 0
        results.append(outs)
    for wide, narrow in zip(*results, strict=True):
        assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32))


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_prepare_writes_nothing_until_its_launch(donate):
    """``prepare`` takes the outputs and builds the pointer table; only ``launch()`` runs the
    kernel, and then gives what ``update`` gives."""
    g = torch.Generator().manual_seed(0)
    p, grad, buf = (torch.randn(3000, generator=g) for _ in range(3))
    hp = [0.1, 0.9, 0.0, 0.01, False, False, True]  # lr, momentum, dampening, wd, nesterov, ...
    want_p, want_buf = streaming.update("sgd", hp, [[p.clone()], [grad], [buf.clone()]],
                                        streaming.fresh)
    before = p.clone(), buf.clone()
    (new_p, new_buf), launch = streaming.prepare(
        "sgd", hp, [[p], [grad], [buf]], None if donate else streaming.fresh)
    assert torch.equal(p, before[0]) and torch.equal(buf, before[1])
    launch()
    assert torch.equal(new_p[0], want_p[0]) and torch.equal(new_buf[0], want_buf[0])
    assert (new_p[0] is p) == donate and torch.equal(p, want_p[0] if donate else before[0])


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.one_of(st.integers(0, 200), st.integers(32700, 70000)),
                      min_size=1, max_size=6),
       offset=st.integers(0, 17), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_sum_of_squares_equals_float64_sums_for_any_sizes_offsets_and_threads(
        sizes, offset, threads, seed):
    # Leaves that start off a vector boundary, chunks with ragged ends, leaves shorter than one
    # vector per sub-range: each sum within float32 rounding of the float64 sum, and the same
    # bits on any number of threads.
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(n + offset, generator=g)[offset:] for n in sizes]
    want = [float((leaf.double() ** 2).sum()) for leaf in leaves]
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = streaming.sum_of_squares(leaves)
        torch.set_num_threads(1)
        assert streaming.sum_of_squares(leaves) == got
    finally:
        torch.set_num_threads(previous)
    for ours, exact in zip(got, want, strict=True):
        assert ours == pytest.approx(exact, rel=1e-6, abs=0.0)
