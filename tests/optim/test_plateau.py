"""``mt.optim.reduce_on_plateau`` against torch's ``ReduceLROnPlateau``: alone, in chains and
wrappers fed ``value=``, under vmap, and given hostile metrics, settings and states.

The reference is ``torch.optim.lr_scheduler.ReduceLROnPlateau`` on a real ``torch.optim.SGD``,
stepped as a training loop steps it (``optimizer.step()`` then ``scheduler.step(metric)``). Its
lr, ``best``, ``num_bad_epochs``, ``cooldown_counter`` and ``last_epoch`` are compared exactly
with the state's fields: both take the same float64 operations in the same order.

Tests named ``test_regression_guard_...`` pass on the code before this file's fixes and pin
behaviour this review found correct; every other test fails on that code.
"""

import decimal
import json
import math
import os
import subprocess
import sys
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim import lr_scheduler

import minitrain as mt

reduce_on_plateau = mt.optim.reduce_on_plateau

plateau = mt.optim.reduce_on_plateau
FIELDS = ("lr", "best", "num_bad_epochs", "cooldown_counter", "count")


def torch_states(metrics, lr, edit=None, **kwargs):
    """torch's ``(lr, best, num_bad_epochs, cooldown_counter, last_epoch)`` after each step;
    ``edit(scheduler)`` edits it by hand first."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    scheduler = lr_scheduler.ReduceLROnPlateau(optimizer, **kwargs)
    if edit is not None:
        edit(scheduler)
    states = []
    for metric in metrics:
        optimizer.step()
        scheduler.step(metric)
        states.append((float(optimizer.param_groups[0]["lr"]), float(scheduler.best),
                       scheduler.num_bad_epochs, scheduler.cooldown_counter,
                       scheduler.last_epoch))
    return states


def our_states(metrics, lr, state=None, updates=None, **kwargs):
    """Ours, as ``torch_states``; ``state`` (from the transformation's init unless given) may
    be edited by hand. Each field comes back in init's dtype and shape."""
    tx = plateau(lr=lr, **kwargs)
    updates = {"w": torch.ones(2, dtype=torch.float64)} if updates is None else updates
    state = tx.init(updates) if state is None else state
    states = []
    for metric in metrics:
        _, state = tx.update(updates, state, value=metric)
        for name, field in zip(FIELDS, state, strict=True):
            expected = torch.float64 if name in ("lr", "best") else torch.int64
            assert field.dtype == expected and field.shape == (), (name, field)
        states.append((float(state.lr), float(state.best), int(state.num_bad_epochs),
                       int(state.cooldown_counter), int(state.count)))
    return states


def assert_one_line_error(build, *words):
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message


LOSSES = [1.0, 0.9, 0.95, 0.97, 0.99, 0.5, 0.6, 0.7, 0.8, 0.85]
SETTINGS = {"factor": 0.5, "patience": 1, "threshold": 0.05, "cooldown": 1}


# ------------------------------------------------------------------------------------------------
# Updates: integer, bool and non-tensor leaves


@pytest.mark.parametrize("value", [None, 1.0], ids=["value-omitted", "value-given"])
def test_integer_and_bool_updates_are_promoted_as_torch_promotes(value):
    """An int update came back truncated (``[4, 6] * 0.25 -> [0, 0]``) and a bool one as
    ``True``; now each is promoted as ``int_tensor * 0.25`` is in torch (optax's
    ``tree_scale`` promotes in JAX), to the default float dtype."""
    tx = plateau(lr=0.5)
    updates = {"i": torch.tensor([4, 6]), "b": torch.tensor([True, False]),
               "u8": torch.tensor([3], dtype=torch.uint8)}
    state = tx.init(updates)._replace(lr=torch.tensor(0.125, dtype=torch.float64))
    scaled, _ = tx.update(updates, state, value=value)
    for name, leaf in updates.items():
        expected = leaf * 0.25
        assert scaled[name].dtype == expected.dtype == torch.get_default_dtype(), name
        assert torch.equal(scaled[name], expected), (name, scaled[name])


def test_regression_guard_float_and_complex_updates_keep_their_dtype():
    tx = plateau(lr=2.0)
    updates = {dtype: torch.full((2,), 3.0, dtype=dtype) for dtype in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64)}
    updates["0-d"] = torch.tensor(3.0)
    state = tx.init(updates)._replace(lr=torch.tensor(0.5, dtype=torch.float64))
    scaled, _ = tx.update(updates, state)
    for name, leaf in updates.items():
        assert scaled[name].dtype == leaf.dtype and scaled[name].shape == leaf.shape, name
        assert torch.equal(scaled[name], leaf * 0.25), name


