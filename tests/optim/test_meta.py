"""Differentiating through unrolled updates, checked against central finite differences.

Everything runs in float64: a validation loss after K updates is a smooth function of the lr,
the weight decay and the initial params, and its derivative by autograd or ``torch.func.grad``
must equal ``(f(x + h) - f(x - h)) / 2h`` (h = 1e-6, rtol 1e-6).
"""

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
        lr=mt.optim.exponential_schedule(lr, gamma=0.7), weight_decay=wd),
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
