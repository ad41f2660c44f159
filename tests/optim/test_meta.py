"""Differentiating through unrolled updates (``mt.optim.unroll``), checked against central
finite differences; an lr schedule whose value carries a gradient; vmap over float64
hyperparameters with float32 params (as a sweep passes them).

Everything runs in float64 unless said: a validation loss after K updates is a smooth function of
the lr, the weight decay and the initial params, and its derivative by autograd or
``torch.func.grad`` must equal ``(f(x + h) - f(x - h)) / 2h`` (h = 1e-6, rtol 1e-6). Every
optimizer's hyperparameters, one by one: ``test_unrolled_every_optimizer.py``.
"""

import collections
import copy
import copyreg
import pickle

import pytest
import torch

import minitrain as mt

F64 = torch.float64
H = 1e-6


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, 3, generator=g, dtype=F64)  # 4 training batches of 6 examples
    w_true = torch.randn(3, generator=g, dtype=F64)
    y = torch.tanh(x @ w_true) + 0.1 * torch.randn(4, 6, generator=g, dtype=F64)
    params = {"w": 0.3 * torch.randn(3, generator=g, dtype=F64), "b": torch.zeros((), dtype=F64)}
    val_x = torch.randn(16, 3, generator=g, dtype=F64)
    return params, list(zip(x, y, strict=True)), (val_x, torch.tanh(val_x @ w_true))


def loss_fn(params, batch):
    x, y = batch
    return ((torch.tanh(x @ params["w"] + params["b"]) - y) ** 2).mean()


OPTIMIZERS = {
    "sgd": lambda lr, wd: mt.optim.sgd(lr=lr, momentum=0.9, nesterov=True, weight_decay=wd),
    "adam": lambda lr, wd: mt.optim.adam(lr=lr, weight_decay=wd),
    "adamw": lambda lr, wd: mt.optim.adamw(lr=lr, weight_decay=wd),
    "rmsprop": lambda lr, wd: mt.optim.rmsprop(lr=lr, momentum=0.5, weight_decay=wd),
    "adagrad": lambda lr, wd: mt.optim.adagrad(lr=lr, weight_decay=wd),
    "sgd-schedule": lambda lr, wd: mt.optim.sgd(
        lr=mt.optim.step_schedule(lr, 1, gamma=0.7), weight_decay=wd),
    "chain": lambda lr, wd: mt.optim.chain(
        mt.optim.scale_by_adam(), mt.optim.add_decayed_weights(wd),
        mt.optim.scale_by_learning_rate(lr)),
}


def validation_loss(make, lr, wd, params, batches, val):
    out = mt.optim.unroll(make(lr, wd), loss_fn, params, batches)
    return loss_fn(out.params, val)