@pytest.mark.parametrize("leaf", [3.0, 2, None, np.float32(1.0)],
                         ids=["float", "int", "None", "np.float32"])
def test_a_number_leaf_is_a_one_line_error_naming_it(leaf):
    """A float leaf raised ``AttributeError: 'float' object has no attribute 'dtype'`` from
    update (init took it). Now init and update refuse it by name, as the optimizers refuse a
    non-tensor param; every other leaf is a tensor, as in torch."""
    tx = plateau()
    tree = {"w": torch.ones(1), "a": leaf}
    # a None update is the grad of a param the loss does not use, as for every optimizer
    in_init = ("param",) if leaf is None else ("params", "torch.tensor")
    in_update = ("grad",) if leaf is None else ("updates", "torch.tensor")
    assert_one_line_error(lambda: tx.init(tree), "'a'", *in_init)
    state = tx.init({"w": torch.ones(1), "a": torch.ones(1)})
    for value in (None, 1.0):
        assert_one_line_error(lambda v=value: tx.update(tree, state, value=v), "'a'", *in_update)
    assert_one_line_error(lambda: tx.init(3.0), "params", "torch.tensor")


# ------------------------------------------------------------------------------------------------
# Metrics


@pytest.mark.parametrize("kind", [
    np.array, decimal.Decimal, lambda v: torch.tensor([v]).to_sparse(),
], ids=["numpy-0d", "Decimal", "sparse-tensor"])
def test_any_metric_torch_takes_as_a_float_is_taken(kind):
    """torch takes ``float(metric)``: a 0-d numpy array (what ``np.mean`` of an array gives
    after some ops), a Decimal and a sparse one-element tensor. They were refused (the sparse
    tensor by a RuntimeError from reshape)."""
    metrics = [kind(str(v)) if kind is decimal.Decimal else kind(v) for v in LOSSES]
    assert our_states(metrics, 0.1, **SETTINGS) == torch_states(metrics, 0.1, **SETTINGS)


@pytest.mark.parametrize(("value", "words"), [
    (torch.tensor(True), ("value", "torch.bool")),
    (10**400, ("value", "int", "float")),
], ids=["bool-tensor", "huge-int"])
def test_a_metric_that_is_no_real_number_is_a_one_line_error(value, words):
    """A bool tensor was taken as 1.0 where ``True`` is refused (torch takes both as 1.0); a
    huge int raised an OverflowError from our code (torch raises it too)."""
    tx = plateau()
    updates = {"w": torch.ones(1)}
    assert_one_line_error(lambda: tx.update(updates, tx.init(updates), value=value), *words)


@pytest.mark.parametrize("value", [np.array(True), np.array([0.5]), decimal.Decimal("sNaN")],
                         ids=["numpy-bool", "numpy-shape-1", "signaling-nan"])
def test_regression_guard_other_metrics_that_are_no_float_stay_refused(value):
    """torch refuses the array of shape (1,) and the signaling NaN too (TypeError, ValueError)
    and takes ``np.array(True)`` as 1.0, as ``True`` is refused here."""
    tx = plateau()
    updates = {"w": torch.ones(1)}
    assert_one_line_error(lambda: tx.update(updates, tx.init(updates), value=value), "value")


