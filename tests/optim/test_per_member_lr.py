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
o = mt.optim
RULES = {  # a chain before its -lr; each member's update reads its own slices only
    "sgd": lambda: [], "trace nesterov": lambda: [o.trace(0.9, nesterov=True)],
    "adam": lambda: [o.scale_by_adam()], "adam amsgrad": lambda: [o.scale_by_adam(amsgrad=True)],
    "adam eps_root": lambda: [o.scale_by_adam(eps_root=1e-8)],
    "adamw": lambda: [o.scale_by_adam(), o.add_decayed_weights(0.1)],
    "l2 adam": lambda: [o.add_decayed_weights(0.1), o.scale_by_adam()],
    "adagrad": lambda: [o.scale_by_adagrad(0.01)], "rms": lambda: [o.scale_by_rms()],
    "adadelta": lambda: [o.scale_by_adadelta()], "adamax": lambda: [o.scale_by_adamax()],
    "lion": lambda: [o.scale_by_lion()], "nadam": lambda: [o.scale_by_nadam()],
    "radam": lambda: [o.scale_by_radam()], "belief": lambda: [o.scale_by_belief()],
    "yogi": lambda: [o.scale_by_yogi()], "sign": lambda: [o.scale_by_sign()],
}
LR_NAMES = ("lr", "learning_rate", "scaling")  # (polyak's max_learning_rate: one number)
REQUIRED = {"dpsgd": {"l2_norm_clip": 1.0, "noise_multiplier": 0.0, "key": 0}}


def _stacked_params(dtype):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, 2, generator=g, dtype=dtype),
            "b": torch.randn(4, 2, generator=g, dtype=dtype), "s": torch.randn(4, generator=g,
                                                                                dtype=dtype)}


def _per_member(rule, lr):
    return o.as_optimizer(o.chain(*RULES[rule](), o.scale_by_learning_rate(lr)))


def _takes_an_lr():
    for name in o.__all__:
        value = getattr(o, name)
        if inspect.isfunction(value) and name != "scale_by_learning_rate":
            for parameter in inspect.signature(value).parameters:
                if parameter in LR_NAMES:
                    yield name, parameter


def test_the_lr_class_is_not_empty():
    assert {"adam", "sgd", "dpsgd", "muon", "polyak_sgd"} <= {n for n, _ in _takes_an_lr()}


