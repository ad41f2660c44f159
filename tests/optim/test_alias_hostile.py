"""Hostile inputs to every optimizer of the registry (``tests/optim/conftest.py``): strided,
expanded and overlapping grads and state; params, grads and state that share memory (tied
leaves, slices of one buffer, tensors over one memory with storages of their own, a grad that is
a state buffer); grads of another dtype, shape or structure; states of another model, dtype or
optimizer; NaN, None, sparse and number grads; params that are not real floating point;
hand-edited counts; schedules that return what no lr is; storages shrunk by hand.

Each gives the right result (the update of independent, dense clones; the reference's, for NaN)
or a one-line ``ValueError`` naming the leaf or argument, never a crash or wrong numbers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import minitrain as mt
from minitrain.optim.kernels import streaming
from tests.optim.conftest import (
    ATOL,
    BY_NAME,
    KERNEL_ROUNDING,
    OPTIMIZERS,
    ROUNDING,
    RTOL,
    SCHEDULABLE,
    Entry,
    assert_equal,
    clones,
    make_grads,
    make_params,
    run,
    run_reference,
)
from tests.optim_db_harness import named_buffers

ids = str


def one_line_naming(error: BaseException, leaf: str) -> str:
    """The error's message, checked to be one line that names ``leaf`` (as 'w' or ['w'])."""
    message = str(error)
    assert "\n" not in message, message
    assert re.search(rf"(?<![\w.]){re.escape(leaf)}(?![\w.])", message), message
    return message


# --------------------------------------------------------------------------------------------
# Views and memory shared between inputs


def strided(kind: str, like: torch.Tensor, seed: int) -> torch.Tensor:
    """A grad of ``like``'s shape that is a view: transposed, sliced, expanded (what autograd
    gives for ``0.0 * p.sum()``) or with overlapping rows."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = like.shape
    if kind == "transposed":
        return torch.randn(cols, rows, generator=g).t()
    if kind == "sliced":
        return torch.randn(rows, 2 * cols, generator=g)[:, ::2]
    if kind == "expanded":
        return torch.randn((), generator=g).expand(rows, cols)
    return torch.randn(rows + cols, generator=g).as_strided((rows, cols), (1, 1))


@pytest.mark.parametrize("kind", ["transposed", "sliced", "expanded", "overlapping"])
@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_strided_grad_updates_as_a_contiguous_one(entry, kind):
    opt = entry.make()
    params = make_params(entry)
    params, state = run(opt, params, make_grads(params, 1))
    grads = make_grads(params, 1, seed=2)[0]
    grads["w"] = strided(kind, params["w"], seed=3)
    for donate in (False, True):
        got = opt.update(grads, clones(state), clones(params), donate=donate)
        want = opt.update(clones(grads), state, params)
        assert_equal(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_strided_state_updates_as_a_contiguous_one(entry):
    opt = entry.make()
    params = make_params(entry)
    params, state = run(opt, params, make_grads(params, 1))
    transposed = mt.tree.map(lambda t: t.t().contiguous().t() if isinstance(t, torch.Tensor)
                             and t.dim() == 2 else t, state)
    grads = make_grads(params, 1, seed=2)[0]
    assert_equal(opt.update(grads, transposed, params), opt.update(grads, state, params),
                 rtol=RTOL, atol=ATOL)


SHAPE = (16, 8)
N = SHAPE[0] * SHAPE[1]


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape or SHAPE, generator=torch.Generator().manual_seed(seed))


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory with a storage object of its own (``torch.from_dlpack``)."""
    other = torch.from_dlpack(t)
    assert other.data_ptr() == t.data_ptr()
    return other


def buffer_paths(state: Any, leaf: str) -> list[str]:
    """Paths of the state's tensors shaped like the params that belong to ``leaf``."""
    return [path for path, t in mt.tree.named_leaves(state)
            if path.endswith(f".{leaf}") and isinstance(t, torch.Tensor) and t.shape == SHAPE]


def keeps_buffers(entry: Entry) -> bool:
    """Whether the entry keeps a buffer like each param (SGD without momentum keeps none,
    Adafactor keeps a row and a column)."""
    return bool(buffer_paths(entry.make().init({"a": torch.zeros(SHAPE)}), "a"))