def test_regression_guard_a_metric_that_requires_grad_is_detached_without_a_warning():
    """torch warns on ``float()`` of such a tensor; ours is detached, and nothing is traced."""
    metrics = [torch.tensor(v, requires_grad=True) * 2 for v in LOSSES]
    plain = [float(m.detach()) for m in metrics]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert our_states(metrics, 0.1, **SETTINGS) == our_states(plain, 0.1, **SETTINGS)


# ------------------------------------------------------------------------------------------------
# Hyperparameters


def test_tensor_hyperparameters_are_taken_as_their_values():
    """``lr=torch.tensor(0.1)`` raised a UserWarning (an error in this suite) from
    ``torch.tensor(tensor)`` in init, and a one-element ``factor`` made the state and every 0-d
    update of shape (1,)."""
    tensors = {"lr": torch.tensor([0.1], dtype=torch.float64),
               "factor": torch.tensor([0.5], dtype=torch.float64),
               "min_lr": torch.tensor(0.01, dtype=torch.float64)}
    updates = {"w": torch.ones(()), "v": torch.ones(3)}
    ours = our_states(LOSSES, updates=updates, patience=1, **tensors)
    assert ours == torch_states(LOSSES, 0.1, factor=0.5, min_lr=0.01, patience=1)
    tx = plateau(**tensors, patience=0)
    scaled, _ = tx.update(updates, tx.init(updates), value=1.0)
    assert scaled["w"].shape == () and scaled["v"].shape == (3,)


def test_numpy_integer_patience_and_cooldown_are_taken_like_torch():
    """torch takes ``patience=np.int64(1)`` (e.g. from a config array); it was refused."""
    kwargs = {"factor": 0.5, "threshold": 0.05}
    ours = our_states(LOSSES, 0.1, patience=np.int64(1), cooldown=np.int32(1), **kwargs)
    assert ours == torch_states(LOSSES, 0.1, patience=1, cooldown=1, **kwargs)


# ------------------------------------------------------------------------------------------------
# State edited by hand


@pytest.mark.parametrize(("field", "value", "words"), [
    ("num_bad_epochs", torch.tensor(1.5), ("num_bad_epochs", "torch.float32", "integer")),
    ("cooldown_counter", torch.tensor(True), ("cooldown_counter", "torch.bool", "integer")),
    ("num_bad_epochs", torch.tensor(0, dtype=torch.int32), ("num_bad_epochs", "torch.int32")),
    ("count", 2.0, ("count", "float", "integer")),
    ("count", 0, ("count", "int", "integer")),
    ("lr", 0.1, ("lr", "float", "real number")),
    ("lr", torch.tensor(0.1), ("lr", "torch.float32", "float64")),
    ("lr", torch.tensor(0.1 + 0j), ("lr", "complex", "real number")),
    ("lr", torch.tensor([0.05], dtype=torch.float64), ("lr", "(1,)", "0-d")),
    ("best", torch.ones(2, dtype=torch.float64), ("best", "(2,)", "0-d")),
])
def test_a_state_field_init_would_not_make_is_a_one_line_error(field, value, words):
    """A float counter turned the state's counter into a float, a bool one raised a
    RuntimeError, a complex lr or a two-element best were taken and broadcast. A field is
    taken as init makes it (and a checkpoint restores it): a 0-d tensor of init's dtype."""
    tx = plateau(lr=0.1)
    updates = {"w": torch.ones(())}
    state = tx.init(updates)._replace(**{field: value})
    for metric in (None, 1.0):
        assert_one_line_error(lambda m=metric: tx.update(updates, state, value=m), *words)


@pytest.mark.parametrize(("bad", "cooldown"), [(-3, 0), (0, -2), (-1, 2), (5, 0), (7, 3)])
def test_regression_guard_counters_edited_by_hand_step_like_torch(bad, cooldown):
    """Negative or too-large counters, set on both, give the same steps (torch checks none)."""
    def edit(scheduler):
        scheduler.num_bad_epochs, scheduler.cooldown_counter = bad, cooldown

    tx = plateau(lr=1.0, **SETTINGS)
    state = tx.init({"w": torch.ones(1)})
    state = state._replace(num_bad_epochs=torch.tensor(bad),
                           cooldown_counter=torch.tensor(cooldown))
    assert our_states(LOSSES, 1.0, state=state, **SETTINGS) == torch_states(LOSSES, 1.0, edit,
                                                                            **SETTINGS)


