"""Aliased inputs to the optimizers' fast paths: params, grads and state that share memory
(one tensor twice, overlapping slices, slices of one flat buffer, a grad that is a param or a
state buffer, tensors over one memory with storages of their own from ``torch.from_dlpack``,
tensors whose elements share an address). A pure update gives what it gives on independent
clones and writes none of its inputs; a donated one gives the pure update's numbers (in place
only where that is well defined)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain import tree
from minitrain.optim.kernels import checks as _safety
from minitrain.optim.kernels import pool as _buffers

OPTS = {
    "sgd": lambda: mt.optim.sgd(lr=0.1),
    "sgd-momentum": lambda: mt.optim.sgd(lr=0.1, momentum=0.9),
    "adam": lambda: mt.optim.adam(lr=0.01, weight_decay=0.1),
    "adamw": lambda: mt.optim.adamw(lr=0.01),
    "adagrad": lambda: mt.optim.adagrad(lr=0.1),
    "rmsprop": lambda: mt.optim.rmsprop(lr=0.01, centered=True, momentum=0.5),
    "nadam": lambda: mt.optim.nadam(lr=0.01),
    "lion": lambda: mt.optim.lion(lr=0.01),
    "adafactor": lambda: mt.optim.adafactor(lr=0.01),
    "muon": lambda: mt.optim.muon(lr=0.01),
}
SHAPE = (32, 8)  # 256 elements: the fast path's kernels take it
N = SHAPE[0] * SHAPE[1]


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape or SHAPE, generator=torch.Generator().manual_seed(seed))


def _clones(x):
    return tree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree.leaves(x) if isinstance(t, torch.Tensor)]


def _warm_state(name: str, params: dict):
    """A state after one update on independent clones (non-zero moments)."""
    opt = OPTS[name]()
    grads = {k: _randn(7 + i, *v.shape) for i, (k, v) in enumerate(params.items())}
    return opt.update(grads, opt.init(_clones(params)), _clones(params))[1]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory with a storage of its own."""
    other = torch.from_dlpack(t)
    assert other.untyped_storage()._cdata != t.untyped_storage()._cdata
    assert other.data_ptr() == t.data_ptr()
    return other