def aliased(case: str, entry: Entry) -> tuple[dict, dict, Any]:
    """Params, grads and a state (after one update on clones) whose tensors share memory."""
    params, grads = {"a": randn(0), "b": randn(1)}, {"a": randn(2), "b": randn(3)}
    if case == "tied":  # one tensor as two leaves (tied weights)
        params["b"] = params["a"]
    elif case == "tied through own storages":
        params["b"] = own_storage(params["a"])
    elif case in ("overlapping slices", "overlapping slices, own storages"):
        flat = randn(4, 3 * N // 2)
        view = own_storage if "own" in case else (lambda t: t)
        params = {"a": view(flat[:N]).view(SHAPE), "b": view(flat[N // 2:]).view(SHAPE)}
    elif case == "slices of one flat buffer":  # FSDP's flat params and grads, at an odd offset
        flat_p, flat_g = randn(4, 3 + 2 * N), randn(5, 3 + 2 * N)
        params = {"a": flat_p[3:3 + N].view(SHAPE), "b": flat_p[3 + N:].view(SHAPE)}
        grads = {"a": flat_g[3:3 + N].view(SHAPE), "b": flat_g[3:3 + N].view(SHAPE)}
    elif case == "grads are the other params":
        grads = {"a": own_storage(params["b"]), "b": own_storage(params["a"])}
    elif case == "a grad just before its param":  # read after the param's first writes
        flat = randn(4, N + 8)
        params["a"] = own_storage(flat[8:]).view(SHAPE)
        grads["a"] = own_storage(flat[:N]).view(SHAPE)
    elif case == "an expanded param":  # elements that share an address
        params["a"] = randn(4, SHAPE[1]).expand(SHAPE)
    elif case == "an interleaved param":
        params["a"] = randn(4, SHAPE[0] + SHAPE[1] - 1).as_strided(SHAPE, (1, 1))
    opt = entry.make()
    state = opt.update({"a": randn(6), "b": randn(7)}, opt.init(clones(params)),
                       clones(params))[1]
    named = mt.tree.named_leaves(state)
    if case == "a state leaf is another param":  # edited by hand
        edited = set(buffer_paths(state, "b")[:1])
        state = mt.tree.unflatten(mt.tree.structure(state), [
            own_storage(params["a"]).abs_() if path in edited else t for path, t in named])
    elif case == "a state leaf is its param":
        params["a"].abs_()  # any moment may hold it
        edited = set(buffer_paths(state, "a")[:1])
        state = mt.tree.unflatten(mt.tree.structure(state), [
            params["a"] if path in edited else t for path, t in named])
    elif case == "a grad is its state leaf":
        grads["a"] = dict(named)[buffer_paths(state, "a")[0]]
    elif case == "one tensor as every buffer":
        one = randn(8).abs() + 0.1  # any moment may hold it
        shared = set(buffer_paths(state, "a") + buffer_paths(state, "b"))
        state = mt.tree.unflatten(mt.tree.structure(state),
                                  [one if path in shared else t for path, t in named])
    return params, grads, state


ALIASED = {  # case: whether the update of independent clones must be matched to the bit
    "tied": True, "tied through own storages": True, "overlapping slices": True,
    "overlapping slices, own storages": True, "slices of one flat buffer": True,
    "grads are the other params": True, "a grad just before its param": True,
    "an expanded param": False, "an interleaved param": False,  # clones are dense
    "a state leaf is another param": True, "a state leaf is its param": True,
    "a grad is its state leaf": True, "one tensor as every buffer": True,
}
STATEFUL = {"a state leaf is another param", "a state leaf is its param",
            "a grad is its state leaf", "one tensor as every buffer"}
# Each alias once, and the variants that keep more buffers (momentum, max_exp_avg_sq, grad_avg).
SHARED_MEMORY = [entry for i, entry in enumerate(OPTIMIZERS)
                 if entry.alias not in {e.alias for e in OPTIMIZERS[:i]}
                 or entry.name in ("sgd-momentum", "adam-amsgrad", "rmsprop-centered-momentum")]
ALIASED_CASES = [pytest.param(entry, case, id=f"{entry}-{case}") for entry in SHARED_MEMORY
                 for case in ALIASED if case not in STATEFUL or keeps_buffers(entry)]


def check_as_clones(entry: Entry, params: Any, grads: Any, state: Any, exact: bool) -> None:
    """A pure update gives what it gives on independent clones and writes no input; a donated
    one gives the pure update's numbers (in place only where that is well defined)."""
    # Exact cases still compare a chain with a kernel where aliasing sends one of them to the
    # chain: the kernels order their float32 ops otherwise (KERNEL_ROUNDING).
    tolerance = KERNEL_ROUNDING if exact else dict(rtol=RTOL, atol=ATOL)
    expected = entry.make().update(clones(grads), clones(state), clones(params))
    inputs = (grads, state, params)
    before = clones(inputs)
    assert_equal(entry.make().update(grads, state, params), expected, **tolerance)
    assert_equal(inputs, before)
    assert_equal(entry.make().update(grads, state, params, donate=True), expected, **tolerance)


@pytest.mark.parametrize(("entry", "case"), ALIASED_CASES)
def test_inputs_that_share_memory_update_as_independent_clones(entry, case):
    check_as_clones(entry, *aliased(case, entry), exact=ALIASED[case])


@settings(max_examples=25, deadline=None)
@given(entry=st.sampled_from(SHARED_MEMORY), offsets=st.tuples(st.integers(0, N),
                                                              st.integers(0, N)),
       grad_at=st.one_of(st.none(), st.integers(0, N)), own=st.booleans())
def test_hypothesis_params_over_one_buffer_update_as_independent_clones(entry, offsets, grad_at,
                                                                        own):
    flat = randn(0, 2 * N)
    view = own_storage if own else (lambda t: t)
    params = {key: view(flat[at:at + N]).view(SHAPE) for key, at in zip("ab", offsets,
                                                                       strict=True)}
    grads = {"a": randn(1), "b": randn(2)}
    if grad_at is not None:  # a grad over the params' buffer too
        grads["a"] = view(flat[grad_at:grad_at + N]).view(SHAPE)
    opt = entry.make()
    state = opt.update({"a": randn(6), "b": randn(7)}, opt.init(clones(params)),
                       clones(params))[1]
    check_as_clones(entry, params, grads, state, exact=True)


# --------------------------------------------------------------------------------------------
# Trees and values that do not fit


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_grad_of_another_dtype_is_cast_or_refused_naming_the_leaf(entry, dtype):
    opt = entry.make()
    params = make_params(entry)
    grads = make_grads(params, 1)[0]
    other = {**grads, "w": grads["w"].to(dtype)}
    try:
        got = opt.update(other, opt.init(params), params)
    except ValueError as error:
        one_line_naming(error, "w")
        return
    cast = {**grads, "w": other["w"].float()}
    assert_equal(got, opt.update(cast, opt.init(params), params), **ROUNDING)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_grad_of_another_shape_is_refused_naming_the_leaf(entry):
    opt = entry.make()
    params = make_params(entry)
    grads = {**make_grads(params, 1)[0], "w": torch.ones(params["w"].shape[::-1])}
    with pytest.raises(ValueError) as error:
        opt.update(grads, opt.init(params), params)
    one_line_naming(error.value, "w")


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_grads_of_another_structure_are_refused_in_one_line(entry):
    opt = entry.make()
    params = make_params(entry)
    grads = make_grads(params, 1)[0]
    del grads["t"]
    with pytest.raises(ValueError) as error:
        opt.update(grads, opt.init(params), params)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_state_of_another_model_is_refused_naming_the_leaf(entry):
    """A state made for params whose 'w' is larger: refused, or (keeping no state like the
    params) the update its own state gives."""
    opt = entry.make()
    params = make_params(entry)
    other = {**params, "w": torch.zeros(8, 6)}
    grads = make_grads(params, 1)[0]
    try:
        got = opt.update(grads, opt.init(other), params)
    except ValueError as error:
        one_line_naming(error, "w")
        return
    assert not named_buffers(opt.init(params)) or not any(
        mt.tree.leaves(tree) for tree in named_buffers(opt.init(params)).values())
    assert_equal(got, opt.update(grads, opt.init(params), params))


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_state_of_another_dtype_is_refused_naming_the_leaf(entry):
    opt = entry.make()
    params = make_params(entry)
    state = mt.tree.map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.dim() and
                        t.is_floating_point() else t, opt.init(params))
    grads = make_grads(params, 1)[0]
    try:
        got = opt.update(grads, state, params)
    except ValueError as error:
        one_line_naming(error, "w")
        return
    assert_equal(got, opt.update(grads, opt.init(params), params))


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_state_of_another_optimizer_is_refused_in_one_line(entry, request):
    if entry.name in ("sgd", "nadam", "nadam-decoupled"):
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=(
            "a state whose transformations' states line up (EmptyState, the lr's state) passes "
            "for this chain's")))
    other = BY_NAME["lion" if entry.alias != "lion" else "adam"]
    params = make_params(entry)
    with pytest.raises(ValueError) as error:
        entry.make().update(make_grads(params, 1)[0], other.make().init(params), params)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_nan_grad_spoils_its_own_leaf_only_as_in_the_reference(entry):
    opt = entry.make()
    params = make_params(entry)
    grads = make_grads(params, 1)[0]
    spoiled = clones(grads)
    spoiled["w"][0, 0] = float("nan")
    got, _ = opt.update(spoiled, opt.init(params), params)
    clean, _ = opt.update(grads, opt.init(params), params)
    assert_equal({k: v for k, v in got.items() if k != "w"},
                 {k: v for k, v in clean.items() if k != "w"})
    if entry.reference is not None:
        (want,), _ = run_reference(entry, params, [spoiled])
        for a, b in zip(mt.tree.leaves(got), want, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)


NOT_TENSORS = {
    "None": (None, r"the grad of 'w' is None"),
    "number": (2.0, r"'w'"),
    "sparse": ("sparse", r"the grad of 'w' is a torch\.sparse"),
}


@pytest.mark.parametrize("grad", NOT_TENSORS)
@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_grad_that_is_no_dense_tensor_is_refused_naming_the_leaf(entry, grad):
    opt = entry.make()
    params = make_params(entry)
    grads = make_grads(params, 1)[0]
    value, pattern = NOT_TENSORS[grad]
    grads["w"] = grads["w"].to_sparse() if value == "sparse" else value
    with pytest.raises(ValueError, match=pattern) as error:
        opt.update(grads, opt.init(params), params)
    one_line_naming(error.value, "w")


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64], ids=str)
@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_params_that_are_not_real_floating_point_are_refused_naming_them(entry, dtype):
    params = {**make_params(entry), "w": torch.ones(4, 3, dtype=dtype)}
    with pytest.raises(ValueError) as error:
        entry.make().init(params)
    one_line_naming(error.value, "w")


