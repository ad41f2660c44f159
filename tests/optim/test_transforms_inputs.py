"""Inputs at the edges of the gradient transformations, and leaves of other types than
floating-point tensors, through every transformation.

* A leaf that is no tensor (a Python or numpy number, None, a string) in the updates or the
  params is a one-line ``ValueError`` naming the leaf and how to pass it (``torch.tensor(2.0)``),
  from every transformation and wrapper, at init and at update.
* An integer or bool update is promoted to its param's floating dtype (the default float dtype
  without params), as torch promotes ``int_tensor + param`` and ``int_tensor * 0.5``, and as
  optax's JAX promotion does: every transformation gives what it gives for the promoted update.
  Params of a transformation that keeps state like them must be floating-point.
* ``trace(momentum, dampening=<traced tensor>, nesterov=True)`` is taken as ``sgd`` takes it:
  its hypergradient by ``torch.func.grad`` equals autograd's and the closed form, its ``vmap``
  over dampening equals ``sgd``'s and separate runs.
* Edge inputs: a grad buffer the caller reuses, momentum 0 with dampening, masks and groups
  that select no leaf, a tensor ``max_norm`` that is differentiated or vmapped, None, sparse
  and mismatched grads, and schedules that return a one-element tensor. References:
  torch.optim.SGD, torch.nn.utils.clip_grad_norm_, finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt

optim = mt.optim
F64 = torch.float64

# Every transformation and wrapper, on params {"w": (3, 2), "b": (2,)} (Muon's need matrices).
FACTORIES = {
    "identity": optim.identity,
    "chain": lambda: optim.chain(optim.scale_by_adam(), optim.scale(-0.1)),
    "scale": lambda: optim.scale(0.5),
    "scale_by_learning_rate": lambda: optim.scale_by_learning_rate(0.1),
    "scale_by_adam": optim.scale_by_adam,
    "scale_by_adam-amsgrad": lambda: optim.scale_by_adam(amsgrad=True),
    "scale_by_rms": lambda: optim.scale_by_rms(centered=True),
    "scale_by_adagrad": optim.scale_by_adagrad,
    "scale_by_sign": optim.scale_by_sign,
    "trace": lambda: optim.trace(0.9),
    "trace-nesterov": lambda: optim.trace(0.9, nesterov=True),
    "add_decayed_weights": lambda: optim.add_decayed_weights(0.1),
    "add_decayed_weights-off": lambda: optim.add_decayed_weights(0.0),
    "clip": lambda: optim.clip(1.5),
    "clip_by_global_norm": lambda: optim.clip_by_global_norm(1.0),
    "masked": lambda: optim.masked(optim.scale_by_adam(), {"w": True, "b": False}),
    "multi_transform": lambda: optim.multi_transform(
        {"m": optim.trace(0.9), "s": optim.scale_by_sign()}, {"w": "m", "b": "s"}),
    "MultiSteps": lambda: optim.MultiSteps(optim.scale_by_adam(), every_k=1),
    "apply_if_finite": lambda: optim.apply_if_finite(optim.scale_by_rms()),
    "ema": lambda: optim.ema(0.9),
    "inject_hyperparams": lambda: optim.inject_hyperparams(optim.scale_by_adam)(b1=0.8),
    "sgd_chain": lambda: optim.chain(optim.add_decayed_weights(0.1), optim.trace(0.9),
                                     optim.scale_by_learning_rate(0.1)),
    "adam_chain": lambda: optim.chain(optim.add_decayed_weights(0.1), optim.scale_by_adam(),
                                      optim.scale_by_learning_rate(0.1)),
    "scale_by_lion": optim.scale_by_lion,
    "scale_by_adamax": optim.scale_by_adamax,
    "scale_by_nadam": optim.scale_by_nadam,
    "scale_by_adadelta": optim.scale_by_adadelta,
}
# Those that keep a state like each param.
STATEFUL = ["chain", "scale_by_adam", "scale_by_rms", "scale_by_adagrad", "trace", "MultiSteps",
            "ema", "scale_by_lion", "scale_by_adamax", "adam_chain"]


def _params(dtype=torch.float32):
    return {"w": torch.ones(3, 2, dtype=dtype), "b": torch.full((2,), 0.5, dtype=dtype)}


def _grads(dtype=torch.float32):
    return {"w": torch.tensor([[1, -2], [3, 0], [5, -1]], dtype=dtype),
            "b": torch.tensor([2, -3], dtype=dtype)}


# --------------------------------------------------------------------------------------------
# 1. Leaves that are no tensors: one line naming the leaf


NON_TENSORS = st.sampled_from([2.0, 2, True, np.float32(2.0), np.int64(2), -0.5, 1e300])


def _one_line_naming(info, leaf):
    message = str(info.value)
    assert "\n" not in message and f"'{leaf}'" in message, message
    return message


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(FACTORIES)), leaf=st.sampled_from(["w", "b"]),
       value=NON_TENSORS, with_params=st.booleans())
def test_hypothesis_a_number_update_is_a_value_error_naming_its_leaf(name, leaf, value,
                                                                      with_params):
    tx = FACTORIES[name]()
    params = _params()
    updates = {**_grads(torch.float32), leaf: value}
    with_params = with_params or name in ("add_decayed_weights", "ema")  # these need params
    with pytest.raises(ValueError, match=r"pass torch\.tensor\(") as info:
        tx.update(updates, tx.init(params), params if with_params else None)
    message = _one_line_naming(info, leaf)
    assert f"torch.tensor({float(value)!r})" in message


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("value", [2.0, np.float64(2.0), "x"], ids=["float", "numpy", "str"])
def test_a_non_tensor_param_at_init_is_a_value_error_naming_it(name, value):
    tx = FACTORIES[name]()
    with pytest.raises(ValueError, match=r"param 'b'.* not a tensor; pass ") as info:
        tx.init({"w": torch.ones(3, 2), "b": value})
    _one_line_naming(info, "b")


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_non_tensor_param_at_update_is_a_value_error_naming_it(name):
    tx = FACTORIES[name]()
    state = tx.init(_params())
    with pytest.raises(ValueError, match=r"param 'b'.* not a tensor; pass torch\.tensor\(0\.5\)"):
        tx.update(_grads(), state, {"w": torch.ones(3, 2), "b": 0.5})


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_none_update_is_named_by_its_own_leaf_name(name):
    # masked and multi_transform named the leaf by its index in the inner list ('0')
    tx = FACTORIES[name]()
    params = _params()
    with pytest.raises(ValueError, match=r"^the grad of 'w' is None"):
        tx.update({"w": None, "b": torch.ones(2)}, tx.init(params), params)


@pytest.mark.parametrize("value", [2.0, None, np.float32(1.0)])
def test_clip_by_global_norms_function_form_names_a_non_tensor_grad(value):
    with pytest.raises(ValueError, match=r"'a'") as info:
        optim.clip_by_global_norm({"a": value, "b": torch.ones(2)}, 1.0)
    _one_line_naming(info, "a")


def test_the_hint_is_a_tensor_the_transformation_then_takes():
    tx = optim.scale(0.5)
    with pytest.raises(ValueError, match=r"pass torch\.tensor\(2\.0\)$"):
        tx.update({"a": 2.0}, tx.init({"a": torch.tensor(0.0)}))
    updates, _ = tx.update({"a": torch.tensor(2.0)}, tx.init({"a": torch.tensor(0.0)}))
    assert updates["a"].item() == 1.0


# --------------------------------------------------------------------------------------------
# 2. Integer and bool updates: promoted as torch promotes them


INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool]


def _int_grads(dtype, values):
    g = torch.tensor(values).reshape(4, 2)
    if dtype is torch.bool:
        g = g != 0
    elif not dtype.is_signed:
        g = g.abs()
    return {"w": g[:3].to(dtype), "b": g[3].to(dtype)}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(FACTORIES)), dtype=st.sampled_from(INT_DTYPES),
       param_dtype=st.sampled_from([torch.float32, F64]),
       values=st.lists(st.integers(-100, 100), min_size=8, max_size=8))
def test_hypothesis_an_integer_update_gives_what_its_promotion_gives(name, dtype, param_dtype,
                                                                     values):
    params = _params(param_dtype)
    grads = _int_grads(dtype, values)
    promoted = {k: v.to(param_dtype) for k, v in grads.items()}  # torch's int + param
    tx = FACTORIES[name]()
    state = tx.init(params)
    got, got_state = tx.update(grads, state, params)
    want, want_state = tx.update(promoted, state, params)
    for g, w in zip(mt.tree.leaves((got, got_state)), mt.tree.leaves((want, want_state)),
                    strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert all(u.dtype == param_dtype for u in mt.tree.leaves(got))


@pytest.mark.parametrize("name", ["scale", "scale_by_sign", "scale_by_adam", "trace", "clip",
                                  "clip_by_global_norm", "identity", "scale_by_rms"])
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_without_params_an_integer_update_takes_the_default_float_dtype(name, dtype):
    grads = _int_grads(dtype, [1, -2, 3, 0, 5, -1, 2, -3])
    tx = FACTORIES[name]()
    state = tx.init(_params())
    got, _ = tx.update(grads, state)
    want, _ = tx.update({k: v.to(torch.get_default_dtype()) for k, v in grads.items()}, state)
    for g, w in zip(mt.tree.leaves(got), mt.tree.leaves(want), strict=True):
        assert g.dtype == torch.get_default_dtype()
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_promotion_is_reduce_on_plateaus_and_torchs():
    g = torch.tensor([3, -1])
    plateau = optim.reduce_on_plateau(lr=1.0)
    by_plateau, _ = plateau.update({"a": g}, plateau.init({"a": g}))
    by_scale, _ = optim.scale(0.5).update({"a": g}, optim.EmptyState())
    assert by_plateau["a"].dtype == by_scale["a"].dtype == (g * 0.5).dtype
    torch.testing.assert_close(by_scale["a"], g * 0.5, rtol=0, atol=0)


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_params_of_a_stateful_transformation_are_refused_in_one_line(name, dtype):
    tx = FACTORIES[name]()
    with pytest.raises(ValueError, match=rf"param 'w' is {dtype}; pass floating-point params"):
        tx.init({"w": torch.ones(3, 2, dtype=dtype), "b": torch.ones(2)})


def test_a_clip_by_global_norm_of_integer_grads_is_the_float_clip():
    grads = {"a": torch.tensor([3, 0]), "b": torch.tensor([4])}
    clipped, norm = optim.clip_by_global_norm(grads, 1.0)
    want, want_norm = optim.clip_by_global_norm({k: v.float() for k, v in grads.items()}, 1.0)
    torch.testing.assert_close(norm, want_norm)
    torch.testing.assert_close(clipped, want, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# 3. trace with a traced dampening and Nesterov, as sgd


GRADS = [torch.tensor([1.0, -2.0], dtype=F64), torch.tensor([0.5, 3.0], dtype=F64)]


def _trace_loss(dampening, momentum=0.9):
    """The sum of trace's second update (Nesterov) from GRADS."""
    tx = optim.trace(momentum, dampening=dampening, nesterov=True)
    state = tx.init([torch.zeros(2, dtype=F64)])
    for g in GRADS:
        out, state = tx.update([g], state)
    return out[0].sum()