def central_difference(f, x):
    return (f(x + H) - f(x - H)) / (2 * H)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_hypergradients_by_autograd_equal_finite_differences(name):
    make = OPTIMIZERS[name]
    params, batches, val = problem()
    lr0, wd0 = 0.05, 0.1
    lr = torch.tensor(lr0, dtype=F64, requires_grad=True)
    wd = torch.tensor(wd0, dtype=F64, requires_grad=True)
    # The params require no grad: only the hyperparameters do.
    d_lr, d_wd = torch.autograd.grad(validation_loss(make, lr, wd, params, batches, val), (lr, wd))
    with torch.no_grad():
        fd_lr = central_difference(
            lambda v: validation_loss(make, torch.tensor(v, dtype=F64), wd0, params, batches, val),
            lr0)
        fd_wd = central_difference(
            lambda v: validation_loss(make, lr0, torch.tensor(v, dtype=F64), params, batches, val),
            wd0)
    assert abs(float(d_lr)) > 1e-4
    torch.testing.assert_close(d_lr, fd_lr, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(d_wd, fd_wd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_hypergradient_by_torch_func_grad_over_the_whole_loop(name):
    make = OPTIMIZERS[name]
    params, batches, val = problem(1)

    def f(lr):
        return validation_loss(make, lr, 0.1, params, batches, val)

    lr = torch.tensor(0.05, dtype=F64)
    with torch.no_grad():
        expected = central_difference(f, lr)
    torch.testing.assert_close(torch.func.grad(f)(lr), expected, rtol=1e-6, atol=1e-9)


def test_gradient_with_respect_to_the_initialization():
    """MAML's meta-gradient: d val_loss(unroll(params0)) / d params0, along random directions."""
    params, batches, val = problem(2)
    opt = mt.optim.sgd(lr=0.3)

    def f(init):
        return loss_fn(mt.optim.unroll(opt, loss_fn, init, batches).params, val)

    meta_grad = torch.func.grad(f)(params)
    by_autograd = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    autograd_grad = torch.autograd.grad(f(by_autograd), list(by_autograd.values()))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        direction = {k: torch.randn(v.shape, generator=g, dtype=F64) for k, v in params.items()}
        with torch.no_grad():
            fd = central_difference(
                lambda t, d=direction: f({k: params[k] + t * d[k] for k in params}), 0.0)
        directional = sum((meta_grad[k] * direction[k]).sum() for k in params)
        torch.testing.assert_close(directional, fd, rtol=1e-6, atol=1e-9)
    for a, b in zip(autograd_grad, meta_grad.values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_unroll_with_a_gradient_transformation_and_returned_losses():
    params, batches, _ = problem(4)
    lr = torch.tensor(0.2, dtype=F64, requires_grad=True)
    descent = mt.optim.reduce_on_plateau(lr=1.0, patience=10)  # no reduction in 4 updates

    class Scaled:  # a minimal transformation: -lr * grads, then reduce_on_plateau (fed 0.0)
        def init(self, params):
            return descent.init(params)

        def update(self, grads, state, params=None):
            return descent.update({k: -lr * v for k, v in grads.items()}, state, value=0.0)

    out = mt.optim.unroll(Scaled(), loss_fn, params, batches)
    sgd = mt.optim.unroll(mt.optim.sgd(lr=lr), loss_fn, params, batches)
    assert out.losses.shape == (4,)
    torch.testing.assert_close(out.losses, sgd.losses)
    torch.testing.assert_close(out.params, sgd.params)
    assert out.params["w"].requires_grad


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("make", [lambda: mt.optim.sgd(lr=0.1), lambda: mt.optim.adam(lr=0.1)])
def test_unrolled_state_and_losses_read_later_are_those_of_the_updates(make, mode):
    """Read after the mode changed, in any order, the state and losses are what the updates
    left, still differentiable; the result unpacks, indexes and names its leaves as a tuple."""
    params, batches, _ = problem(3)
    expected = _updated(make(), params, batches)
    out = mt.optim.unroll(make(), loss_fn, params, batches)
    with mode():
        losses, state = out.losses, out.state
    assert losses.requires_grad and not losses.is_inference() and len(out) == 3
    assert out.losses is losses and out.state is state
    assert mt.tree.structure(state) == mt.tree.structure(expected[1])
    for got, want in zip(mt.tree.leaves(out), mt.tree.leaves(expected), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-15, atol=1e-15)
    unpacked = tuple(out)
    assert unpacked == (out[0], out[1], out[2]) and out[1:] == unpacked[1:]
    assert unpacked[0] is out.params and out._fields == ("params", "state", "losses")
    names = [name for name, _ in mt.tree.named_leaves(out)]
    assert names[:2] == ["params.w", "params.b"] and names[-1] == "losses", names  # as a tuple's
    assert repr(out).startswith("Unrolled(params={")
    fresh = mt.optim.unroll(make(), loss_fn, mt.tree.map(torch.detach, params), batches)
    as_tuple = copyreg.__newobj__(type(fresh), *_updated(make(), params, batches))  # (pickled
    for copied in (pickle.loads(pickle.dumps(fresh)), copy.copy(fresh), as_tuple):  # as a tuple)
        for got, want in zip(mt.tree.leaves(copied), mt.tree.leaves(expected), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)


PLAIN_SGD = {  # every form whose update is p - lr g: unroll adds it a leaf, the state built once
    "sgd": lambda: mt.optim.sgd(lr=0.1), "sgd wd=0 masked": lambda: mt.optim.sgd(
        lr=0.1, weight_decay=0.0, mask={"w": True, "b": False}),
    "sgd momentum=0 dampening": lambda: mt.optim.sgd(lr=0.1, momentum=0.0, dampening=0.5),
    "chain": lambda: mt.optim.as_optimizer(mt.optim.chain(mt.optim.scale_by_learning_rate(0.1))),
    "chain decay 0": lambda: mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.add_decayed_weights(0.0), mt.optim.scale_by_learning_rate(0.1))),
}


def _updated(opt, params, batches):
    """The optimizer's own updates, one per batch, as a loop writes them."""
    state, losses = opt.init(params), []
    for batch in batches:
        loss, grads = mt.value_and_grad(loss_fn)(params, batch)
        params, state = opt.update(grads, state, params)
        losses.append(loss)
    return params, state, torch.stack(losses)


PARAM_TREES = {  # (build from w and b, get w and b back): unroll's plain-SGD path for each
    "dict": (lambda w, b: {"w": w, "b": b}, lambda p: (p["w"], p["b"])),
    "dict, b first": (lambda w, b: {"b": b, "w": w}, lambda p: (p["w"], p["b"])),
    "OrderedDict": (lambda w, b: collections.OrderedDict(w=w, b=b), lambda p: (p["w"], p["b"])),
    "int keys": (lambda w, b: {1: w, 0: b}, lambda p: (p[1], p[0])),
    "nested": (lambda w, b: {"layer": [w, {"b": b}]},
               lambda p: (p["layer"][0], p["layer"][1]["b"])),
    "tuple": (lambda w, b: (w, b), lambda p: p),
}


@pytest.mark.parametrize("tree", sorted(PARAM_TREES))
def test_unrolled_plain_sgd_keeps_every_params_tree_and_its_updates(tree):
    build, get = PARAM_TREES[tree]
    params, batches, _ = problem(6)
    start, sgd, inits = build(params["w"], params["b"]), mt.optim.sgd(lr=0.1), []
    counted = sgd._replace(init=lambda p: inits.append(p) or sgd.init(p))  # the chain's start
    out = mt.optim.unroll(counted, lambda p, batch: loss_fn(
        dict(zip("wb", get(p), strict=True)), batch), start, batches)
    assert inits == []  # one op a leaf: the chain never ran
    assert mt.tree.structure(out.params) == mt.tree.structure(start)
    assert type(out.params) is type(start)
    expected = _updated(mt.optim.sgd(lr=0.1), params, batches)[0]
    for got, want in zip(get(out.params), (expected["w"], expected["b"]), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "vmap"])