def with_counts(state: Any, count: Any) -> Any:
    """``state`` with every ``count`` field, at any depth, replaced by ``count``."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        fields = {f: with_counts(getattr(state, f), count) for f in state._fields}
        if "count" in fields:
            fields["count"] = count
        return type(state)(**fields)
    if isinstance(state, tuple | list):
        return type(state)(with_counts(s, count) for s in state)
    if isinstance(state, dict):
        return {k: with_counts(v, count) for k, v in state.items()}
    return state


def count_fields(state: Any) -> list[Any]:
    """Every ``count`` field of ``state``, at any depth."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        own = [state.count] if "count" in state._fields else []
        return own + [c for f in state._fields if f != "count"
                      for c in count_fields(getattr(state, f))]
    if isinstance(state, tuple | list):
        return [c for s in state for c in count_fields(s)]
    if isinstance(state, dict):
        return [c for s in state.values() for c in count_fields(s)]
    return []


COUNTS = {
    "int": (3, "not a one-element tensor"),
    "meta": (torch.zeros((), dtype=torch.int64, device="meta"), "not a one-element tensor"),
    "two-elements": (torch.tensor([1, 2]), "not a one-element tensor"),
    "negative": (torch.tensor(-5), "a count of updates is >= 0"),
}


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_hand_edited_count_is_refused_naming_it(entry, count, request):
    if entry.name == "sgd":
        request.node.add_marker(pytest.mark.xfail(strict=False, reason=(
            "plain SGD's only count is its learning rate's, which a constant lr never reads")))
    value, words = COUNTS[count]
    opt = entry.make()
    params = make_params(entry)
    with pytest.raises(ValueError, match=f"state.count is .*{words}") as error:
        opt.update(make_grads(params, 1)[0], with_counts(opt.init(params), value), params)
    assert "\n" not in str(error.value)