def _sgd_params(make, dampening):
    opt = make(dampening)
    params = {"w": torch.zeros(2, dtype=F64)}
    state = opt.init(params)
    for g in GRADS:
        params, state = opt.update({"w": g}, state, params)
    return params["w"]


SGD = {
    "sgd": lambda d: optim.sgd(lr=0.1, momentum=0.9, dampening=d, nesterov=True),
    "sgd_chain": lambda d: optim.as_optimizer(optim.chain(
        optim.trace(0.9, dampening=d, nesterov=True), optim.scale_by_learning_rate(0.1))),
}


def test_traces_hypergradient_in_a_traced_dampening_under_nesterov():
    zero = torch.tensor(0.0, dtype=F64)
    by_func = torch.func.grad(_trace_loss)(zero)  # traced: refused before
    leaf = zero.clone().requires_grad_()
    (by_autograd,) = torch.autograd.grad(_trace_loss(leaf), leaf)
    # second update g2 + m (m g1 + (1 - d) g2): d/dd = -m sum(g2)
    closed_form = -0.9 * GRADS[1].sum()
    torch.testing.assert_close(by_func, by_autograd, rtol=1e-12, atol=0)
    torch.testing.assert_close(by_func, closed_form, rtol=1e-12, atol=0)


def test_sgd_and_its_chain_agree_on_the_hypergradient_in_dampening_under_nesterov():
    zero = torch.tensor(0.0, dtype=F64)
    grads = [torch.func.grad(lambda d, m=make: _sgd_params(m, d).sum())(zero)
             for make in SGD.values()]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=0)
    torch.testing.assert_close(grads[0], 0.1 * 0.9 * GRADS[1].sum(), rtol=1e-12, atol=0)