def _check(name, grads, state, params, donate, exact=True):
    """The update of these (aliased) inputs against the pure update of independent clones;
    a pure update must leave every input as it was."""
    expected = OPTS[name]().update(_clones(grads), _clones(state), _clones(params))
    before = [t.clone() for t in _tensors((grads, state, params))]
    got = OPTS[name]().update(grads, state, params, donate=donate)
    tolerance = dict(rtol=0, atol=0) if exact else {}
    for new, ref in zip(_tensors(got), _tensors(expected), strict=True):
        torch.testing.assert_close(new, ref, equal_nan=True, **tolerance)
    if not donate:
        for now, then in zip(_tensors((grads, state, params)), before, strict=True):
            torch.testing.assert_close(now, then, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------
# Memory shared through storages of their own (torch.from_dlpack): donation was decided by
# storage identity, so these were updated in place, one leaf's write read by the next.


@pytest.mark.parametrize("name", OPTS)
def test_one_param_through_two_storages_and_donated_gives_the_pure_result(name):
    w = _randn(0)
    params = {"a": w, "b": _alias(w)}
    grads = {"a": _randn(1), "b": _randn(2)}
    state = _warm_state(name, {"a": w.clone(), "b": w.clone()})
    _check(name, grads, state, params, donate=True)


@pytest.mark.parametrize("name", OPTS)
def test_overlapping_slices_with_storages_of_their_own_donated_give_the_pure_result(name):
    flat = _randn(0, 3 * N // 2)
    params = {"a": _alias(flat[:N]).view(SHAPE), "b": _alias(flat[N // 2:]).view(SHAPE)}
    grads = {"a": _randn(1), "b": _randn(2)}
    _check(name, grads, _warm_state(name, _clones(params)), params, donate=True)


# (Muon reads every grad into its momentum before it writes a param: not among these.)
WRITE_AS_THEY_READ = [name for name in OPTS if name != "muon"]


@pytest.mark.parametrize("name", WRITE_AS_THEY_READ)
def test_grads_over_other_leaves_params_through_their_own_storages_give_the_pure_result(name):
    params = {"a": _randn(0), "b": _randn(1)}
    grads = {"a": _alias(params["b"]), "b": _alias(params["a"])}
    _check(name, grads, _warm_state(name, params), params, donate=True)


@pytest.mark.parametrize("name", WRITE_AS_THEY_READ)
def test_a_grad_over_its_params_memory_shifted_and_donated_gives_the_pure_result(name):
    # The grad reads the elements just before the param's: written before they are read.
    flat = _randn(0, N + 8)
    params = {"a": _alias(flat[8:]).view(SHAPE), "b": _randn(1)}
    grads = {"a": _alias(flat[:N]).view(SHAPE), "b": _randn(2)}
    _check(name, grads, _warm_state(name, _clones(params)), params, donate=True)


@pytest.mark.parametrize("name", [n for n in OPTS if n not in ("sgd", "adafactor")])
def test_a_state_leaf_over_another_leafs_param_memory_donated_gives_the_pure_result(name):
    # (Adafactor's factored moments cannot be such a leaf through the checked fields.)
    params = {"a": _randn(0).abs(), "b": _randn(1).abs()}  # any moment may hold them
    state = _warm_state(name, params)
    named = tree.named_leaves(state)
    edited = [_alias(params["a"]) if path.endswith("b") and isinstance(t, torch.Tensor)
              and t.shape == SHAPE else t for path, t in named]
    assert any(t is not old for t, (_, old) in zip(edited, named, strict=True))
    state = tree.unflatten(tree.structure(state), edited)
    _check(name, {"a": _randn(2), "b": _randn(3)}, state, params, donate=True)


def test_adafactors_moment_over_another_leafs_param_donated_gives_the_pure_result():
    """A row moment of leaf b (edited by hand) in the memory of param a: the donated update
    wrote a first and then read b's moment from it (2.4e-4 off the pure update)."""
    params = {"a": _randn(0, 64, 64), "b": _randn(1, 64, 64)}
    state = _warm_state("adafactor", params)
    named = tree.named_leaves(state)
    edited = [params["a"][:, :1].abs_() if path.endswith("row_var.b") else t
              for path, t in named]
    state = tree.unflatten(tree.structure(state), edited)
    grads = {"a": _randn(2, 64, 64), "b": _randn(3, 64, 64)}
    pure = OPTS["adafactor"]().update(_clones(grads), _clones(state), _clones(params))[0]
    donated = OPTS["adafactor"]().update(grads, state, params, donate=True)[0]
    for key in params:  # the moment is a strided view: its clone takes the kernel, it does not
        torch.testing.assert_close(donated[key], pure[key], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Params whose elements share an address (expanded with stride 0, strides that interleave):
# no in-place update is elementwise on them, and a recycled buffer must not copy their strides.


def _self_overlapping(kind: str, seed: int) -> torch.Tensor:
    if kind == "expanded":
        return _randn(seed, SHAPE[1]).expand(SHAPE)
    return _randn(seed, SHAPE[0] + SHAPE[1] - 1).as_strided(SHAPE, (1, 1))


@pytest.mark.parametrize("kind", ["expanded", "interleaved"])
@pytest.mark.parametrize("name", ["nadam", "lion", "adafactor", "muon"])
def test_a_param_whose_elements_share_an_address_is_not_written_in_place(name, kind):
    params = {"a": _self_overlapping(kind, 0), "b": _randn(1)}
    state = _warm_state(name, _clones(params))
    _check(name, {"a": _randn(2), "b": _randn(3)}, state, params, donate=True, exact=False)


@pytest.mark.parametrize("kind", ["expanded", "interleaved"])
def test_muons_pure_update_of_such_a_param_or_momentum_gives_the_clones_result(kind):
    params = {"a": _self_overlapping(kind, 0), "b": _randn(1)}
    _check("muon", {"a": _randn(2), "b": _randn(3)}, _warm_state("muon", _clones(params)),
           params, donate=False, exact=False)
    params = {"a": _randn(0), "b": _randn(1)}
    (momentum, ortho), decay, lr = _warm_state("muon", params)
    buffer = _self_overlapping(kind, 4)
    momentum = momentum._replace(momentum_buffer={"a": buffer, "b": momentum.momentum_buffer["b"]})
    _check("muon", {"a": _randn(2), "b": _randn(3)}, ((momentum, ortho), decay, lr), params,
           donate=False, exact=False)


def test_clipping_an_expanded_grad_gives_the_clones_result():
    # What autograd gives for p.sum(): an expanded grad (torch.func.grad does not copy it).
    tx = mt.optim.clip_by_global_norm(0.5)
    grads = {"w": _self_overlapping("expanded", 0), "b": _randn(1)}
    clipped, _ = tx.update(grads, tx.init(grads))
    expected, _ = tx.update(_clones(grads), tx.init(grads))
    torch.testing.assert_close(clipped, expected)


@pytest.mark.parametrize("kind", ["expanded", "interleaved"])
def test_the_pool_hands_out_buffers_whose_elements_have_addresses_of_their_own(kind):
    t = _self_overlapping(kind, 0)
    pool = _buffers.BufferPool()
    pool.begin_update()
    for buffer in (pool.empty_like(t), *pool([t, t])):
        assert buffer.shape == t.shape and buffer.is_contiguous()
    transposed = _randn(0).t()
    assert pool.empty_like(transposed).stride() == transposed.stride()  # dense: kept


def test_donatable_compares_memory_not_storages():
    w, g = _randn(0), _randn(1)
    assert _safety.donatable([w], [g], [[_randn(2)]])
    assert not _safety.donatable([w, _alias(w)], [g, g], [])
    assert not _safety.donatable([w], [_alias(w)], [])
    assert not _safety.donatable([w], [g], [[_alias(g[4:])]])
    assert _safety.donatable([w], [g, _alias(g)], [])  # grads are only read
    assert not _safety.donatable([_self_overlapping("interleaved", 0)], [g], [])
    assert _safety.donatable([_randn(3, 16, 16)[:, ::2]], [g], [])  # gaps, no overlap
    assert not _safety.kernel_ready([w, _alias(w)], [g, g], {}, donated=True)
    assert _safety.kernel_ready([w, _alias(w)], [g, g], {})  # pure: only read


# --------------------------------------------------------------------------------------------
# Regression guards (these pass before the fixes above): aliasing within one storage.


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTS)),
    offsets=st.tuples(st.integers(0, N), st.integers(0, N)),
    grad_at=st.one_of(st.none(), st.integers(0, N)),
    through=st.sampled_from(["views", "own storages"]),
    donate=st.booleans(),
)
def test_hypothesis_params_over_one_buffer_update_as_independent_clones(
        name, offsets, grad_at, through, donate):
    # Regression guard for "views"; "own storages" with donate failed before the fix.
    flat = _randn(0, 2 * N)
    view = (lambda t: t) if through == "views" else _alias
    params = {"a": view(flat[offsets[0]:offsets[0] + N]).view(SHAPE),
              "b": view(flat[offsets[1]:offsets[1] + N]).view(SHAPE)}
    grads = {"a": _randn(1), "b": _randn(2)}
    if grad_at is not None:  # a grad over the params' buffer too
        grads["a"] = view(flat[grad_at:grad_at + N]).view(SHAPE)
    _check(name, grads, _warm_state(name, _clones(params)), params, donate)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", OPTS)
def test_slices_of_one_flat_param_buffer_update_as_independent_params(name, donate):
    # Regression guard: FSDP-style flat params and grads, at an odd offset; then one grad
    # tensor for both leaves.
    flat_p, flat_g = _randn(0, 3 + 2 * N), _randn(1, 3 + 2 * N)
    params = {"a": flat_p[3:3 + N].view(SHAPE), "b": flat_p[3 + N:].view(SHAPE)}
    grads = {"a": flat_g[3:3 + N].view(SHAPE), "b": flat_g[3 + N:].view(SHAPE)}
    state = _warm_state(name, _clones(params))
    _check(name, grads, _clones(state), params, donate)
    _check(name, {"a": grads["a"], "b": grads["a"]}, state, params, donate)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", [n for n in OPTS if n not in ("sgd", "adafactor")])
def test_a_grad_that_is_a_state_buffer_or_shared_state_updates_as_clones(name, donate):
    # Regression guard: a grad that is its leaf's moment; then one tensor as every moment of
    # both leaves (state edited by hand).
    params = {"a": _randn(0), "b": _randn(1)}
    state = _warm_state(name, params)
    named = tree.named_leaves(state)
    moment = next(t for path, t in named if path.endswith("a") and t.shape == SHAPE)
    _check(name, {"a": moment, "b": _randn(2)}, state, params, donate)
    one = _randn(4).abs() + 0.1  # any moment may hold it
    shared = [one if t.shape == SHAPE else t for _, t in named]
    _check(name, {"a": _randn(2), "b": _randn(3)},
           tree.unflatten(tree.structure(state), shared), params, donate)