BAD_LRS = {"two-elements": torch.tensor([0.1, 0.2]), "None": None, "negative": -1.0}


@pytest.mark.parametrize("value", BAD_LRS)
@pytest.mark.parametrize("entry", SCHEDULABLE, ids=ids)
def test_a_schedules_bad_value_is_refused_naming_the_schedule(entry, value):
    opt = entry.make(lr=lambda step: BAD_LRS[value] if step > 0 else entry.kwargs["lr"])
    params = make_params(entry)
    grads = make_grads(params, 1)[0]
    with pytest.raises(ValueError, match=r"lr \(from the schedule\)") as error:
        run(opt, params, [grads] * 3)
    assert "\n" not in str(error.value)


SHRINK = """
import json, torch
import minitrain as mt
from tests.optim.conftest import OPTIMIZERS
from tests.optim_db_harness import named_buffers
for entry in OPTIMIZERS:
    for victim in ("param", "grad", "state"):
        opt = entry.make()
        params = {"w": torch.randn(64, 32), "b": torch.randn(32, 64)}
        grads = mt.tree.map(torch.randn_like, params)
        params, state = opt.update(grads, opt.init(params), params)
        buffers = [t for tree in named_buffers(state).values() for t in mt.tree.leaves(tree)]
        if victim == "state" and not buffers:
            continue
        print(json.dumps([entry.name, victim]), flush=True)
        if victim == "state":
            tensor = max(buffers, key=lambda t: t.numel())
        else:
            tensor = params["w"] if victim == "param" else grads["w"]
        tensor.untyped_storage().resize_(0)
        try:
            opt.update(grads, state, params)
        except Exception as error:
            print(json.dumps(f"{type(error).__name__}: {error}"), flush=True)
        else:
            print(json.dumps("no error"), flush=True)
"""