def test_a_vmapped_dampening_under_nesterov_matches_separate_runs_and_sgd():
    values = torch.tensor([0.0, 0.0, 0.3], dtype=F64)
    batched = {name: torch.func.vmap(lambda d, m=make: _sgd_params(m, d))(values)
               for name, make in SGD.items()}
    torch.testing.assert_close(batched["sgd_chain"], batched["sgd"], rtol=1e-12, atol=1e-15)
    separate = _sgd_params(SGD["sgd_chain"], 0.0)  # a float dampening 0: a concrete check
    for i in (0, 1):
        torch.testing.assert_close(batched["sgd_chain"][i], separate, rtol=1e-12, atol=0)
    traced = torch.func.vmap(_trace_loss)(values)
    torch.testing.assert_close(traced[:2], _trace_loss(0.0).expand(2), rtol=1e-12, atol=0)


@pytest.mark.parametrize("make", [lambda: optim.trace(0.9, dampening=0.1, nesterov=True),
                                  lambda: optim.trace(0.9, torch.tensor(0.1), nesterov=True),
                                  lambda: optim.sgd(momentum=0.9, dampening=0.1, nesterov=True)])
def test_a_concrete_dampening_under_nesterov_is_still_refused(make):
    with pytest.raises(ValueError, match="nesterov=True: it requires momentum > 0 and dampening"):
        make()


