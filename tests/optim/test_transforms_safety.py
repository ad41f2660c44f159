"""The fast path cannot corrupt memory: mismatched states are refused naming the leaf, strided
grads and state are read as the plain path reads them, the buffer pool is thread-safe and
clearable, and the kernel cache is verified before it is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain.optim.kernels import streaming

FACTORIES = {
    "sgd": lambda **k: mt.optim.sgd(lr=0.1, momentum=0.9, **k),
    "adam": lambda **k: mt.optim.adam(lr=0.01, weight_decay=0.1, **k),
    "adamw": lambda **k: mt.optim.adamw(lr=0.01, amsgrad=True, **k),
    "adagrad": lambda **k: mt.optim.adagrad(lr=0.1, **k),
    "rmsprop": lambda **k: mt.optim.rmsprop(lr=0.01, centered=True, momentum=0.5, **k),
}


@pytest.mark.parametrize("impl", ["fast", "plain"])
@pytest.mark.parametrize("name", FACTORIES)
def test_a_state_of_a_smaller_model_is_refused_naming_the_leaf(name, impl):
    opt = FACTORIES[name](impl=impl)
    small = opt.init({"w": torch.zeros(8), "b": torch.zeros(2)})
    params = {"w": torch.zeros(4096), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"state\.\w+ leaf .*'w'.* \(8,\)"):
        opt.update({"w": torch.ones(4096), "b": torch.ones(2)}, small, params)


def _strided(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if kind == "expanded":  # what autograd gives for 0.0 * p.sum(): one element of storage
        return torch.randn((), generator=g).expand(shape)
    if kind == "transposed":
        return torch.randn(cols, rows, generator=g).t()
    if kind == "sliced":
        return torch.randn(rows, 2 * cols, generator=g)[:, ::2]
    if kind == "overlapping":  # rows share elements
        base = torch.randn(rows + cols, generator=g)
        return base.as_strided(shape, (1, 1))
    return torch.randn(shape, generator=g)


KINDS = ["expanded", "transposed", "sliced", "overlapping", "contiguous"]


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(FACTORIES)),
    kind=st.sampled_from(KINDS),
    state_kind=st.sampled_from(["transposed", "sliced", "contiguous"]),
    shape=st.tuples(st.integers(1, 37), st.integers(1, 37)),
    donate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_strided_grads_and_state_give_what_contiguous_ones_give(name, kind, state_kind, shape,
                                                                 donate, seed):
    grad = _strided(kind, shape, seed)
    params = {"w": torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))}
    opt = FACTORIES[name](impl="fast")
    state = opt.init(params)
    state = opt.update({"w": torch.ones(shape)}, state, params)[1]
    strided_state = state._replace(**{
        field: {"w": _strided(state_kind, shape, seed).copy_(value["w"])}
        if isinstance(value, dict) else value
        for field, value in state._asdict().items() if field != "count"
    }, count=state.count.clone())  # a donated update consumes its state, count included
    contiguous, _ = opt.update({"w": grad.contiguous()}, state, params)
    strided, _ = opt.update({"w": grad}, strided_state, {"w": params["w"].clone()},
                            donate=donate)
    plain, _ = FACTORIES[name](impl="plain").update({"w": grad}, state, params)
    assert torch.equal(strided["w"], contiguous["w"])
    torch.testing.assert_close(strided["w"], plain["w"], rtol=1e-5, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(sorted(FACTORIES)),
    delta=st.sampled_from([-3, -1, 1, 5]),
    dtype=st.sampled_from([None, torch.float64]),
)
def test_hypothesis_mismatched_states_are_value_errors(name, delta, dtype):
    opt = FACTORIES[name](impl="fast")
    params = {"a": torch.zeros(4), "w": torch.zeros(64)}
    wrong = {"a": torch.zeros(4), "w": torch.zeros(max(1, 64 + delta), dtype=dtype or
                                                    torch.float32)}
    state = opt.init(params)
    field = next(f for f in state._fields[2:] if isinstance(getattr(state, f), dict))
    if dtype is not None:
        wrong["w"] = torch.zeros(64, dtype=dtype)
    bad = state._replace(**{field: wrong})
    with pytest.raises(ValueError, match=rf"state\.{field} leaf .*'w'"):
        opt.update({"a": torch.ones(4), "w": torch.ones(64)}, bad, params)


def test_two_threads_updating_with_one_optimizer_get_their_own_buffers():
    opt = mt.optim.adamw(lr=0.01)
    results = {}

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(256, 256, generator=g) for _ in range(4)]
        state = opt.init(params)
        for _ in range(20):
            grads = [torch.randn(256, 256, generator=g) for _ in range(4)]
            params, state = opt.update(grads, state, params)
        results[seed] = params

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = dict(results)
    for seed in (0, 1):
        run(seed)  # alone, after the threads
        for a, b in zip(together[seed], results[seed], strict=True):
            assert torch.equal(a, b)


def test_buffer_pools_can_be_cleared_and_report_their_extra_bytes():
    opt = mt.optim.sgd(lr=0.1, momentum=0.9)
    params = [torch.ones(1024)]
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update([torch.ones(1024)], state, params)
    if mt.optim.base._CAN_COUNT_STORAGE_USES:
        assert mt.optim.buffer_pool_bytes() >= 1024 * 4  # at least the previous params
    mt.optim.clear_buffer_pools()
    assert mt.optim.buffer_pool_bytes() == 0
    params, state = opt.update([torch.ones(1024)], state, params)
    assert torch.allclose(params[0], torch.full((1024,), 1 - 0.1 * (1 + 1.9 + 2.71 + 3.439)))


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def test_require_turns_a_failed_build_into_an_error_with_the_compiler_output(tmp_path):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'error: the compiler says no' >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {"CC": str(compiler), "MINITRAIN_CACHE_DIR": str(tmp_path / "cache"),
           "MINITRAIN_STREAMING": "require"}
    out = _python("from minitrain.optim.kernels import streaming; streaming.available()", env)
    assert out.returncode != 0
    assert "BuildError" in out.stderr and "the compiler says no" in out.stderr


@pytest.mark.skipif(not streaming.available(), reason="no C compiler for the streaming kernels")
def test_a_truncated_cached_kernel_is_rebuilt_not_loaded(tmp_path):
    env = {"MINITRAIN_CACHE_DIR": str(tmp_path), "MINITRAIN_STREAMING": "require"}
    code = ("from minitrain.optim.kernels import streaming; assert streaming.available(); "
            "print(streaming._build(streaming.os.environ.get('CC', 'cc'), streaming._flags()))")
    first = _python(code, env)
    assert first.returncode == 0, first.stderr[-2000:]
    library = tmp_path / "kernels" / os.path.basename(first.stdout.strip())
    size = library.stat().st_size
    with open(library, "r+b") as f:
        f.truncate(size // 3)
    second = _python(code, env)
    assert second.returncode == 0, second.stderr[-2000:]  # no SIGBUS: rebuilt first
    assert library.stat().st_size == size


@pytest.mark.parametrize("name", FACTORIES)
def test_the_gradient_of_an_unused_param_is_zero_not_garbage(name):
    # The gradient of 0.0 * p["pad"].sum() is an expanded tensor: stride 0, one element.
    params = {"w": torch.ones(8), "pad": torch.zeros(64, 33)}
    grads = mt.grad(lambda p: (p["w"] ** 2).sum() + 0.0 * p["pad"].sum())(params)
    assert grads["pad"].stride() == (0, 0)
    opt = FACTORIES[name](impl="fast")
    new, _ = opt.update(grads, opt.init(params), params)
    plain, _ = FACTORIES[name](impl="plain").update(grads, opt.init(params), params)
    assert torch.equal(new["pad"], plain["pad"])
    torch.testing.assert_close(new["w"], plain["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("donate", [False, True])
def test_as_optimizer_of_an_unlowered_chain_donates_or_not_alike(donate):
    tx = mt.optim.chain(mt.optim.scale_by_sign(), mt.optim.trace(0.9),
                        mt.optim.scale_by_learning_rate(0.1))
    opt = mt.optim.as_optimizer(tx)
    params = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0))]
    reference = opt.update([torch.ones(5, 3)], opt.init(params), params)[0]
    given = [params[0].clone()]
    out = opt.update([torch.ones(5, 3)], opt.init(given), given, donate=donate)[0]
    assert torch.equal(out[0], reference[0])
    assert (out[0].data_ptr() == given[0].data_ptr()) == donate


FOREIGN_OPENMP = """
import torch
from minitrain.optim.kernels import streaming
real, built, loads = streaming._openmp_runtimes, [], []
def runtimes():  # the first library loaded brings a second OpenMP runtime in
    loads.append(1)
    found = real() if TORCH_HAS_OPENMP else set()
    return found | {"/opt/other/libiomp5.so"} if len(loads) == 2 else found
