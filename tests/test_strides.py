"""Stride math against real torch tensors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain import strides as S

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple)
matrix_shapes = st.lists(st.integers(1, 4), min_size=2, max_size=4).map(tuple)


def base_tensor(shape) -> torch.Tensor:
    return torch.arange(max(math.prod(shape), 1), dtype=torch.float32)[: math.prod(shape)].view(
        shape
    )


@st.composite
def strided_tensors(draw, shape_strategy=shapes, min_ops=0):
    """A real torch tensor reached by a random chain of zero-copy ops, and the chain.

    The strategy only touches torch; minitrain replays the chain inside the test (beartype's
    checks draw from the ``random`` module, which strategies must leave alone).
    """
    shape = draw(shape_strategy)
    tensor, ops = base_tensor(shape), []
    for _ in range(draw(st.integers(min_ops, 4))):
        ndim = tensor.ndim
        op = draw(st.sampled_from(["transpose", "permute", "slice", "expand", "unsqueeze"]))
        if op == "transpose" and ndim:
            d0, d1 = draw(st.integers(-ndim, ndim - 1)), draw(st.integers(-ndim, ndim - 1))
            tensor, step = tensor.transpose(d0, d1), ("transpose", d0, d1)
        elif op == "permute" and ndim:
            dims = draw(st.permutations(range(ndim)))
            tensor, step = tensor.permute(*dims), ("permute", dims)
        elif op == "slice" and ndim:
            d = draw(st.integers(0, ndim - 1))
            start = draw(st.none() | st.integers(-6, 6))
            stop = draw(st.none() | st.integers(-6, 6))
            stride = draw(st.integers(1, 3))
            index = (builtins_slice(None),) * d + (builtins_slice(start, stop, stride),)
            tensor, step = tensor[index], ("slice", d, start, stop, stride)
        elif op == "expand":
            target = draw(st.lists(st.integers(0, 3), max_size=2))
            for size in tensor.shape:
                keep = st.sampled_from([size, -1])
                target.append(draw(st.integers(0, 3) if size == 1 else keep))
            tensor, step = tensor.expand(target), ("expand", target)
        elif op == "unsqueeze":  # a new leading size-1 dim, via expand
            target = [1, *tensor.shape]
            tensor, step = tensor.expand(target), ("expand", target)
        else:
            continue
        ops.append(step)
    return tensor, shape, ops


def replay(shape, ops) -> S.Layout:
    layout = S.contiguous(shape)
    for name, *args in ops:
        layout = getattr(S, name)(layout, *args)
    return layout


builtins_slice = slice


def assert_layout_matches(tensor: torch.Tensor, layout: S.Layout):
    assert layout == S.layout_of(tensor)


@st.composite
def same_numel_shapes(draw, numel: int):
    """A shape with ``numel`` elements: a random factorization with size-1 dims mixed in."""
    if numel == 0:
        dims = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        dims[draw(st.integers(0, len(dims) - 1))] = 0
        return tuple(dims)
    factors, rest, p = [], numel, 2
    while rest > 1:
        while rest % p == 0:
            factors.append(p)
            rest //= p
        p += 1
    factors = draw(st.permutations(factors))
    dims, i = [], 0
    while i < len(factors):
        take = draw(st.integers(1, len(factors) - i))
        dims.append(math.prod(factors[i : i + take]))
        i += take
    for _ in range(draw(st.integers(0, 2))):
        dims.insert(draw(st.integers(0, len(dims))), 1)
    if dims and draw(st.booleans()):
        dims[draw(st.integers(0, len(dims) - 1))] = -1
    return tuple(dims)


def torch_view(tensor: torch.Tensor, shape) -> torch.Tensor | None:
    try:
        return tensor.view(shape)
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------------------------


def test_chapter_example():
    x = torch.tensor([[0.0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])
    assert S.contiguous_strides(x.shape) == x.stride() == (4, 1)
    position = S.offset((1, 2), x.stride())
    assert position == 6 and x.flatten()[position] == x[1, 2]


@settings(deadline=None, max_examples=80)
@given(shape=shapes)
def test_contiguous_strides_match_torch(shape):
    tensor = torch.empty(shape)
    assert S.contiguous_strides(shape) == tensor.stride()
    assert S.is_contiguous(shape, tensor.stride())


@settings(deadline=None, max_examples=150)
@given(case=strided_tensors())
def test_transforms_match_torch(case):
    tensor, shape, ops = case
    layout = replay(shape, ops)
    assert_layout_matches(tensor, layout)
    assert S.is_contiguous(layout.shape, layout.strides) == tensor.is_contiguous()


@settings(deadline=None, max_examples=100)
@given(case=strided_tensors(nonempty_shapes), data=st.data())
def test_offsets_address_the_same_storage_element(case, data):
    tensor, shape, ops = case
    layout = replay(shape, ops)
    if tensor.numel() == 0:
        return
    index = tuple(data.draw(st.integers(0, size - 1)) for size in tensor.shape)
    storage = torch.arange(tensor.untyped_storage().nbytes() // 4, dtype=torch.float32)
    position = S.offset(index, layout.strides, layout.storage_offset)
    assert storage[position] == tensor[index] if index else storage[position] == tensor.item()


@settings(deadline=None, max_examples=250)
@given(case=st.one_of(strided_tensors(), strided_tensors(matrix_shapes, 1)), data=st.data())
def test_view_strides_fail_exactly_when_torch_view_raises(case, data):
    tensor, shape, ops = case
    layout = replay(shape, ops)
    new_shape = data.draw(same_numel_shapes(tensor.numel()))
    expected = torch_view(tensor, new_shape)
    got = S.view_strides(layout.shape, layout.strides, new_shape)
    if expected is None:
        assert got is None
    else:
        assert got == expected.stride()
        assert S.view(layout, new_shape) == S.layout_of(expected)


@settings(deadline=None, max_examples=100)
@given(case=strided_tensors(nonempty_shapes), data=st.data())
def test_view_of_merged_and_split_neighbours(case, data):
    # Merging two neighbouring dims, the common case for .view: compare with torch.
    tensor, shape, ops = case
    layout = replay(shape, ops)
    if tensor.ndim < 2:
        return
    d = data.draw(st.integers(0, tensor.ndim - 2))
    new_shape = (*tensor.shape[:d], tensor.shape[d] * tensor.shape[d + 1], *tensor.shape[d + 2 :])
    expected = torch_view(tensor, new_shape)
    got = S.view_strides(layout.shape, layout.strides, new_shape)
    assert got == (None if expected is None else expected.stride())


def test_transposed_view_needs_a_copy():
    x = torch.zeros(4, 3).t()
    assert S.view_strides(x.shape, x.stride(), (12,)) is None
    with pytest.raises(RuntimeError):
        x.view(12)
    y = x.contiguous()
    assert S.view_strides(y.shape, y.stride(), (12,)) == (1,)


def test_zero_size_and_zero_dim_views():
    for shape, new_shape in [((2, 0, 3), (0, 6)), ((0,), (3, 0, 2)), ((), (1, 1))]:
        tensor = torch.empty(shape)
        assert S.view_strides(shape, tensor.stride(), new_shape) == tensor.view(new_shape).stride()


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="holds 7 elements, not 6"):
        S.view_strides((2, 3), (3, 1), (7,))
    with pytest.raises(ValueError, match="one -1"):
        S.view_strides((2, 3), (3, 1), (-1, -1))
    with pytest.raises(ValueError, match="non-singleton dimension 1"):
        S.expand(S.contiguous((2, 3)), (2, 4))
    with pytest.raises(ValueError, match="positive"):
        S.slice(S.contiguous((4,)), 0, step=-1)
    with pytest.raises(ValueError, match="one stride per dimension"):
        S.is_contiguous((2, 3), (1,))
    with pytest.raises(ValueError, match="each of the 2 dimensions once"):
        S.permute(S.contiguous((2, 3)), (0, 0))


def ordered_factorizations(n: int, max_len: int) -> list[tuple[int, ...]]:
    """Every shape of ``n`` elements with at most ``max_len`` dims (size-1 dims included)."""
    if max_len == 0:
        return [()] if n == 1 else []
    found = [()] if n == 1 else []
    for first in range(1, n + 1):
        if n % first == 0:
            found += [(first, *rest) for rest in ordered_factorizations(n // first, max_len - 1)]
    return found


def test_view_of_every_permutation_to_every_shape_matches_torch():
    # Exhaustive on a small case: 24 permutations x 2 slicings x every 12-element shape.
    base = base_tensor((2, 1, 3, 2))
    checked = failed = 0
    for dims in itertools.permutations(range(4)):
        for step in (1, 2):
            tensor = base.permute(dims)[..., ::step]
            layout = S.slice(S.permute(S.contiguous(base.shape), dims), -1, None, None, step)
            assert layout == S.layout_of(tensor)
            for new_shape in ordered_factorizations(tensor.numel(), 4):
                expected = torch_view(tensor, new_shape)
                got = S.view_strides(layout.shape, layout.strides, new_shape)
                assert got == (None if expected is None else expected.stride()), new_shape
                checked, failed = checked + 1, failed + (got is None)
    assert checked > 1000 and 0 < failed < checked
