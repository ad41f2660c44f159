"""mt.random: Threefry-2x32 against the published known answers and a plain-Python reference,
JAX's published draws, statistics of the draws, and keys under vmap and torch.compile."""

from __future__ import annotations

import json
import math
import operator
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain import random

M32 = 0xFFFFFFFF

# Random123's kat_vectors (Salmon et al. 2011), the ones JAX's random_test checks:
# threefry2x32 20 <counter 0> <counter 1> <key 0> <key 1> -> <out 0> <out 1>
KAT_20_ROUNDS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
]


def words(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize(("counter", "key", "expected"), KAT_20_ROUNDS)
def test_threefry2x32_known_answers(counter, key, expected):
    x0, x1 = random.threefry2x32(words(*key), words(counter[0]), words(counter[1]))
    assert (int(x0), int(x1)) == expected


def reference_threefry(key: tuple[int, int], counter: tuple[int, int]) -> tuple[int, int]:
    """Threefry-2x32-20 on Python ints, written from the Random123 specification."""
    rotl = lambda v, r: ((v << r) | (v >> (32 - r))) & M32  # noqa: E731
    rotations = [13, 15, 26, 6, 17, 29, 16, 24]
    ks = [key[0], key[1], key[0] ^ key[1] ^ 0x1BD11BDA]
    x = [(counter[0] + ks[0]) & M32, (counter[1] + ks[1]) & M32]
    for round_ in range(20):
        x[0] = (x[0] + x[1]) & M32
        x[1] = rotl(x[1], rotations[round_ % 8]) ^ x[0]
        if round_ % 4 == 3:
            s = round_ // 4 + 1
            x[0] = (x[0] + ks[s % 3]) & M32
            x[1] = (x[1] + ks[(s + 1) % 3] + s) & M32
    return x[0], x[1]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, M32), min_size=4, max_size=4))
def test_threefry2x32_equals_a_plain_python_reference(w):
    x0, x1 = random.threefry2x32(words(w[0], w[1]), words(w[2]), words(w[3]))
    assert (int(x0), int(x1)) == reference_threefry((w[0], w[1]), (w[2], w[3]))


def test_draws_match_the_numbers_jax_publishes():
    # docs.jax.dev, "jax.random module": random.uniform(key(0)) is 0.947667 and, after
    # key, subkey = random.split(key), random.uniform(subkey) is 0.00729382.
    _, subkey = random.split(random.key(0))
    assert float(random.uniform(random.key(0), ())) == pytest.approx(0.947667, abs=1e-6)
    assert float(random.uniform(subkey, ())) == pytest.approx(0.00729382, abs=1e-8)


def test_keys_split_and_fold_in():
    assert torch.equal(random.key(42), words(0, 42))
    assert torch.equal(random.key(2**40 + 7), words(2**8, 7))
    assert random.key(0).dtype == torch.int64 and random.key(0).shape == (2,)
    k = random.key(3)
    keys = random.split(k, 5)
    assert keys.shape == (5, 2) and len({tuple(row.tolist()) for row in keys}) == 5
    for i, row in enumerate(keys):  # JAX's partitionable Threefry: split(k, n)[i] is fold_in(k, i)
        assert torch.equal(row, random.fold_in(k, i))
    assert ((keys >= 0) & (keys <= M32)).all()
    for bad in (2**64, -(2**63) - 1, True):  # (other types: the type hint refuses them)
        with pytest.raises(ValueError, match="seed must be an int that fits 64 bits or a CPU"):
            random.key(bad)


def test_a_key_from_a_generator_is_two_words_it_draws():
    """As the seed ``hi << 32 | lo`` of the two 32-bit words: the same generator state gives the
    same key, the next draw another, and the generator moves on as any draw moves it."""
    generator, twin = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    first, second = random.key(generator), random.key(generator)
    hi, lo = torch.randint(2**32, (2,), generator=twin).tolist()
    assert torch.equal(first, random.key(hi << 32 | lo)) and not torch.equal(first, second)
    assert torch.equal(second, torch.randint(2**32, (2,), generator=twin))
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=twin))


def test_same_key_same_numbers_and_distinct_keys_distinct_numbers():
    k1, k2 = random.split(random.key(0))
    for draw in (lambda k: random.uniform(k, (4, 5)), lambda k: random.normal(k, (7,)),
                 lambda k: random.bits(k, (3,)), lambda k: random.bernoulli(k, 0.5, (64,))):
        assert torch.equal(draw(k1), draw(k1))
        assert not torch.equal(draw(k1), draw(k2))


def test_statistics_of_1e5_draws():
    n = 100_000
    u = random.uniform(random.key(1), (n,))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    # standard error of the mean is sqrt(1/12 / n) = 0.0009; of the variance ~0.0002
    assert float(u.mean()) == pytest.approx(0.5, abs=0.005)
    assert float(u.var()) == pytest.approx(1 / 12, abs=0.002)
    z = random.normal(random.key(2), (n,))
    assert float(z.mean()) == pytest.approx(0.0, abs=0.02)
    assert float(z.var()) == pytest.approx(1.0, abs=0.02)
    assert float((z.abs() < 1).float().mean()) == pytest.approx(math.erf(1 / math.sqrt(2)),
                                                               abs=0.005)
    b = random.bernoulli(random.key(3), 0.3, (n,))
    assert b.dtype == torch.bool and float(b.float().mean()) == pytest.approx(0.3, abs=0.005)
    word = random.bits(random.key(4), (n,))  # drawn in cache-sized pieces: check the seams
    for i in (0, 2**15 - 1, 2**15, n - 1):
        assert int(word[i]) == operator.xor(*reference_threefry((0, 4), (0, i)))
    assert 0 <= int(word.min()) and int(word.max()) <= M32
    for bit in (0, 15, 31):  # every bit is a fair coin
        assert float(((word >> bit) & 1).float().mean()) == pytest.approx(0.5, abs=0.005)


