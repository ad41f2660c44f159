"""The optimizers' flattening equals torch's pytree: the same leaves in the same order, the
same rebuilt containers, and structures equal exactly when torch's TreeSpecs are."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.utils._pytree as _pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain.optim import _flat


def _trees(leaf):
    keys = st.one_of(st.text(max_size=3), st.integers(-2, 2))
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(keys, children, max_size=3),
        ),
        max_leaves=8,
    )


_TENSORS = st.integers(0, 3).map(lambda n: torch.full((n,), float(n)))
_ODD_NODES = st.sampled_from([None, 1.5, "x"]) | _TENSORS.map(
    lambda t: collections.OrderedDict(a=t)) | _TENSORS.map(torch.nn.Parameter)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b


@settings(max_examples=200, deadline=None)
@given(_trees(_TENSORS | _ODD_NODES))
def test_hypothesis_flatten_and_unflatten_equal_pytrees(tree):
    leaves, structure = _flat.flatten(tree)
    expected, spec = _pytree.tree_flatten(tree)
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected,
                                                                       strict=True))
    assert _same(_flat.unflatten(structure, leaves), _pytree.tree_unflatten(expected, spec))


@settings(max_examples=200, deadline=None)
@given(_trees(_TENSORS), _trees(_TENSORS))
def test_hypothesis_structures_are_equal_when_treespecs_are(a, b):
    same_spec = _pytree.tree_structure(a) == _pytree.tree_structure(b)
    sa, sb = _flat.flatten(a)[1], _flat.flatten(b)[1]
    assert (sa == sb) == same_spec
    if sa == sb:
        assert hash(sa) == hash(sb)


def test_unflatten_refuses_a_wrong_number_of_leaves():
    _, structure = _flat.flatten({"a": torch.ones(1), "b": [torch.ones(1)]})
    with pytest.raises(ValueError, match="fewer"):
        _flat.unflatten(structure, [torch.ones(1)])
    with pytest.raises(ValueError, match="more"):
        _flat.unflatten(structure, [torch.ones(1)] * 3)