@pytest.mark.parametrize("name", sorted(PLAIN_SGD))
def test_unrolled_plain_sgd_is_the_optimizers_own_updates(name, mode):
    opt, (params, batches, _) = PLAIN_SGD[name](), problem(5)
    if mode == "vmap":  # three initializations as one: each member's own run
        starts = [mt.tree.map(lambda t, i=i: t + i, params) for i in range(3)]
        out = mt.vmap(lambda p: mt.optim.unroll(opt, loss_fn, p, batches))(mt.tree.stack(starts))
        for i, start in enumerate(starts):
            expected = _updated(opt, start, batches)
            torch.testing.assert_close(mt.tree.map(lambda t, i=i: t[i], out.params), expected[0])
            torch.testing.assert_close(out.losses[i], expected[2])
        return
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        out = mt.optim.unroll(opt, loss_fn, params, batches)
    expected = _updated(opt, params, batches)
    assert mt.tree.structure(out.state) == mt.tree.structure(expected[1])
    for got, want in zip(mt.tree.leaves(out), mt.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.detach(), want, rtol=1e-15, atol=1e-15)
    assert out.params["w"].requires_grad == (mode == "grad")


def test_unroll_bad_input():
    params, batches, _ = problem()
    with pytest.raises(ValueError, match="no batches"):
        mt.optim.unroll(mt.optim.sgd(lr=0.1), loss_fn, params, [])
    with pytest.raises(ValueError, match="init, update"):
        mt.optim.unroll(torch.optim.SGD, loss_fn, params, batches)