build = streaming._build
streaming._openmp_runtimes = runtimes
streaming._build = lambda cc, flags: built.append(flags) or build(cc, flags)
assert streaming.available()
assert "-fopenmp" in built[0] and "-fopenmp" not in built[-1], built
slots = [[torch.ones(4)], [torch.ones(4)], None]
new, _ = streaming.update("sgd", [0.5, 0, 0, 0, 0, 1.0, 0], slots, streaming.fresh)
assert torch.equal(new[0], torch.full((4,), 0.5))
print("without openmp")
"""


@pytest.mark.skipif(not streaming.available(), reason="no C compiler for the streaming kernels")
@pytest.mark.parametrize("torch_has_openmp", [True, False])
def test_a_kernel_on_another_openmp_runtime_is_rebuilt_without_openmp(tmp_path,
                                                                      torch_has_openmp):
    assert streaming._openmp_runtimes()  # torch's own runtime is mapped and found
    code = FOREIGN_OPENMP.replace("TORCH_HAS_OPENMP", str(torch_has_openmp))
    out = _python(code, {"MINITRAIN_CACHE_DIR": str(tmp_path),
                                   "MINITRAIN_STREAMING": "require"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "without openmp"


LAYOUTS = [((4, 3), torch.float32), ((3, 4), torch.float32), ((12,), torch.float32),
           ((4, 3), torch.float64), ((0,), torch.float32)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, len(LAYOUTS) - 1), min_size=1, max_size=6),
                          st.lists(st.sampled_from(["drop", "tensor", "view", "storage"]),
                                   min_size=6, max_size=6),
                          st.booleans()),
                min_size=1, max_size=6))
def test_hypothesis_the_pool_never_hands_out_memory_someone_holds(updates):
    """Each update asks for buffers like a random run of leaves (one call or one at a time) and
    keeps a random subset (the tensor, a view of it, or only its storage object); no buffer
    handed out may share storage with another one of the same update or with anything still
    held, and each has its like's shape, strides and dtype."""
    pool = mt.optim.base.BufferPool()
    held: list = []
    for picks, keep, batched in updates:
        likes = [torch.empty(LAYOUTS[i][0], dtype=LAYOUTS[i][1]) for i in picks]
        pool.begin_update()
        out = pool(likes) if batched else [pool.empty_like(t) for t in likes]
        for t, like in zip(out, likes, strict=True):
            assert (t.shape, t.stride(), t.dtype) == (like.shape, like.stride(), like.dtype)
        storages = [t.untyped_storage().data_ptr() for t in out if t.numel()]
        assert len(set(storages)) == len(storages)
        held_storages = {s.data_ptr() for s in (
            h if isinstance(h, torch.UntypedStorage) else h.untyped_storage() for h in held)
            if s.nbytes()}
        assert not held_storages & set(storages)
        kept = {"tensor": lambda t: t, "view": lambda t: t.view(-1)[:1],
                "storage": lambda t: t.untyped_storage()}
        held = [kept[k](t) for t, k in zip(out, keep, strict=False) if k != "drop"] + \
            held[:len(held) // 2]
        del out


@pytest.mark.parametrize("shrunk", ["param", "grad", "state"])
@pytest.mark.parametrize("name", FACTORIES)
def test_a_storage_shrunk_by_hand_is_refused_naming_the_leaf(name, shrunk):
    # Even torch's own elementwise ops read past the end of such a tensor (a segfault).
    opt = FACTORIES[name]()
    params = {"w": torch.ones(4096)}
    state = opt.init(params)
    params, state = opt.update({"w": torch.ones(4096)}, state, params)  # pool buffers now
    grads = {"w": torch.ones(4096)}
    victim = {"param": params["w"], "grad": grads["w"],
              "state": max(mt.tree.leaves(state), key=lambda t: t.numel())}[shrunk]
    victim.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"'w'.*storage holds 0 bytes"):
        opt.update(grads, state, params)