def test_uniform_ranges_and_dtypes():
    u = random.uniform(random.key(0), (1000,), minval=-3.0, maxval=5.0)
    assert float(u.min()) >= -3 and float(u.max()) < 5 and float(u.max()) > 4
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        u = random.uniform(random.key(0), (10_000,), dtype)
        assert u.dtype == dtype and float(u.min()) >= 0 and float(u.max()) < 1
        assert random.normal(random.key(0), (5,), dtype).dtype == dtype
    with pytest.raises(ValueError, match="floating-point"):
        random.uniform(random.key(0), (2,), torch.int32)


def test_vmap_over_split_keys_draws_per_member():
    keys = random.split(random.key(0), 4)
    for draw in (lambda k: random.normal(k, (3, 2)), lambda k: random.bernoulli(k, 0.5, (16,)),
                 lambda k: random.split(random.fold_in(k, 7), 3)):
        batched = mt.vmap(draw)(keys)
        assert torch.equal(batched, torch.stack([draw(k) for k in keys]))
        assert len({tuple(row.flatten().tolist()) for row in batched}) == 4


COMPILED = """
import json, torch
import minitrain as mt
from minitrain import random

def draws(k):
    k1, k2 = random.split(random.fold_in(k, 3))
    return random.uniform(k1, (64,)), random.bernoulli(k2, 0.3, (64,)), random.normal(k2, (64,))

cfg = mt.models.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.1)
params = mt.models.gpt_init(random.key(0), cfg)
ids = torch.zeros(2, 8, dtype=torch.long)
out = {}
def gpt(params, key):
    return mt.models.gpt(params, ids, key, config=cfg)

explained = torch._dynamo.explain(gpt)(params, random.key(2))
out["gpt"] = [explained.graph_count, explained.graph_break_count]
compiled = torch.compile(draws, fullgraph=True)  # fails on a graph break: one graph, no break
equal = []
for seed in (1, 2):  # the key is an input, not a constant baked into the graph
    got, want = compiled(random.key(seed)), draws(random.key(seed))
    equal += [torch.equal(got[0], want[0]), torch.equal(got[1], want[1])]
    # inductor's erfinv rounds otherwise than ATen's in the last bit
    equal.append(torch.allclose(got[2], want[2], rtol=1e-6, atol=1e-6))
out["equal"] = equal
print(json.dumps(out))
"""


def test_compiled_draws_equal_eager_and_keys_do_not_break_the_graph():
    # A fresh interpreter, as a user's program runs: the suite's import hook wraps every
    # function of the package in checks that dynamo does not trace.
    done = subprocess.run([sys.executable, "-c", COMPILED], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MINITRAIN_TYPECHECK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["gpt"] == [1, 0], out
    assert all(out["equal"]), out["equal"]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32,
                                   torch.int64])
def test_a_key_of_any_integer_dtype_gives_the_same_numbers_everywhere(dtype):
    """A hand-made key of a narrower dtype: eager (the C words), the torch ops (vmap,
    torch.compile's path) and the key cast to int64 agree (its words are xor-ed as int64)."""
    k = torch.tensor([1, 100], dtype=dtype)
    draws = {"eager": random.uniform(k, (7,)), "int64": random.uniform(k.long(), (7,)),
             "vmap": torch.func.vmap(lambda kk: random.uniform(kk, (7,)))(k[None])[0]}
    index = torch.arange(7)
    words = random.threefry2x32(k, index >> 32, index & 0xFFFFFFFF)
    assert torch.equal(words[0] ^ words[1], random.bits(k.long(), (7,)))
    assert torch.equal(draws["eager"], draws["int64"]) and torch.equal(draws["eager"],
                                                                        draws["vmap"])


@pytest.mark.parametrize("bad", [0.0, None, torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0]),
                                 torch.zeros(2, 2, dtype=torch.int64)],
                         ids=["float", "none", "three-words", "float-tensor", "batch-of-keys"])
def test_what_is_no_key_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^a key is an integer tensor of shape \(2,\)"):
        random._checked(bad)


@pytest.mark.parametrize("draw", [
    lambda k: random.split(k, -1), lambda k: random.bits(k, (-1,)),
    lambda k: random.uniform(k, (2, -1)), lambda k: random.normal(k, (-2, -3)),
    lambda k: random.bernoulli(k, 0.5, (-1,))], ids=["split", "bits", "uniform", "normal",
                                                     "bernoulli"])
def test_every_draw_refuses_a_negative_size(draw):
    with pytest.raises(ValueError, match=r"^sizes must be >= 0"):
        draw(random.key(0))