LOWERED_CHAINS = {  # the chains of adam, sgd, adagrad and rmsprop, with their defaults
    "adam_chain": lambda: optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-3)),
    "sgd_chain": lambda: optim.chain(optim.add_decayed_weights(0.0),
                                     optim.scale_by_learning_rate(1e-3)),
    "adagrad_chain": lambda: optim.chain(optim.add_decayed_weights(0.0),
                                         optim.scale_by_adagrad(),
                                         optim.scale_by_learning_rate(1e-2)),
    "rmsprop_chain": lambda: optim.chain(optim.add_decayed_weights(0.0), optim.scale_by_rms(),
                                         optim.scale_by_learning_rate(1e-2)),
}


@pytest.mark.parametrize("name", LOWERED_CHAINS)
def test_a_lowered_chain_names_a_number_update_in_one_line(name):
    # as_optimizer(chain) may run an alias's kernel; a number leaf falls back to the chain,
    # which names it (it raised AttributeError from the path choice before)
    opt = mt.optim.as_optimizer(LOWERED_CHAINS[name]())
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match=r"leaf 'w'") as info:
        opt.update({"w": 2.0}, opt.init(params), params)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", LOWERED_CHAINS)
def test_a_lowered_chain_promotes_an_integer_grad_as_the_plain_chain_does(name):
    params = {"w": torch.linspace(-1.0, 1.0, 5)}
    lowered = mt.optim.as_optimizer(LOWERED_CHAINS[name]())
    chain = LOWERED_CHAINS[name]()
    got, _ = lowered.update({"w": torch.arange(5)}, lowered.init(params), params)
    updates, _ = chain.update({"w": torch.arange(5.0)}, chain.init(params), params)
    assert torch.equal(got["w"], mt.optim.apply_updates(params, updates)["w"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_adafactor_refuses_integer_params_in_one_line(dtype):
    # it raised TypeError from torch.finfo at the first update
    tx = mt.optim.scale_by_adafactor()
    with pytest.raises(ValueError, match=r"param 'w' is torch\.(int64|bool); pass floating"):
        tx.init({"w": torch.ones(2, 2, dtype=dtype)})


# --------------------------------------------------------------------------------------------
# 4. Edge inputs: a reused grad buffer, momentum 0, empty groups, a tensor max_norm, None


def _sgd_reference(grads, momentum, dampening=0.0, lr=1.0):
    """torch.optim.SGD's params after one step per grad, from zeros."""
    p = torch.nn.Parameter(torch.zeros_like(grads[0]))
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, dampening=dampening)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("wrap", ["plain", "masked", "multi_transform", "as_optimizer"])
def test_trace_keeps_a_copy_of_the_first_grad_not_the_callers_buffer(wrap):
    momentum = optim.trace(0.9)
    if wrap == "masked":
        momentum = optim.masked(momentum, {"w": True})
    elif wrap == "multi_transform":
        momentum = optim.multi_transform({"m": momentum}, {"w": "m"})
    tx = optim.chain(momentum, optim.scale(-1.0))
    params = {"w": torch.zeros(3)}
    buffer = torch.ones(3)  # one grad buffer, refilled each step (zero_grad(set_to_none=False))
    if wrap == "as_optimizer":
        opt = optim.as_optimizer(tx)
        state = opt.init(params)
        params, state = opt.update({"w": buffer}, state, params)
        buffer.zero_().add_(2.0)
        params, state = opt.update({"w": buffer}, state, params)
    else:
        state = tx.init(params)
        total = torch.zeros(3)
        for fill in (1.0, 2.0):
            buffer.zero_().add_(fill)
            updates, state = tx.update({"w": buffer}, state, params)
            total = total + updates["w"]
        params = {"w": total}
    expected = _sgd_reference([torch.ones(3), torch.full((3,), 2.0)], momentum=0.9)
    torch.testing.assert_close(params["w"], expected, rtol=0, atol=0)  # -3.9, not -4.8


def test_trace_without_momentum_ignores_dampening_as_torch_sgd():
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0]), torch.tensor([-1.0, 1.0])]
    opt = optim.as_optimizer(optim.chain(optim.trace(0.0, dampening=0.5), optim.scale(-0.1)))
    params = {"w": torch.zeros(2)}
    state = opt.init(params)
    for g in grads:
        params, state = opt.update({"w": g}, state, params)
    expected = _sgd_reference(grads, momentum=0.0, dampening=0.5, lr=0.1)
    torch.testing.assert_close(params["w"], expected)  # torch's add(alpha=-lr) rounds once