# ------------------------------------------------------------------------------------------------
# Long runs against torch, value omitted


METRIC = st.one_of(st.sampled_from([0.0, 1.0, 1.00001, 0.99999, 2.0, -1.0, math.nan]),
                   st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(-10.0, 10.0))


@settings(max_examples=30, deadline=None)
@given(metrics=st.lists(METRIC, min_size=1, max_size=120),
       mode=st.sampled_from(["min", "max"]), threshold_mode=st.sampled_from(["rel", "abs"]),
       threshold=st.one_of(st.sampled_from([0.0, 1e-4, 1.0]), st.floats(0.0, 3.0)),
       factor=st.floats(0.0, 0.99), patience=st.integers(0, 5), cooldown=st.integers(0, 5),
       min_lr=st.sampled_from([0.0, 1e-3, 0.05, 2.0]), eps=st.sampled_from([0.0, 1e-8, 1e-3]),
       lr=st.sampled_from([1.0, 0.1, 3.0]))
def test_regression_guard_every_field_equals_torch_over_long_random_runs(metrics, lr, **kwargs):
    """lr, best, num_bad_epochs, cooldown_counter and count (torch's last_epoch), exactly."""
    assert our_states(metrics, lr, **kwargs) == torch_states(metrics, lr, **kwargs)


def test_regression_guard_value_omitted_scales_by_the_current_lr_and_keeps_the_state():
    tx = plateau(lr=0.1, **SETTINGS)
    updates = {"w": torch.full((2,), 0.1)}
    state = tx.init(updates)
    for metric in LOSSES:
        _, state = tx.update(updates, state, value=metric)
    scaled, kept = tx.update(updates, state)
    assert all(a is b for a, b in zip(kept, state, strict=True))
    torch.testing.assert_close(scaled["w"], updates["w"] * (float(state.lr) / 0.1))


# ------------------------------------------------------------------------------------------------
# In a fresh interpreter without type checks: wrong types (the suite's jaxtyping import hook
# refuses them by their annotations before minitrain's checks run) and torch.compile (dynamo
# cannot trace the hook's wrappers).

FRESH = r"""
import json, torch
import minitrain as mt
P = mt.optim.reduce_on_plateau
cases = {
    "lr='0.1'": lambda: P(lr="0.1"),
    "patience=2.0": lambda: P(patience=2.0),
    "cooldown=True": lambda: P(cooldown=True),
    "factor=None": lambda: P(factor=None),
    "state=tuple": lambda: P().update({}, tuple(P().init({})), value=1.0),
}
out = {}
for name, build in cases.items():
    try:
        build()
        out[name] = "accepted"
    except Exception as err:
        out[name] = type(err).__name__ + ": " + str(err)
tx = P(lr=0.1, factor=0.5, patience=0)
updates = {"w": torch.ones(3), "i": torch.tensor([4, 6])}
state = tx.init(updates)
step = torch.compile(lambda u, s, v: tx.update(u, s, value=v), fullgraph=True, backend="eager")
same = []
for value in (1.0, 2.0, 3.0):
    scaled, new_state = step(updates, state, torch.tensor(value))
    expected, state = tx.update(updates, state, value=torch.tensor(value))
    same.append(all(torch.equal(scaled[k], expected[k]) for k in updates)
                and all(torch.equal(a, b) for a, b in zip(new_state, state)))
print(json.dumps({"wrong types": out, "compiled": same, "lr": float(state.lr)}))
"""


@pytest.fixture(scope="module")
def fresh():
    result = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MINITRAIN_TYPECHECK": "0"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_regression_guard_a_wrong_type_is_a_one_line_value_error(fresh):
    for case, message in fresh["wrong types"].items():
        name = case.split("=")[0]
        assert message.startswith("ValueError: ") and name in message, (case, message)
        assert "\n" not in message, case


