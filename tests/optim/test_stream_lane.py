"""Updates whose leaves the one-pass check accepts call the streaming kernel directly; they give
the bits of the rule's own fast step, pure and donated, with a weight-decay mask, and anything
the check refuses still takes the full checks."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

import minitrain as mt
from minitrain.optim import _flat, _layout, base
from minitrain.optim.kernels import streaming

needs_kernels = pytest.mark.skipif(
    not streaming.available(), reason="no C compiler: the streaming kernels cannot be built"
)


def _matrices(name, p):
    return p.ndim >= 2


CONFIGS = {
    "sgd": (mt.optim.sgd, dict(lr=0.1)),
    "sgd-momentum-decay": (mt.optim.sgd, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    "sgd-nesterov-mask": (mt.optim.sgd, dict(lr=0.1, momentum=0.9, nesterov=True,
                                             weight_decay=0.2, mask=_matrices)),
    "adam": (mt.optim.adam, dict(lr=0.01, weight_decay=0.1)),
    "adam-amsgrad": (mt.optim.adam, dict(lr=0.01, amsgrad=True)),
    "adamw-mask-schedule": (mt.optim.adamw, dict(
        lr=mt.optim.cosine_schedule(0.01, decay_steps=10), weight_decay=0.5, mask=_matrices)),
    "adagrad": (mt.optim.adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)),
    "rmsprop": (mt.optim.rmsprop, dict(lr=0.01)),
    "rmsprop-centered-momentum": (mt.optim.rmsprop, dict(lr=0.01, momentum=0.9, centered=True,
                                                         weight_decay=0.1)),
}


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(70, 300, generator=g), "b": torch.randn(300, generator=g),
              "blocks": [torch.randn(33, 7, generator=g), torch.randn(5, generator=g)]}
    grads = [mt.tree.map(lambda p: torch.randn(p.shape, generator=g), params) for _ in range(3)]
    return params, grads


def _run(opt, params, grads, donate):
    params = mt.tree.map(torch.clone, params)
    state = opt.init(params)
    for step_grads in grads:
        params, state = opt.update(step_grads, state, params, donate=donate)
    return params, state


def _counting(monkeypatch, driver):
    calls = []
    original = getattr(base, driver)

    def counted(*args, **kwargs):
        calls.append(driver)
        return original(*args, **kwargs)

    monkeypatch.setattr(base, driver, counted)
    return calls


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", CONFIGS)
def test_the_direct_kernel_call_gives_the_fast_steps_bits(name, donate, monkeypatch):
    factory, kwargs = CONFIGS[name]
    params, grads = _data(0)
    lane = _counting(monkeypatch, "_stream_update")
    direct = _run(factory(**kwargs, impl="fast"), params, grads, donate)
    assert lane, "the update did not call the kernel directly"
    monkeypatch.setattr(base, "_streams", lambda rule, leaves: False)
    stepped = _run(factory(**kwargs, impl="fast"), params, grads, donate)
    for a, b in zip(mt.tree.leaves(direct), mt.tree.leaves(stepped), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert int(direct[1].count) == len(grads)


@needs_kernels
def test_maximize_takes_the_fast_step(monkeypatch):
    params, grads = _data(1)
    lane = _counting(monkeypatch, "_stream_update")
    _run(mt.optim.sgd(lr=0.1, maximize=True, impl="fast"), params, grads, donate=False)
    assert not lane


@needs_kernels
@pytest.mark.parametrize("layout", ["transposed", "expanded", "float64"])
def test_grads_the_one_pass_check_refuses_take_the_full_checks(layout, monkeypatch):
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    row = torch.randn(1, 4)
    grads = {"w": row.expand(6, 4).clone(), "b": torch.randn(4)}
    want, _ = _run(mt.optim.adam(lr=0.1, impl="fast"), params, [grads], donate=False)
    odd = {"transposed": grads["w"].t().contiguous().t(), "expanded": row.expand(6, 4),
           "float64": grads["w"].double()}[layout]
    lane = _counting(monkeypatch, "_stream_update")
    opt = mt.optim.adam(lr=0.1, impl="fast")
    if layout == "float64":
        with pytest.raises(ValueError, match="'w'"):
            opt.update(dict(grads, w=odd), opt.init(params), params)
        return
    got, _ = opt.update(dict(grads, w=odd), opt.init(params), params)
    assert not lane
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])


# The caller's code that runs during an update (a weight-decay mask when a layout is built, an
# lr schedule) shrinks a storage the one-pass check has not seen yet, or has already passed.
CALLBACK_SHRINKS = {
    "mask-shrinks-a-grad": """