def test_trace_with_vmapped_momentum_matches_each_member():
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])]
    momenta = torch.tensor([0.0, 0.9])

    def run(momentum):
        tx = optim.trace(momentum, dampening=0.5)
        state, out = tx.init([torch.zeros(2)]), None
        for g in grads:
            out, state = tx.update([g], state)
        return out[0]

    batched = torch.func.vmap(run)(momenta)
    for i, m in enumerate(momenta.tolist()):
        torch.testing.assert_close(batched[i], run(m))


def test_decay_with_a_mask_that_selects_no_leaf_passes_updates_through():
    tx = optim.add_decayed_weights(0.1, mask=lambda name, p: p.ndim >= 2)
    params = {"b": torch.ones(3)}
    updates = {"b": torch.tensor([1.0, 2.0, 3.0])}
    assert tx.update(updates, tx.init(params), params)[0]["b"].tolist() == [1.0, 2.0, 3.0]
    assert optim.add_decayed_weights(0.1).update({}, (), {})[0] == {}


@pytest.mark.parametrize("updates,words", [
    ({"v": torch.ones(3)}, "params has 'w' where updates has 'v'"),
    ({"w": torch.ones(4)}, r"at leaf 'w': shape \(3,\) vs \(4,\)"),
])
def test_decay_names_updates_that_do_not_fit_the_params(updates, words):
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match=words):
        optim.add_decayed_weights(0.1).update(updates, (), params)


def test_clip_passes_empty_grads_through_with_a_zero_norm_as_clip_grad_norm():
    grads, norm = optim.clip_by_global_norm({}, 1.0)
    assert grads == {}
    assert norm == torch.nn.utils.clip_grad_norm_([], 1.0) == 0.0
    # A multi_transform label (or a masked group) that holds no leaf is an empty tree.
    tx = optim.multi_transform(
        {"matrix": optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.1)),
         "other": optim.scale(-0.1)},
        lambda name, p: "matrix" if p.ndim == 2 else "other")
    params = {"b": torch.ones(3)}
    torch.testing.assert_close(tx.update(params, tx.init(params), params)[0]["b"],
                               torch.full((3,), -0.1))


def test_clip_takes_max_norm_as_a_keyword():
    tx = optim.clip_by_global_norm(max_norm=1.0)
    torch.testing.assert_close(tx.update([torch.tensor([3.0, 4.0])], ())[0][0],
                               torch.tensor([0.6, 0.8]))


def _clipped_sgd_loss(max_norm, requires_grad=False):
    m = torch.tensor(max_norm, dtype=torch.float64, requires_grad=requires_grad)
    opt = optim.as_optimizer(optim.chain(optim.clip_by_global_norm(m), optim.trace(0.9),
                                 optim.scale_by_learning_rate(0.1)))
    params = {"w": torch.ones(2, dtype=torch.float64)}
    state = opt.init(params)
    for g in ([3.0, 4.0], [1.0, -2.0], [0.5, 0.5]):
        params, state = opt.update({"w": torch.tensor(g, dtype=torch.float64)}, state, params)
    return (params["w"] ** 2).sum(), m