def test_regression_guard_the_update_compiles_without_a_graph_break(fresh):
    """Dynamo traces the whole update (tensor metric, state, an int leaf) as one graph, and
    the compiled update equals the eager one."""
    assert fresh["compiled"] == [True, True, True] and fresh["lr"] == 0.025


# ------------------------------------------------------------------------------------------------
# Against torch's ReduceLROnPlateau, in chains


def torch_plateau_lrs(metrics, lr, **kwargs):
    """The lr after each ``scheduler.step(metric)``."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    scheduler = lr_scheduler.ReduceLROnPlateau(optimizer, **kwargs)
    lrs = []
    for metric in metrics:
        optimizer.step()
        scheduler.step(metric)
        lrs.append(float(optimizer.param_groups[0]["lr"]))
    return lrs


def plateau_lrs(metrics, lr, **kwargs):
    tx = reduce_on_plateau(lr=lr, **kwargs)
    updates = {"w": torch.ones(3, dtype=torch.float64), "b": torch.ones((), dtype=torch.float32)}
    state = tx.init(updates)
    lrs = []
    for metric in metrics:
        scaled, state = tx.update(updates, state, value=metric)
        assert scaled["b"].dtype == torch.float32
        torch.testing.assert_close(scaled["w"], updates["w"] * float(state.lr) / lr)
        lrs.append(float(state.lr))
    assert int(state.count) == len(metrics)
    return lrs


@settings(max_examples=25, deadline=None)
@given(metrics=st.lists(st.sampled_from([-1.0, 0.0, 0.5, 0.9995, 1.0, 1.0001, 2.0, math.nan]),
                        min_size=1, max_size=30),
       mode=st.sampled_from(["min", "max"]), threshold_mode=st.sampled_from(["rel", "abs"]),
       threshold=st.sampled_from([0.0, 1e-4, 0.1]), factor=st.floats(0.0, 0.9),
       patience=st.integers(0, 3), cooldown=st.integers(0, 3),
       min_lr=st.sampled_from([0.0, 0.01]), eps=st.sampled_from([1e-8, 0.02]),
       lr=st.sampled_from([1.0, 0.1]))
def test_reduce_on_plateau_equals_torch(metrics, lr, **kwargs):
    assert plateau_lrs(metrics, lr, **kwargs) == torch_plateau_lrs(metrics, lr, **kwargs)


def test_reduce_on_plateau_takes_tensor_metrics_under_vmap():
    """No host syncs: the update runs under vmap over the metric (one member per metric)."""
    tx = reduce_on_plateau(lr=0.1, factor=0.5, patience=0)
    updates = {"w": torch.ones(2)}
    state = tx.init(updates)
    for metric in [1.0, 2.0]:
        _, state = tx.update(updates, state, value=torch.tensor(metric))

    def step(value):
        return tx.update(updates, state, value=value)

    scaled, batched = torch.func.vmap(step)(torch.tensor([0.5, 3.0]))
    assert batched.lr.tolist() == [0.05, 0.025]
    torch.testing.assert_close(scaled["w"], torch.tensor([[0.5, 0.5], [0.25, 0.25]]))


@pytest.mark.parametrize(("build", "name"), [
    (lambda: reduce_on_plateau(mode="best"), "mode"),
    (lambda: reduce_on_plateau(threshold_mode="relative"), "threshold_mode"),
    (lambda: reduce_on_plateau(factor=1.0), "factor"),
    (lambda: reduce_on_plateau(patience=-1), "patience"),
    (lambda: reduce_on_plateau(lr=0.0), "lr"),
    (lambda: reduce_on_plateau().update({}, reduce_on_plateau().init({}),
                                        value=torch.ones(2)), "value"),
])
def test_reduce_on_plateau_bad_arguments(build, name):
    with pytest.raises(ValueError, match=name) as info:
        build()
    assert "\n" not in str(info.value)


def test_reduce_on_plateau_after_adam_takes_torchs_steps():
    """Adam then reduce_on_plateau, fed the previous loss (torch steps the scheduler after the
    optimizer), equals torch.optim.Adam with ReduceLROnPlateau stepped on each loss."""
    target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)

    def loss_fn(w):
        return ((w - target) ** 2).sum() + 0.3 * torch.sin(5 * w).sum()

    settings = {"factor": 0.5, "patience": 1, "threshold": 0.05, "cooldown": 1}
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = torch.optim.Adam([param], lr=0.3)
    scheduler = lr_scheduler.ReduceLROnPlateau(optimizer, **settings)
    tx = mt.optim.chain(mt.optim.scale_by_adam(), mt.optim.scale_by_learning_rate(0.3))
    plateau = reduce_on_plateau(lr=0.3, **settings)
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    state, plateau_state, previous = tx.init(params), plateau.init(params), None
    for _ in range(25):
        optimizer.zero_grad()
        loss = loss_fn(param)
        loss.backward()
        optimizer.step()
        scheduler.step(loss.item())

        value, grads = mt.value_and_grad(lambda p: loss_fn(p["w"]))(params)
        updates, state = tx.update(grads, state, params)
        updates, plateau_state = plateau.update(updates, plateau_state, value=previous)
        params, previous = mt.optim.apply_updates(params, updates), value
        torch.testing.assert_close(params["w"], param.detach(), rtol=1e-6, atol=1e-9)
    _, plateau_state = plateau.update(updates, plateau_state, value=previous)  # the last loss
    assert float(plateau_state.lr) == optimizer.param_groups[0]["lr"] < 0.3


@pytest.mark.parametrize("wrap", ["chain", "apply_if_finite", "multi_transform"])
def test_chain_forwards_value_to_reduce_on_plateau(wrap):
    """``value=`` given to a chain's update (or through a wrapper, or ``as_optimizer``) reaches
    reduce_on_plateau and no other transformation: equal to torch.optim.Adam with
    ReduceLROnPlateau stepped on each loss."""
    target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)

    def loss_fn(w):
        return ((w - target) ** 2).sum() + 0.3 * torch.sin(5 * w).sum()

    settings = {"factor": 0.5, "patience": 1, "threshold": 0.05}
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = torch.optim.Adam([param], lr=0.3)
    scheduler = lr_scheduler.ReduceLROnPlateau(optimizer, **settings)
    tx = mt.optim.chain(mt.optim.scale_by_adam(), mt.optim.scale_by_learning_rate(0.3),
                        reduce_on_plateau(lr=0.3, **settings))
    if wrap == "apply_if_finite":
        tx = mt.optim.apply_if_finite(tx)
    elif wrap == "multi_transform":
        tx = mt.optim.multi_transform({"all": tx, "none": mt.optim.scale(0.0)},
                                      lambda name, leaf: "all")
    assert mt.optim.extra_args(tx) == {"value"}
    opt = mt.optim.as_optimizer(tx)
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    state, previous = opt.init(params), None
    for _ in range(20):
        optimizer.zero_grad()
        loss = loss_fn(param)
        loss.backward()
        optimizer.step()
        scheduler.step(loss.item())

        value, grads = mt.value_and_grad(lambda p: loss_fn(p["w"]))(params)
        params, state = opt.update(grads, state, params, value=previous)
        previous = value
        torch.testing.assert_close(params["w"], param.detach(), rtol=1e-6, atol=1e-9)
    assert optimizer.param_groups[0]["lr"] < 0.3  # the plateau was reached


def test_chain_refuses_a_keyword_no_transformation_takes():
    tx = mt.optim.chain(mt.optim.scale_by_adam(), reduce_on_plateau())
    params = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"\['valu'\].*value") as info:
        tx.update(params, tx.init(params), params, valu=1.0)
    assert "\n" not in str(info.value)
    opt = mt.optim.adamw()
    with pytest.raises((ValueError, TypeError), match="value"):
        opt.update(params, opt.init(params), params, value=1.0)


# ------------------------------------------------------------------------------------------------
# Metrics and settings at the edges


@pytest.mark.parametrize("kind", [np.float32, np.float64, np.int64, Fraction,
                                  lambda v: torch.tensor([v]), lambda v: torch.tensor(v)],
                         ids=["np.float32", "np.float64", "np.int64", "Fraction",
                              "tensor-shape-1", "tensor-0d"])
def test_reduce_on_plateau_takes_any_real_metric_like_torch(kind):
    """torch takes ``float(metric)``: numpy scalars and Fractions too (np.float32, np.int64
    and Fraction were refused; the others are a regression guard)."""
    scale = 10 if kind is np.int64 else 1  # whole numbers for the integer kind
    metrics = [kind(round(v * scale)) if kind is np.int64 else kind(v) for v in LOSSES[:9]]
    settings = {"factor": 0.5, "patience": 1, "threshold": 0.05}
    assert plateau_lrs(metrics, 0.1, **settings) == torch_plateau_lrs(metrics, 0.1, **settings)


@pytest.mark.parametrize("value", [
    True, np.bool_(True), "0.5", 1 + 0j, [0.5], object(),
    torch.tensor(1 + 1j), torch.empty((), device="meta"),
], ids=["bool", "np.bool_", "str", "complex", "list", "object", "complex-tensor", "meta-tensor"])
def test_reduce_on_plateau_refuses_a_metric_that_is_no_real_number(value):
    """The complex tensor was cast with a warning (imaginary part dropped) and the meta tensor
    raised NotImplementedError; the rest are a regression guard."""
    tx = mt.optim.reduce_on_plateau()
    updates = {"w": torch.ones(2)}
    assert_one_line_error(lambda: tx.update(updates, tx.init(updates), value=value), "value")


def test_reduce_on_plateau_refuses_an_infinite_lr():
    """``lr=inf`` scaled the updates by inf / inf = NaN."""
    assert_one_line_error(lambda: mt.optim.reduce_on_plateau(lr=math.inf), "lr")


PLATEAU_METRICS = [
    [math.inf, 1.0, math.inf, math.nan, 0.5, 0.5, 0.5, -math.inf, -math.inf, 3.0, 3.0, 3.0],
    [-1.0, -2.0, -2.0, -1.5, 1e300, -1e300, -1e300, 0.0, 0.0, 0.0, 0.0, 1e-5],
    [0.0, 0.0, 1.0, 1.0001, 0.9999, 2.0, math.nan, math.nan, 2.0, 1.0, 0.5, 0.25],
]


@pytest.mark.parametrize("metrics", PLATEAU_METRICS, ids=["infinities", "signs", "ties"])
@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("threshold_mode", ["rel", "abs"])
def test_regression_guard_reduce_on_plateau_equals_torch_at_the_edges(metrics, mode,
                                                                      threshold_mode):
    """Exactly torch's lrs: infinite and NaN metrics, thresholds of 0, 1 and inf, min_lr above
    the lr, eps larger than a reduction, factor 0, cooldowns."""
    for threshold in (0.0, 1.0, 2.0, math.inf):
        for factor, patience, cooldown, min_lr, eps, lr in (
            (0.5, 0, 0, 0.0, 1e-8, 1.0), (0.0, 1, 2, 0.0, 1e-8, 0.1),
            (0.1, 0, 1, 2.0, 1e-8, 1.0), (0.5, 0, 0, 0.0, 0.3, 1.0), (0.9, 2, 3, 0.01, 0.0, 3.0),
        ):
            kwargs = {"mode": mode, "threshold_mode": threshold_mode, "threshold": threshold,
                      "factor": factor, "patience": patience, "cooldown": cooldown,
                      "min_lr": min_lr, "eps": eps}
            assert plateau_lrs(metrics, lr, **kwargs) == torch_plateau_lrs(metrics, lr,
                                                                           **kwargs), kwargs
