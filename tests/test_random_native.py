"""mt.random's C Threefry (``minitrain_threefry``) against the pure-torch ``threefry2x32``
path and a plain-Python reference; and every draw the same without the C library."""

from __future__ import annotations

import math
import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from minitrain import _native, random
from tests.test_random import M32, reference_threefry

needs_library = pytest.mark.skipif(_native._library() is None,
                                   reason="no C compiler: the C library cannot be built")
keys = st.tuples(st.integers(0, M32), st.integers(0, M32)).map(lambda w: torch.tensor(w))
SIZES = [1, 2, 8, 9, 1994, 2**15, 2**15 + 1, 70_001]  # one counter to several C blocks


class Watching(TorchFunctionMode):
    """A mode that only passes each call on: the draws take the pure-torch path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def torch_words(k: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    index = torch.arange(start, stop, dtype=torch.int64)
    return torch.stack(random.threefry2x32(k, index >> 32, index & M32), dim=-1)


@needs_library
@settings(max_examples=30, deadline=None)
@given(k=keys, start=st.one_of(st.integers(0, 2**62), st.integers(2**32 - 40, 2**32)),
       n=st.integers(0, 100))
def test_c_words_equal_torch_and_python_ints(k, start, n):
    stop = start + n
    pairs = random._native_threefry(k, start, stop, "pairs")
    xored = random._native_threefry(k, start, stop, "xor")
    assert pairs.shape == (n, 2) and xored.shape == (n,)
    assert torch.equal(pairs, torch_words(k, start, stop))
    assert torch.equal(xored, pairs[:, 0] ^ pairs[:, 1])
    for i in {*range(start, stop)[:1], *range(start, stop)[-1:]}:  # the ends, by a reference
        assert tuple(pairs[i - start].tolist()) == reference_threefry(
            tuple(k.tolist()), (i >> 32, i & M32))


@needs_library
@pytest.mark.parametrize("start", [0, 2**32 - 1_000, 2**40 + 12_345])
def test_c_words_of_many_counters_on_several_threads(start):
    k = random.key(7)
    n = 100_003  # blocks taken by several threads, a ragged last one
    xored = random._native_threefry(k, start, start + n, "xor")
    x = torch_words(k, start, start + n)
    assert torch.equal(xored, x[:, 0] ^ x[:, 1])
    for i in (0, 4095, 4096, n - 1):
        assert int(xored[i]) == operator.xor(*reference_threefry((0, 7), divmod(start + i, 2**32)))


def draws(k: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    return {"split": random.split(k, n), "fold_in": random.fold_in(k, n + M32 - 9),
            "bits": random.bits(k, (n,)), "uniform": random.uniform(k, (n,)),
            "uniform64": random.uniform(k, (n,), torch.float64, -2.0, 3.0),
            "uniform-wide": random.uniform(k, (n,), torch.float32, -2.0, 2.0),
            "uniform-bf16": random.uniform(k, (n,), torch.bfloat16),
            "normal": random.normal(k, (n,)), "normal64": random.normal(k, (n,), torch.float64),
            "bernoulli": random.bernoulli(k, 0.3, (n,))}


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype, name
        assert torch.equal(value, theirs[name]), name


@needs_library
@settings(max_examples=8, deadline=None)
@given(k=keys, n=st.sampled_from(SIZES))
def test_draws_equal_the_pure_torch_path(k, n):
    ours = draws(k, n)
    with Watching():
        theirs = draws(k, n)
    assert_same(ours, theirs)


@needs_library
@settings(max_examples=20, deadline=None)
@given(k=keys, n=st.sampled_from(SIZES),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_split_normal_in_one_call_is_split_then_normal(k, n, dtype):
    """DP-SGD's draw each step: the next key and the noise, as split and normal give them."""
    new_key, noise = random._split_normal(k, n, dtype)
    first, second = random.split(k)
    assert torch.equal(new_key, first)
    assert noise.dtype == dtype and torch.equal(noise, random.normal(second, (n,), dtype))
    with Watching():
        assert torch.equal(random._split_normal(k, n, dtype)[1], noise)


@needs_library
@settings(max_examples=60, deadline=None)
@given(k=keys, dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
       minval=st.one_of(st.sampled_from([0.0, -1.0, -1.0 + 2.0**-24, math.nextafter(-1.0, 0.0)]),
                        st.floats(-3e4, 3e4)),
       span=st.one_of(st.sampled_from([1.0, 2.0, 0.5, 2.0**-20, 3.0]),
                      st.floats(2.0**-30, 3e4)))
def test_uniform_of_every_range_equals_the_pure_torch_path(k, dtype, minval, span):
    """C writes the numbers where ``span`` is a power of two, and the units otherwise."""
    ours = random.uniform(k, (257,), dtype, minval, minval + span)
    with Watching():
        theirs = random.uniform(k, (257,), dtype, minval, minval + span)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


@needs_library
@pytest.mark.parametrize("n", SIZES)
def test_draws_without_the_c_library_are_the_same(monkeypatch, n):
    k = random.fold_in(random.key(2**40 + 3), 11)
    ours = draws(k, n)
    monkeypatch.setattr(_native, "_library", lambda: None)  # as MINITRAIN_STREAMING=0
    assert random._native_threefry(k, 0, 4, "xor") is None
    assert_same(ours, draws(k, n))