@pytest.mark.parametrize("name, parameter", sorted(_takes_an_lr()))
def test_every_optimizer_takes_one_lr_as_torch_optim_does(name, parameter):
    with pytest.raises(ValueError, match=f"invalid {parameter}: .* one element.*"
                                         "scale_by_learning_rate"):
        getattr(o, name)(**{parameter: LRS, **REQUIRED.get(name, {})})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_learning_rate_per_member_is_each_members_own_run(rule, dtype):
    params = _stacked_params(dtype)
    opt = _per_member(rule, LRS)
    state = opt.init(params)
    members = [_per_member(rule, float(lr)) for lr in LRS]
    own = [mt.tree.map(lambda t, m=m: t[m].clone(), params) for m in range(len(LRS))]
    own_states = [m.init(p) for m, p in zip(members, own, strict=True)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = mt.tree.map(lambda t: torch.randn(t.shape, generator=g, dtype=dtype), params)
        params, state = opt.update(grads, state, params)
        for m, member in enumerate(members):
            own[m], own_states[m] = member.update(mt.tree.map(lambda t, m=m: t[m], grads),
                                                  own_states[m], own[m])
    tolerance = {} if dtype is torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for m in range(len(LRS)):
        torch.testing.assert_close(mt.tree.map(lambda t, m=m: t[m], params), own[m],
                                   **tolerance)
    assert torch.equal(state[-1].lr, LRS)


@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_updates_keep_the_grads_dtype_whatever_the_lrs_dtype(dtype, lr_dtype):
    """As with a 0-d lr: the lrs are cast to each leaf's dtype, never promote the updates."""
    params, lrs = _stacked_params(dtype), LRS.to(lr_dtype)
    grads = mt.tree.map(torch.ones_like, params)
    tx = o.chain(o.scale_by_adam(), o.scale_by_learning_rate(lrs))
    updates, _ = tx.update(grads, tx.init(params), params)
    assert all(u.dtype == dtype for u in mt.tree.leaves(updates))
    one = o.chain(o.scale_by_adam(), o.scale_by_learning_rate(lrs[1].clone()))  # a 0-d lr
    torch.testing.assert_close(mt.tree.map(lambda u: u[1], updates),
                               mt.tree.map(lambda u: u[1], one.update(grads, one.init(params))[0]))


def test_a_vmapped_sweep_over_learning_rates_per_member_is_each_sweeps_own_run():
    """``lrs`` batched under vmap (two sweeps of four members' lrs) builds inside the function."""
    params, sweeps = _stacked_params(torch.float32), torch.stack([LRS, LRS.flip(0)])
    grads = mt.tree.map(torch.ones_like, params)

    def run(lrs):
        opt = _per_member("adam", lrs)
        return opt.update(grads, opt.init(params), params)[0]

    for got, lrs in zip(mt.tree.unstack(mt.vmap(run)(sweeps)), sweeps, strict=True):
        torch.testing.assert_close(got, run(lrs))


def test_float32_members_run_as_one_kernel_call(monkeypatch):
    if not streaming.available():
        pytest.fail("the C kernels are not built here: no C compiler?")
    calls = []
    launch = streaming.launch
    monkeypatch.setattr(streaming, "launch", lambda *a, **k: (calls.append(a), launch(*a, **k)))
    params = _stacked_params(torch.float32)
    opt = _per_member("adam", LRS)
    grads = mt.tree.map(torch.ones_like, params)
    kernel = opt.update(grads, opt.init(params), params)[0]
    assert len(calls) == 1 and len(calls[0][1]) == len(LRS)  # a row of numbers per member
    chain = o.chain(o.scale_by_adam(), o.scale_by_learning_rate(LRS))  # unlowered
    updates, _ = chain.update(grads, chain.init(params))
    torch.testing.assert_close(kernel, o.apply_updates(params, updates))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_donated_members_are_written_in_place_and_equal_the_undonated(rule):
    """Every rule, float32, 5 steps: ``donate=True`` writes the params and state in place (their
    storage kept, versions bumped) with the same numbers as new buffers get; a grad that is its
    param (storages that meet) takes new buffers instead, with the same numbers again."""
    opt, params = _per_member(rule, LRS), _stacked_params(torch.float32)
    kept, donated = (params, opt.init(params)), mt.tree.map(torch.clone, (params, opt.init(params)))
    for step in range(5):
        grads = mt.tree.map(lambda t, step=step: torch.sin(t * (step + 1)), kept[0])
        pointers = [t.data_ptr() for t in mt.tree.leaves(donated[0])]
        versions = [t._version for t in mt.tree.leaves(donated[0])]
        kept = opt.update(grads, kept[1], kept[0])
        donated = opt.update(mt.tree.map(torch.clone, grads), donated[1], donated[0], donate=True)
        assert [t.data_ptr() for t in mt.tree.leaves(donated[0])] == pointers
        bumped = zip(mt.tree.leaves(donated[0]), versions, strict=True)
        assert all(t._version > v for t, v in bumped)
        for a, b in zip(mt.tree.leaves(kept), mt.tree.leaves(donated), strict=True):
            assert torch.equal(a, b)
    aliased = mt.tree.map(torch.clone, donated)
    params, _ = opt.update(aliased[0], aliased[1], aliased[0], donate=True)  # grads = params
    want, _ = opt.update(mt.tree.map(torch.clone, donated[0]), *donated[1:], donated[0])
    assert all(torch.equal(a, b) for a, b in zip(mt.tree.leaves(params), mt.tree.leaves(want),
                                                 strict=True))


@pytest.mark.parametrize("lr, message", [
    (torch.tensor([0.1, -0.1, 0.1, 0.1]), "non-negative"),
    (torch.tensor([1, 2, 3, 4]), "floating-point"),
    (torch.ones(2, 2), "one element"),
])
def test_a_bad_learning_rate_per_member_is_refused_at_build(lr, message):
    with pytest.raises(ValueError, match=message):
        o.scale_by_learning_rate(lr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_members_that_do_not_match_the_lr_are_named(dtype):
    opt = _per_member("adam", LRS[:3])
    params = _stacked_params(dtype)
    with pytest.raises(ValueError, match=r"leaf 0 has shape \(4, 3, 2\); stack the members"):
        opt.update(mt.tree.map(torch.ones_like, params), opt.init(params), params)


def test_learning_rate_of_a_per_member_state_names_the_field():
    params = _stacked_params(torch.float32)
    state = _per_member("adam", LRS).init(params)
    with pytest.raises(ValueError, match="with one learning rate"):
        o.learning_rate(state)
    assert torch.equal(state[-1].lr, LRS)