def test_a_storage_shrunk_by_hand_is_refused_naming_the_leaf():
    """A param, grad or state buffer whose storage was resized to 0 bytes (even torch's own
    elementwise ops read past the end of such a tensor): refused in one line naming the leaf,
    never a crash. In a child process, where a crash shows as a signal."""
    done = subprocess.run([sys.executable, "-c", SHRINK], capture_output=True, text=True,
                          timeout=600)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    ended = f"killed by signal {-done.returncode}" if done.returncode < 0 else \
        f"exit status {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
    assert done.returncode == 0, f"{lines[-1]} (optimizer, leaf shrunk): {ended}"
    cases = list(zip(lines[::2], lines[1::2], strict=True))
    assert {name for (name, _), _ in cases} == set(BY_NAME)
    wrong = [(case, message) for case, message in cases
             if not message.startswith("ValueError: ") or "\n" in message
             or not re.search(r"(?<![\w.])w(?![\w.])", message) or "storage" not in message]
    assert not wrong


# --------------------------------------------------------------------------------------------
# Hyperparameters whose conversion runs the caller's code (which frees a storage an update is
# about to read): read before the inputs are checked


needs_kernels = pytest.mark.skipif(
    not streaming.available(), reason="no C compiler: the streaming kernels cannot be built"
)