p = {"w": torch.randn(1 << 20)}; g = {"w": torch.randn(1 << 20)}
armed = False
def mask(name, leaf):
    if armed: g["w"].untyped_storage().resize_(4)
    return True
opt = mt.optim.adam(lr=0.1, mask=mask); state = opt.init(p); armed = True
new, state = opt.update(g, state, p, donate=DONATE)
""",
    "schedule-shrinks-a-param": """
p = {"w": torch.randn(1 << 22)}; g = {"w": torch.randn(1 << 22)}
armed = False
def lr(count):
    if armed: p["w"].untyped_storage().resize_(4)
    return 0.1
opt = mt.optim.sgd(lr=lr, momentum=0.9); state = opt.init(p); armed = True
new, state = opt.update(g, state, p, donate=DONATE)
""",
}


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("case", CALLBACK_SHRINKS)
def test_a_callback_that_shrinks_a_storage_is_refused_not_a_crash(case, donate):
    code = "import torch, minitrain as mt\n" + CALLBACK_SHRINKS[case].replace(
        "DONATE", str(donate))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "MINITRAIN_TYPECHECK": "0"})
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])  # not a signal
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and "'w'" in last or "does not match" in last, last


@pytest.mark.parametrize("factory, kwargs", [
    (mt.optim.sgd, dict(lr=1.0, momentum=0.5)), (mt.optim.adam, dict(lr=0.1)),
    (mt.optim.adagrad, dict(lr=0.1)), (mt.optim.rmsprop, dict(lr=0.1)),
    (mt.optim.lion, dict(lr=0.1)), (mt.optim.nadam, dict(lr=0.1)),
], ids=["sgd", "adam", "adagrad", "rmsprop", "lion", "nadam"])
@pytest.mark.parametrize("where", ["grad", "state"])
def test_a_negative_view_is_read_as_its_values(factory, kwargs, where):
    """torch._neg_view holds -t in memory with the negative bit set: the kernels must not read
    that memory raw (the fast path copies it into its param's layout first)."""
    params = {"w": torch.randn(300), "b": torch.randn(7)}
    grads = {"w": torch.randn(300), "b": torch.randn(7)}
    opt = factory(**kwargs)
    state = opt.update(grads, opt.init(params), params)[1]  # non-zero state
    odd_grads, odd_state = grads, state
    if where == "grad":
        odd_grads = dict(grads, w=torch._neg_view(-grads["w"]))
        assert odd_grads["w"].is_neg() and torch.equal(odd_grads["w"], grads["w"])
    else:
        leaves = mt.tree.leaves(state)
        big = next(t for t in leaves if t.shape == (300,))
        replaced = [torch._neg_view(-t) if t is big else t for t in leaves]
        odd_state = mt.tree.unflatten(mt.tree.structure(state), replaced)
    want, want_state = opt.update(grads, state, params)
    got, got_state = opt.update(odd_grads, odd_state, params)
    # The aliases copy such a leaf and run their kernel: the same bits. The rest of the
    # family runs its rule op by op on them (torch resolves the bit), which rounds apart from
    # its kernel in the last bit.
    alias = factory in (mt.optim.sgd, mt.optim.adam, mt.optim.adagrad, mt.optim.rmsprop)
    for a, b in zip(mt.tree.leaves((want, want_state)), mt.tree.leaves((got, got_state)),
                    strict=True):
        if alias:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # The clip's norm of such grads is torch's (float32 sums), not the kernel's pass.
    torch.testing.assert_close(mt.optim.clip_by_global_norm(odd_grads, 1.0)[1],
                               mt.optim.clip_by_global_norm(grads, 1.0)[1], rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("impl", ["plain", "fast", "auto"])
def test_a_schedule_runs_once_per_update_and_the_leaves_are_checked_once(impl, monkeypatch):
    """The schedule is the caller's code: it runs before the one-pass check, so that check is
    the last thing before a kernel and never has to run a second time."""
    from minitrain.optim.kernels import checks as _safety

    checks = []
    original = _safety.kernel_ready

    def counted(*args):
        checks.append(1)
        return original(*args)

    monkeypatch.setattr(base, "kernel_ready", counted)
    counts = []

    def lr(count):
        counts.append(int(count))
        return 0.1

    params, grads = _data(2)
    _run(mt.optim.sgd(lr=lr, momentum=0.9, impl=impl), params, grads, donate=False)
    assert counts == [0, 0, 1, 2]  # init's lr, then one call per update
    assert len(checks) == len(grads)


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_a_kernel_that_fails_leaves_the_state_it_was_given(monkeypatch, donate):
    """The new count and lr are made before the kernel runs; a kernel that fails before it
    writes (out of memory: status -2) raises, and the state passed in keeps its count and its
    params. (A donated update of several batches that fails in a later one has written the
    earlier ones: donated buffers are not to be read after the call, as JAX's.)"""
    opt = mt.optim.adamw(lr=1e-3)
    params, grads = {"w": torch.randn(1 << 16)}, {"w": torch.randn(1 << 16)}
    state = opt.init(params)
    params, state = opt.update(grads, state, params, donate=donate)
    before = params["w"].clone()
    library = streaming._library()

    class Failing:
        def __getattr__(self, name):
            if name == "minitrain_update":
                return lambda *arguments: -2
            return getattr(library, name)

    monkeypatch.setattr(streaming, "_library", Failing)
    with pytest.raises(RuntimeError, match="failed with status -2"):
        opt.update(grads, state, params, donate=donate)
    assert int(state.count) == 1 and torch.equal(params["w"], before)


class _Key(str):
    """A dict key whose hashing is the caller's code (it could resize a storage)."""

    def __hash__(self):
        _EVENTS.append("caller")
        return str.__hash__(self)


class _Pair(NamedTuple):
    w: torch.Tensor
    b: torch.Tensor


class _WatchedPair(_Pair):
    """A params node whose construction is the caller's code."""

    def __new__(cls, *args, **kwargs):
        _EVENTS.append("caller")
        return super().__new__(cls, *args, **kwargs)


_EVENTS: list[str] = []


def _record_kernels(monkeypatch):
    original = streaming.prepare

    def prepare(*args, **kwargs):
        results, launch = original(*args, **kwargs)
        _EVENTS.append("prepared")

        def recorded():
            _EVENTS.append("launched")
            launch()

        return results, recorded

    monkeypatch.setattr(streaming, "prepare", prepare)


@needs_kernels
@pytest.mark.parametrize("swept", [True, False], ids=["large", "small"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("kind", ["dict", "str-subclass key", "namedtuple subclass",
                                  "state subclass"])
def test_no_callers_code_runs_between_a_kernels_pointers_and_its_launch(monkeypatch, kind,
                                                                        donate, swept):
    """The new params and state of an update large enough to sweep the caches are built before
    the kernel where building them runs none of the caller's code; where it would (a key's
    ``__hash__``, a node's constructor, a state's ``_replace``), and for small updates, the
    kernel runs first. Either way the result equals torch's ops."""
    if swept:  # these params stand for ones of SWEPT_BYTES or more
        monkeypatch.setattr(_layout, "SWEPT_BYTES", 0)
    original_unflatten = _flat.unflatten
    monkeypatch.setattr(_flat, "unflatten",
                        lambda *a: _EVENTS.append("built") or original_unflatten(*a))
    w, b = torch.randn(6, 5), torch.randn(5)
    tree = {
        "dict": lambda w, b: {"w": w, "b": b},
        "str-subclass key": lambda w, b: {"w": w, _Key("b"): b},
        "namedtuple subclass": _WatchedPair,
        "state subclass": lambda w, b: {"w": w, "b": b},
    }[kind]
    opt = mt.optim.adamw(lr=0.1, weight_decay=0.1)
    params, grads = tree(w.clone(), b.clone()), tree(torch.ones(6, 5), torch.full((5,), 2.0))
    state = opt.init(params)
    if kind == "state subclass":
        own = type(state)

        class WatchedState(own):
            def _replace(self, **fields):  # the caller's code
                _EVENTS.append("caller")
                return own._replace(self, **fields)

        state = WatchedState(*state)
    want, _ = mt.optim.adamw(lr=0.1, weight_decay=0.1, impl="plain").update(
        grads, state, tree(w.clone(), b.clone()))
    _record_kernels(monkeypatch)
    _EVENTS.clear()
    got, new_state = opt.update(grads, state, params, donate=donate)
    assert "prepared" in _EVENTS and "launched" in _EVENTS
    between = _EVENTS[_EVENTS.index("prepared"):_EVENTS.index("launched")]
    assert "caller" not in between, _EVENTS
    after = _EVENTS[_EVENTS.index("launched"):]
    if kind != "dict":
        assert "caller" in after  # the rebuild, after the kernel
    first = swept and kind == "dict"  # built before the kernel
    assert ("built" in between) == first and ("built" in after) != first, _EVENTS
    for name in ("w", "b"):
        got_leaf = got[name] if isinstance(got, dict) else getattr(got, name)
        want_leaf = want[name] if isinstance(want, dict) else getattr(want, name)
        torch.testing.assert_close(got_leaf, want_leaf)
    assert int(new_state.count) == 1