def test_a_tensor_max_norm_is_differentiable_as_finite_differences_say():
    loss, m = _clipped_sgd_loss(1.0, requires_grad=True)
    loss.backward()
    eps = 1e-6
    fd = (_clipped_sgd_loss(1.0 + eps)[0] - _clipped_sgd_loss(1.0 - eps)[0]) / (2 * eps)
    assert m.grad != 0
    torch.testing.assert_close(m.grad, fd, rtol=1e-6, atol=1e-9)
    grads = {"w": torch.tensor([3.0, 4.0])}
    by_func = torch.func.grad(
        lambda m: optim.clip_by_global_norm(m).update(grads, ())[0]["w"].sum())(torch.tensor(1.0))
    torch.testing.assert_close(by_func, torch.tensor(7.0 / 5.0))  # d(3m/5 + 4m/5)/dm


def test_a_vmapped_max_norm_clips_each_member():
    grads = {"w": torch.tensor([3.0, 4.0])}
    out = torch.func.vmap(lambda m: optim.clip_by_global_norm(m).update(grads, ())[0]["w"])(
        torch.tensor([1.0, 10.0]))
    torch.testing.assert_close(out, torch.tensor([[0.6, 0.8], [3.0, 4.0]]))


@pytest.mark.parametrize("name", [
    "scale_by_adam", "scale_by_sign", "trace", "clip", "scale", "add_decayed_weights",
    "clip_by_global_norm", "chain", "adamw", "nadam"])
def test_a_none_grad_is_a_value_error_naming_its_leaf(name):
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    grads = {"a": None, "b": torch.ones(2)}
    factories = {
        "clip": lambda: optim.clip(1.0), "scale": lambda: optim.scale(0.5),
        "add_decayed_weights": lambda: optim.add_decayed_weights(0.1),
        "clip_by_global_norm": lambda: optim.clip_by_global_norm(1.0),
        "chain": lambda: optim.as_optimizer(optim.chain(optim.scale_by_adam(), optim.scale(-0.1))),
        "adamw": lambda: optim.adamw(lr=0.1), "nadam": lambda: optim.nadam(lr=0.1),
    }
    tx = factories.get(name, getattr(optim, name))()
    with pytest.raises(ValueError, match="the grad of 'a' is None"):
        tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize("name", ["scale_by_adam", "trace", "scale_by_rms", "ema"])
def test_a_none_param_at_init_is_a_value_error_naming_it(name):
    tx = optim.ema(0.9) if name == "ema" else getattr(optim, name)()
    with pytest.raises(ValueError, match="param 'a' is None"):
        tx.init({"a": None, "b": torch.ones(2)})


def test_a_state_in_another_dtype_than_its_update_is_named():
    params = {"w": torch.ones(3)}
    tx = optim.scale_by_adam()
    with pytest.raises(ValueError, match=r"state.exp_avg leaf .*'w'.* is torch.float32 but its "
                                         r"update is torch.bfloat16"):
        tx.update({"w": torch.ones(3, dtype=torch.bfloat16)}, tx.init(params), params)


@pytest.mark.parametrize("path", ["batched", "plain"])
def test_a_schedules_one_element_tensor_is_a_0d_lr_on_every_path(path):
    tx = optim.scale_by_learning_rate(lambda step: torch.tensor([0.5]))
    leaf = torch.tensor(2.0, requires_grad=path == "plain")
    updates, state = tx.update([leaf], tx.init([leaf]))
    assert updates[0].shape == () and state.lr.shape == ()
    torch.testing.assert_close(updates[0].detach(), torch.tensor(-1.0))  # -lr * u


def test_inject_hyperparams_takes_one_beta_of_adam():
    params = [torch.zeros(2)]
    grads = [torch.tensor([1.0, -2.0])]
    injected = optim.inject_hyperparams(optim.scale_by_adam)(b1=0.8)
    reference = optim.scale_by_adam(b1=0.8)
    torch.testing.assert_close(injected.update(grads, injected.init(params))[0][0],
                               reference.update(grads, reference.init(params))[0][0])
