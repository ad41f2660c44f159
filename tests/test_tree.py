"""Property tests for minitrain.tree against torch's own pytree and state_dict naming."""

import collections
from collections import namedtuple

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import minitrain as mt

dtypes = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8])
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
tensors = st.builds(lambda shape, dtype: torch.zeros(shape, dtype=dtype), shapes, dtypes)
keys = st.text("abcdefgh_", min_size=1, max_size=5)
trees = st.recursive(
    tensors,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
    ),
    max_leaves=12,
)


@settings(deadline=None, max_examples=60)
@given(trees)
def test_map_and_leaves_roundtrip(tree):
    mapped = mt.tree.map(lambda x: x + 1, tree)
    assert mt.tree.structure(mapped) == mt.tree.structure(tree)
    for new, old in zip(mt.tree.leaves(mapped), mt.tree.leaves(tree), strict=True):
        assert torch.equal(new, old + 1)
    rebuilt = mt.tree.unflatten(mt.tree.structure(tree), mt.tree.leaves(tree))
    assert mt.tree.structure(rebuilt) == mt.tree.structure(tree)
    assert all(a is b for a, b in zip(mt.tree.leaves(rebuilt), mt.tree.leaves(tree), strict=True))


parameters = tensors.map(lambda t: torch.nn.Parameter(t, requires_grad=t.is_floating_point()))
flat_dicts = st.dictionaries(
    st.one_of(keys, st.integers(0, 2), st.sampled_from([0.0, 1.0, True, False])),
    st.one_of(tensors, parameters, st.none(), st.integers()),
    max_size=6,
)


@settings(deadline=None, max_examples=100)
@given(st.one_of(trees, flat_dicts))
def test_flatten_is_torchs_cxx_pytree(tree):
    """Leaves (the same objects, in order) and structure equal torch's optree-backed pytree's,
    for flat dicts of tensors (params, grads: flattened without a walk) and every other tree."""
    leaves, spec = mt._torch.pytree.tree_flatten(tree)
    want_leaves, want_spec = torch.utils._cxx_pytree.tree_flatten(tree)
    assert spec == want_spec and len(leaves) == len(want_leaves)
    assert all(a is b for a, b in zip(leaves, want_leaves, strict=True))
    rebuilt = mt._torch.pytree.tree_unflatten(leaves, spec)
    rebuilt_leaves, rebuilt_spec = torch.utils._cxx_pytree.tree_flatten(rebuilt)
    assert rebuilt_spec == want_spec
    assert all(a is b for a, b in zip(rebuilt_leaves, want_leaves, strict=True))
    if isinstance(tree, dict):  # the keys' order and types kept (1, 1.0 and True are equal)
        assert [(type(k), k) for k in rebuilt] == [(type(k), k) for k in tree]


@pytest.mark.parametrize("first, second", [(1, 1.0), (1, True), (0.0, False), ("a", "a")])
def test_flatten_keeps_the_type_of_equal_keys(first, second):
    """A dict flattened after one whose key is equal but of another type keeps its own key."""
    t = torch.ones(1)
    mt._torch.pytree.tree_flatten({first: t})
    leaves, spec = mt._torch.pytree.tree_flatten({second: t})
    (key,) = mt._torch.pytree.tree_unflatten(leaves, spec)
    assert type(key) is type(second)


@settings(deadline=None, max_examples=60)
@given(trees)
def test_nbytes_and_size_match_tensor_sums(tree):
    leaves = mt.tree.leaves(tree)
    assert mt.tree.size(tree) == sum(t.numel() for t in leaves)
    assert mt.tree.nbytes(tree) == sum(t.untyped_storage().nbytes() for t in leaves)


@settings(deadline=None, max_examples=60)
@given(trees)
def test_named_leaves_order_matches_leaves(tree):
    named = mt.tree.named_leaves(tree)
    assert all(a is b for (_, a), b in zip(named, mt.tree.leaves(tree), strict=True))
    names = [name for name, _ in named]
    assert len(set(names)) == len(names)