ONE_UPDATE = {
    **{name: OPTIMIZERS[name] for name in ("sgd", "adam", "adamw", "rmsprop", "adagrad",
                                           "chain")},
    "lion": lambda lr, wd: mt.optim.lion(lr=lr, weight_decay=wd),
    "nadam": lambda lr, wd: mt.optim.nadam(lr=lr, weight_decay=wd),
    "radam": lambda lr, wd: mt.optim.radam(lr=lr, weight_decay=wd, decoupled_weight_decay=True),
    "adamax": lambda lr, wd: mt.optim.adamax(lr=lr, weight_decay=wd),
    "sign-chain": lambda lr, wd: mt.optim.chain(
        mt.optim.scale_by_sign(), mt.optim.add_decayed_weights(wd),
        mt.optim.scale_by_learning_rate(lr)),
}


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", sorted(ONE_UPDATE))
def test_a_tensor_lr_that_requires_grad_takes_the_plain_path(name, donate):
    """Plain params and grads (no grad required, the fast path's inputs) with an lr and weight
    decay that require grad: the update stays differentiable, equal to torch.func.grad."""
    make = ONE_UPDATE[name]
    params, batches, val = problem(4)
    grads = [mt.value_and_grad(loss_fn)(params, batch)[1] for batch in batches[:2]]

    def f(lr, wd):
        opt = make(lr, wd)
        opt = opt if isinstance(opt, mt.optim.Optimizer) else mt.optim.as_optimizer(opt)
        p, state = params, opt.init(params)
        for g in grads:
            p, state = opt.update(g, state, p, donate=donate)
        return loss_fn(p, val)

    lr = torch.tensor(0.05, dtype=F64, requires_grad=True)
    wd = torch.tensor(0.1, dtype=F64, requires_grad=True)
    out = f(lr, wd)
    assert out.requires_grad
    d_lr, d_wd = torch.autograd.grad(out, (lr, wd))
    want_lr, want_wd = torch.func.grad(f, argnums=(0, 1))(lr.detach(), wd.detach())
    assert abs(float(want_lr)) > 1e-4
    torch.testing.assert_close(d_lr, want_lr, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d_wd, want_wd, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# A schedule's gradient, through every optimizer's update


# An lr schedule whose value carries a gradient (``lambda step: x * decay(step)``, x a
# hyperparameter being tuned) keeps it through every optimizer's update, as a tensor lr does:
# the fast paths, which detach their scalars, used to take such updates whenever the params
# needed no grad, and the hypergradient was silently lost.

optim = mt.optim
FAMILY = ["sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax", "nadam",
          "radam", "adafactor", "lion", "muon"]
CHAINS = {
    "adam_chain": lambda lr: optim.as_optimizer(optim.chain(optim.scale_by_adam(),
                                                    optim.scale_by_learning_rate(lr))),
    "clip_adamw_chain": lambda lr: optim.as_optimizer(optim.chain(
        optim.clip_by_global_norm(1.0), optim.scale_by_adam(), optim.add_decayed_weights(0.1),
        optim.scale_by_learning_rate(lr))),
    "momentum_chain": lambda lr: optim.as_optimizer(optim.chain(optim.trace(0.9),
                                                        optim.scale_by_learning_rate(lr))),
    "rms_chain": lambda lr: optim.as_optimizer(optim.chain(optim.scale_by_rms(),
                                                   optim.scale_by_learning_rate(lr))),
}
MAKERS = {**{name: (lambda lr, name=name: getattr(optim, name)(lr=lr)) for name in FAMILY},
          **CHAINS}


def hypergradient(make, lr_of, dtype=torch.float32, steps=2):
    """d/dx of the params' squared norm after ``steps`` updates, with lr ``lr_of(x)``."""
    x = torch.tensor(0.1, dtype=dtype, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 8, generator=g, dtype=dtype)}
    opt = make(lr_of(x))
    state = opt.init(params)
    for _ in range(steps):
        grads = {"w": torch.randn(8, 8, generator=g, dtype=dtype)}
        params, state = opt.update(grads, state, params)
    loss = (params["w"].double() ** 2).sum()
    assert loss.requires_grad, "the update dropped the lr's gradient"
    return torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_schedules_gradient_equals_a_tensor_lrs(name):
    through_schedule = hypergradient(MAKERS[name], lambda x: (lambda step: x * 1.0))
    through_tensor = hypergradient(MAKERS[name], lambda x: x)
    assert abs(float(through_tensor)) > 1e-6
    torch.testing.assert_close(through_schedule, through_tensor, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("name", ["adam", "sgd", "adafactor", "muon", "adam_chain",
                                  "momentum_chain"])
def test_a_step_dependent_schedules_gradient_matches_finite_differences(name):
    decay = lambda x: (lambda step: x * (1.0 + step) / 2)  # noqa: E731
    make = MAKERS[name]
    if name == "muon":  # Newton-Schulz in bfloat16: the loss is smooth in lr all the same
        got = hypergradient(make, decay)
    else:
        got = hypergradient(make, decay, dtype=torch.float64)
    h = 1e-4 if name == "muon" else 1e-6
    dtype = torch.float32 if name == "muon" else torch.float64

    def loss_at(value):
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            params = {"w": torch.randn(8, 8, generator=g, dtype=dtype)}
            opt = make(decay(value))
            state = opt.init(params)
            for _ in range(2):
                params, state = opt.update({"w": torch.randn(8, 8, generator=g, dtype=dtype)},
                                           state, params)
            return float((params["w"].double() ** 2).sum())

    expected = (loss_at(0.1 + h) - loss_at(0.1 - h)) / (2 * h)
    assert float(got) == pytest.approx(expected, rel=2e-3 if name == "muon" else 1e-5)


@pytest.mark.parametrize("name", ["adam", "adamw", "adam_chain", "muon", "adafactor"])
def test_without_grad_mode_a_schedule_still_gives_the_floats_update(name):
    x = torch.tensor(0.1, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 8, generator=g)}
    grads = {"w": torch.randn(8, 8, generator=g)}
    with torch.no_grad():
        opt = MAKERS[name](lambda step: x * 1.0)
        got, _ = opt.update(grads, opt.init(params), params)
    plain = MAKERS[name](lambda step: 0.1)
    want, _ = plain.update(grads, plain.init(params), params)
    assert not got["w"].requires_grad
    torch.testing.assert_close(got["w"], want["w"], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# vmap over float64 betas (or a centered RMSprop's alpha) with float32 params: lerp wants a
# batched weight in its input's dtype (it raised "expected dtype float for `weight` but got
# dtype double")


FLOAT64_BETAS = {
    "adam": lambda b: mt.optim.adam(lr=0.1, betas=(b, b * 0 + 0.999)),
    "adamax": lambda b: mt.optim.adamax(lr=0.1, betas=(b, b * 0 + 0.999)),
    "nadam": lambda b: mt.optim.nadam(lr=0.1, betas=(b, b * 0 + 0.999)),
    "radam": lambda b: mt.optim.radam(lr=0.1, betas=(b, b * 0 + 0.999)),
    "lion": lambda b: mt.optim.lion(lr=0.1, betas=(b, b * 0 + 0.99)),
    "rmsprop_centered": lambda b: mt.optim.rmsprop(lr=0.1, alpha=b, centered=True),
}


@pytest.mark.parametrize("name", sorted(FLOAT64_BETAS))
def test_vmap_over_float64_values_with_float32_params_equals_separate_runs(name):
    g = torch.Generator().manual_seed(0)
    params, grads = torch.randn(5, generator=g), torch.randn(5, generator=g)

    def three_updates(value):
        opt = FLOAT64_BETAS[name](value)
        p, state = [params], opt.init([params])
        for scale in (1.0, -0.5, 2.0):
            p, state = opt.update([grads * scale], state, p)
        return p[0]

    values = torch.tensor([0.8, 0.9, 0.95], dtype=torch.float64)
    got = torch.func.vmap(three_updates)(values)
    assert got.dtype == torch.float32
    want = torch.stack([three_updates(float(v)) for v in values])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
