"""A learning rate per member: ``lr`` a 1-D tensor scales each stacked leaf's leading axis, so
one optimizer over an ensemble's stacked params is each member's own optimizer at its own lr
(for the elementwise rules), in the chain (float64) and in the members' kernel call (float32).
"""

import inspect

import pytest
import torch

import minitrain as mt
from minitrain.optim.kernels import streaming

LRS = torch.tensor([1e-3, 1e-2, 0.1, 0.0])

ELEMENTWISE = {  # alias -> extra arguments; each member's update reads its own slices only
    "sgd": {}, "sgd momentum nesterov wd": {"momentum": 0.9, "nesterov": True,
                                            "weight_decay": 0.1},
    "adam": {}, "adam amsgrad": {"amsgrad": True}, "adamw": {"weight_decay": 0.1},
    "adagrad": {"lr_decay": 0.01}, "rmsprop": {"centered": True, "momentum": 0.5},
    "adadelta": {}, "adamax": {}, "lion": {}, "nadam": {}, "radam": {}, "adabelief": {},
    "yogi": {},
}
NOT_ELEMENTWISE = {"lamb", "lars", "muon"}  # trust ratios and orthogonalisation read a norm
ONE_LR = {"schedule_free_adamw", "scale_by_schedule_free_adamw", "reduce_on_plateau",
          "adafactor", "scale_by_adafactor"}  # refuse a 1-D lr
OTHER = {"scale_by_learning_rate", "dpsgd"}  # tested below; dpsgd's grads are per example


def _alias(name):
    return getattr(mt.optim, name.split()[0])


def _stacked_params(dtype):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, 2, generator=g, dtype=dtype),
            "b": torch.randn(4, 2, generator=g, dtype=dtype), "s": torch.randn(4, generator=g,
                                                                                dtype=dtype)}


def _first_parameter(value):
    try:
        return next(iter(inspect.signature(value).parameters), None)
    except (TypeError, ValueError):  # a type alias such as Schedule
        return None


def test_every_optimizer_with_an_lr_is_classified():
    with_lr = {name for name in mt.optim.__all__ if not inspect.isclass(getattr(mt.optim, name))
               and _first_parameter(getattr(mt.optim, name)) in ("lr", "learning_rate")}
    named = {name.split()[0] for name in ELEMENTWISE} | NOT_ELEMENTWISE | ONE_LR | OTHER
    assert with_lr == named


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_a_learning_rate_per_member_is_each_members_own_run(name, dtype):
    make, extra = _alias(name), ELEMENTWISE[name]
    params = _stacked_params(dtype)
    opt = make(LRS, **extra)
    state = opt.init(params)
    members = [make(float(lr), **extra) for lr in LRS]
    own = [mt.tree.map(lambda t, m=m: t[m].clone(), params) for m in range(len(LRS))]
    own_states = [o.init(p) for o, p in zip(members, own, strict=True)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = mt.tree.map(lambda t: torch.randn(t.shape, generator=g, dtype=dtype), params)
        params, state = opt.update(grads, state, params)
        for m, o in enumerate(members):
            own[m], own_states[m] = o.update(mt.tree.map(lambda t, m=m: t[m], grads),
                                             own_states[m], own[m])
    tolerance = {} if dtype is torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for m in range(len(LRS)):
        torch.testing.assert_close(mt.tree.map(lambda t, m=m: t[m], params), own[m],
                                   **tolerance)
    assert torch.equal(state[-1].lr, LRS)


def test_float32_members_run_as_one_kernel_call(monkeypatch):
    if not streaming.available():
        pytest.fail("the C kernels are not built here: no C compiler?")
    calls = []
    launch = streaming.launch
    monkeypatch.setattr(streaming, "launch", lambda *a, **k: (calls.append(a), launch(*a, **k)))
    params = _stacked_params(torch.float32)
    opt = mt.optim.adam(LRS)
    kernel = opt.update(mt.tree.map(torch.ones_like, params), opt.init(params), params)[0]
    assert len(calls) == 1 and len(calls[0][1]) == 3 * len(LRS)  # a row per (leaf, member)
    chain = mt.optim.chain(mt.optim.scale_by_adam(), mt.optim.scale_by_learning_rate(LRS))
    updates, _ = chain.update(mt.tree.map(torch.ones_like, params), chain.init(params))
    torch.testing.assert_close(kernel, mt.optim.apply_updates(params, updates))


@pytest.mark.parametrize("lr, message", [
    (torch.tensor([0.1, -0.1, 0.1, 0.1]), "non-negative"),
    (torch.tensor([1, 2, 3, 4]), "floating-point"),
    (torch.ones(2, 2), "one element"),
])
def test_a_bad_learning_rate_per_member_is_refused_at_build(lr, message):
    with pytest.raises(ValueError, match=message):
        mt.optim.adam(lr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_members_that_do_not_match_the_lr_are_named(dtype):
    opt = mt.optim.adam(LRS[:3])
    params = _stacked_params(dtype)
    with pytest.raises(ValueError, match=r"leaf 0 has shape \(4, 3, 2\); stack the members"):
        opt.update(mt.tree.map(torch.ones_like, params), opt.init(params), params)


@pytest.mark.parametrize("name", sorted(ONE_LR))
def test_optimizers_with_one_lr_refuse_a_learning_rate_per_member(name):
    with pytest.raises(ValueError, match="one element"):
        getattr(mt.optim, name)(LRS)


def test_learning_rate_of_a_per_member_state_names_the_field():
    params = _stacked_params(torch.float32)
    state = mt.optim.adam(LRS).init(params)
    with pytest.raises(ValueError, match="with one learning rate"):
        mt.optim.learning_rate(state)
    assert torch.equal(state[-1].lr, LRS)