def test_named_leaves_match_state_dict_of_equivalent_module():
    class Linear(torch.nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(i, o))

    class Cruncher(torch.nn.Module):  # the chapter's, 3.5.2
        def __init__(self, dim, num_layers):
            super().__init__()
            self.layers = torch.nn.ModuleList([Linear(dim, dim) for _ in range(num_layers)])
            self.final = Linear(dim, 1)

    D = 64
    params = mt.models.cruncher_init(dim=D, num_layers=2, generator=torch.Generator())
    expected = [(name, p.numel()) for name, p in Cruncher(D, 2).state_dict().items()]
    got = [(name, p.numel()) for name, p in mt.tree.named_leaves(params)]
    assert (
        got
        == expected
        == [("layers.0.weight", D * D), ("layers.1.weight", D * D), ("final.weight", D)]
    )


def test_named_leaves_of_namedtuple_use_field_names():
    State = namedtuple("State", ["mu", "nu"])
    named = mt.tree.named_leaves({"adam": State(torch.zeros(1), [torch.ones(2)])})
    assert [name for name, _ in named] == ["adam.mu", "adam.nu.0"]


def test_zeros_like_keeps_structure_dtype_and_device():
    tree = {"a": torch.ones(2, dtype=torch.bfloat16), "b": [torch.ones(3, dtype=torch.int32)]}
    zeros = mt.tree.zeros_like(tree)
    assert mt.tree.structure(zeros) == mt.tree.structure(tree)
    for z, t in zip(mt.tree.leaves(zeros), mt.tree.leaves(tree), strict=True):
        assert z.dtype == t.dtype and z.shape == t.shape and not z.any()


@settings(deadline=None, max_examples=40)
@given(
    st.lists(
        st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=5), min_size=1, max_size=4
    )
)
def test_global_norm_equals_norm_of_concatenation(values):
    tree = [torch.tensor(v) for v in values]
    expected = torch.linalg.vector_norm(torch.cat(tree))
    torch.testing.assert_close(mt.tree.global_norm(tree), expected)


def test_structure_check_names_first_differing_leaf():
    a = {"layers": [{"weight": torch.ones(1)}], "final": {"weight": torch.ones(1)}}
    b = {"layers": [{"weight": torch.ones(1)}], "final": {"bias": torch.ones(1)}}
    with pytest.raises(ValueError, match="differ at leaf 'final.weight'"):
        mt.tree.assert_same_structure(a, b, names=("params", "grads"))
    c = {"layers": [{"weight": torch.ones(1)}]}
    with pytest.raises(ValueError, match="'final.weight'"):
        mt.tree.assert_same_structure(a, c)
    with pytest.raises(ValueError, match="'final.weight': shape"):
        mt.tree.assert_same_structure(
            a,
            {"layers": [{"weight": torch.ones(1)}], "final": {"weight": torch.ones(2)}},
            check_shapes=True,
        )
    mt.tree.assert_same_structure(a, mt.tree.zeros_like(a), check_shapes=True)


@pytest.mark.parametrize("make_a, make_b", [(list, tuple), (dict, collections.OrderedDict),
                                            (dict, lambda d: collections.defaultdict(int, d))])
def test_structure_check_names_containers_that_name_their_leaves_alike(make_a, make_b):
    x = torch.ones(1)
    trees = [make(v) for make, v in ((make_a, (x, x)), (make_b, (x, x)))] if make_a is list \
        else [make({"w": x, "b": x}) for make in (make_a, make_b)]
    for a, b in (trees, trees[::-1]):
        with pytest.raises(ValueError, match="different container types"):
            mt.tree.assert_same_structure(a, b)


def test_map_over_mismatched_trees_names_the_leaf():
    with pytest.raises(ValueError, match="differ at leaf 'b'"):
        mt.tree.map(
            lambda x, y: x + y, {"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1)}
        )


def test_global_norm_works_under_vmap():
    stacked = {"a": torch.randn(3, 4), "b": [torch.randn(3, 2, 2)]}
    batched = mt.vmap(mt.tree.global_norm)(stacked)
    for k in range(3):
        member = {"a": stacked["a"][k], "b": [stacked["b"][0][k]]}
        torch.testing.assert_close(batched[k], mt.tree.global_norm(member))