FREED_MID_UPDATE = """
import json, torch
import minitrain as mt

BIG = 1 << 16  # elements: a kernel takes the leaf


class Shrinking(float):  # a float whose __float__, once armed, frees a param's storage
    victim = None

    def __float__(self):
        victim, type(self).victim = type(self).victim, None
        if victim is not None:
            victim.untyped_storage().resize_(0)
        return super().__float__()


class Beta(torch.Tensor):  # a beta whose torch function, once armed, frees a param's storage
    victim = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        victim, Beta.victim = Beta.victim, None
        if victim is not None:
            victim.untyped_storage().resize_(0)
        return super().__torch_function__(func, types, args, kwargs or {})


def betas():
    return (torch.tensor(0.9).as_subclass(Beta), torch.tensor(0.999).as_subclass(Beta))


CASES = {  # name: (optimizer, the armed class, the grad)
    "adamw-weight_decay-expanded-grad": (lambda: mt.optim.adamw(
        lr=1e-3, weight_decay=Shrinking(0.1)), Shrinking, lambda: torch.ones(1).expand(BIG)),
    "adamw-weight_decay": (lambda: mt.optim.adamw(lr=1e-3, weight_decay=Shrinking(0.1)),
                           Shrinking, lambda: torch.ones(BIG)),
    "nadam-weight_decay": (lambda: mt.optim.nadam(lr=1e-3, weight_decay=Shrinking(0.1)),
                           Shrinking, lambda: torch.ones(BIG)),
    "adamw-betas": (lambda: mt.optim.adamw(lr=1e-3, betas=betas()), Beta,
                    lambda: torch.ones(BIG)),
}
for name, (make, armed, grad) in CASES.items():
    for donate in (False, True):
        print(json.dumps([name, donate]), flush=True)
        params = {"w": torch.ones(BIG)}
        opt = make()
        state = opt.init(params)
        armed.victim = params["w"]
        try:
            opt.update({"w": grad()}, state, params, donate=donate)
        except Exception as error:
            print(json.dumps(f"{type(error).__name__}: {error}"), flush=True)
        else:
            print(json.dumps("no error"), flush=True)
        finally:
            armed.victim = None
"""


@needs_kernels
def test_a_hyperparameter_that_frees_a_param_mid_update_is_refused_in_one_line():
    """A float subclass (its ``__float__``) or a tensor-subclass beta (its torch function) frees
    the param's storage when the update reads it: refused as resized, never a crash. In a child
    process, where a crash shows as a signal."""
    done = subprocess.run([sys.executable, "-c", FREED_MID_UPDATE], capture_output=True,
                          text=True, timeout=600)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    ended = f"killed by signal {-done.returncode}" if done.returncode < 0 else \
        f"exit status {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
    assert done.returncode == 0, f"{lines[-1]} (case, donated): {ended}"
    cases = list(zip(lines[::2], lines[1::2], strict=True))
    assert len(cases) == 8
    wrong = [(case, message) for case, message in cases
             if not message.startswith("ValueError: ") or "resized" not in message
             or "\n" in message]
    assert not wrong


class _CountingCount(torch.Tensor):
    """A count of a tensor subclass that counts the reads of its value (the caller's code)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__int__", "__index__", "item"):
            _CountingCount.reads += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "differentiable"])
def test_an_update_reads_a_subclass_count_once_before_its_checks(monkeypatch, requires_grad):
    """Each read runs the caller's code; a second read of one count, after the leaves were
    checked, could free a storage an op is about to read."""
    opt = mt.optim.adamw(lr=1e-3)
    params = {"w": torch.randn(64, requires_grad=requires_grad)}
    state = opt.init(params)
    fields = len(count_fields(state))
    state = with_counts(state, torch.tensor(0).as_subclass(_CountingCount))
    monkeypatch.setattr(_CountingCount, "reads", 0)
    with torch.set_grad_enabled(requires_grad):
        opt.update({"w": torch.randn(64)}, state, params)
    assert 1 <= _CountingCount.reads <= fields


class _Watching(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_a_mode_the_callers_lr_enters_sees_the_rest_of_the_update(donate):
    """A tensor-subclass lr whose code enters a torch function mode mid-update: the mode sees
    the ops made after it (no kernel runs past it), and the numbers are those of a plain lr."""
    armed, entered = [], []

    class EnteringLr(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if armed and not entered:  # the update's first use of the lr
                entered.append(_Watching())
                entered[0].__enter__()
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    params, grads = {"w": torch.randn(300)}, {"w": torch.randn(300)}
    want, _ = mt.optim.adamw(lr=1e-3).update(grads, mt.optim.adamw(lr=1e-3).init(params),
                                              {"w": params["w"].clone()})
    opt = mt.optim.adamw(lr=torch.tensor(1e-3).as_subclass(EnteringLr))
    state = opt.init(params)
    armed.append(1)  # from here on: inside the update
    try:
        got, _ = opt.update(grads, state, params, donate=donate)
    finally:
        for mode in entered:
            mode.__exit__(None, None, None)
    assert entered and entered[0].calls > 0
    torch.testing.assert_close(got["w"], want["w"])