def test_a_pool_buffer_whose_storage_was_shrunk_is_not_handed_out_again():
    pool = mt.optim.base.BufferPool()
    like = torch.empty(1024)
    pool.begin_update()
    first, kept, dropped = pool([like, like, like])
    first.untyped_storage().resize_(0)
    del first, dropped  # an intact buffer would be recycled now
    pool.begin_update()
    second, third = pool([like, like])
    assert second.untyped_storage().nbytes() == third.untyped_storage().nbytes() == 1024 * 4
    assert kept.data_ptr() not in (second.data_ptr(), third.data_ptr())
    assert second.untyped_storage().nbytes() == 1024 * 4
    torch.mul(like.fill_(2.0), 3.0, out=second)
    assert torch.equal(second, torch.full((1024,), 6.0))


TIED = {
    **FACTORIES,
    "lion": lambda: mt.optim.lion(lr=0.1),
    "nadam": lambda: mt.optim.nadam(lr=0.1),
    "adafactor": lambda: mt.optim.adafactor(lr=0.1),
    "muon": lambda: mt.optim.muon(lr=0.1),
    "chain": lambda: mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.clip_by_global_norm(1.0), mt.optim.scale_by_adam(),
        mt.optim.scale_by_learning_rate(0.1))),
    "unlowered chain": lambda: mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.scale_by_sign(), mt.optim.scale_by_learning_rate(0.1))),
}


@pytest.mark.parametrize("name", TIED)
def test_a_tensor_passed_twice_and_donated_is_updated_as_without_donation(name):
    # Tied weights as two leaves: updating each leaf in place would update the tensor twice.
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(64, 32, generator=g)}
    factory = TIED[name] if name not in FACTORIES else lambda: FACTORIES[name]()
    expected = []
    for donate in (False, True):
        w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        params = {"a": w, "b": w}
        opt = factory()
        state = opt.init(params)
        for _ in range(2):
            params, state = opt.update(grads, state, params, donate=donate)
        expected.append(params)
    torch.testing.assert_close(expected[1], expected[0], rtol=0, atol=0)


def test_a_lowered_chain_keeps_donating_though_its_state_shares_one_count():
    opt = TIED["chain"]()
    params = [torch.randn(64, 32, generator=torch.Generator().manual_seed(0))]
    state = opt.init(params)
    for _ in range(3):
        given = params[0].data_ptr()
        params, state = opt.update([torch.ones(64, 32)], state, params, donate=True)
        assert params[0].data_ptr() == given
