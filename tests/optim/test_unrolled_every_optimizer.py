"""Every optimizer of the family, differentiated through K unrolled pure updates.

For each optimizer and each tensor hyperparameter it takes: the hypergradient of a validation
loss after K updates, by autograd and by ``torch.func.grad``, against central finite
differences (float64); ``torch.func.vmap`` over a batch of 3 values of the hyperparameter
against a loop of separate runs; and, per optimizer, the gradient with respect to the
initialization (MAML) against finite differences along random directions.

Every optimizer of ``mt.optim.__init__``'s family is here (NAdam and RAdam in both weight-decay
modes), with a hand-built chain (global-norm clip, Adam, decay, a schedule),
``inject_hyperparams``, and the chains of SGD, AdaGrad and RMSprop through ``as_optimizer``
(their transformations' hyperparameters: trace's dampening, scale_by_adagrad's and
scale_by_rms's). Exceptions to "K=3, float64 finite differences at rtol 1e-5": RAdam
takes 7 updates (its rectified branch starts at update 6); NAdam's mu_product is held in
float32 as torch holds it, so its finite differences take a larger step and
rtol 2e-3; Muon orthogonalizes in bfloat16 (as torch.optim.Muon), so its
hypergradients are checked over one update (lr, weight_decay), or against each other only
(momentum, eps, the Newton-Schulz coefficients, the initialization), and its vmap members to
bfloat16 rounding.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor

import minitrain as mt
from tests.optim.conftest import OPTIMIZERS as REGISTRY

F64 = torch.float64
K = 3
optim = mt.optim


def pair(a: Any, b: Any) -> tuple[Any, Any]:
    """``betas``-like pairs: both numbers, or (torch.optim refuses a mix) both tensors."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    return a, b


class Opt(NamedTuple):
    make: Any  # (**hyperparameters) -> optimizer or gradient transformation
    defaults: dict[str, float]  # the point at which derivatives are taken
    matrix_only: bool = False  # Muon: 2-D params only
    steps: int = K
    hyper_steps: int | None = None  # updates for the hypergradient checks (default: steps)
    maml: bool = True  # whether to check the gradient with respect to the initialization


def _chain(lr, max_norm, beta1, beta2, eps, weight_decay, gamma):
    # eps=0.1: with Adam's default 1e-8 its direction is invariant to the clip's scale
    return optim.chain(
        optim.clip_by_global_norm(max_norm), optim.scale_by_adam(beta1, beta2, eps=eps),
        optim.add_decayed_weights(weight_decay),
        optim.scale_by_learning_rate(optim.step_schedule(lr, 1, gamma=gamma)))


def _adamw_chain(lr, weight_decay, b1=0.9, b2=0.99):
    return optim.chain(optim.scale_by_adam(b1, b2), optim.add_decayed_weights(weight_decay),
                       optim.scale_by_learning_rate(lr))


def _injected(lr, weight_decay):
    return optim.inject_hyperparams(_adamw_chain)(lr=lr, weight_decay=weight_decay)


OPTIMIZERS: dict[str, Opt] = {
    "sgd": Opt(lambda lr, momentum, weight_decay: optim.sgd(
        lr=lr, momentum=momentum, nesterov=True, weight_decay=weight_decay),
        dict(lr=0.1, momentum=0.9, weight_decay=0.05)),
    "sgd-dampening": Opt(lambda dampening: optim.sgd(  # nesterov takes no dampening
        lr=0.1, momentum=0.9, dampening=dampening, weight_decay=0.05), dict(dampening=0.3)),
    "sgd_chain": Opt(lambda dampening: optim.as_optimizer(optim.chain(  # trace's dampening
        optim.add_decayed_weights(0.05), optim.trace(0.9, dampening),
        optim.scale_by_learning_rate(0.1))), dict(dampening=0.3)),
    "adam": Opt(lambda lr, beta1, beta2, eps, weight_decay: optim.adam(
        lr=lr, betas=pair(beta1, beta2), eps=eps, weight_decay=weight_decay),
        dict(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-2, weight_decay=0.05)),
    "adam-amsgrad": Opt(lambda lr, beta2, eps: optim.adam(lr=lr, betas=pair(0.8, beta2), eps=eps,
                                                          amsgrad=True),
                        dict(lr=0.05, beta2=0.9, eps=1e-2)),
    "adamw": Opt(lambda lr, beta1, beta2, eps, weight_decay: optim.adamw(
        lr=lr, betas=pair(beta1, beta2), eps=eps, weight_decay=weight_decay),
        dict(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-2, weight_decay=0.2)),
    "adagrad": Opt(lambda lr, lr_decay, weight_decay, initial_accumulator_value, eps: optim.adagrad(
        lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
        initial_accumulator_value=initial_accumulator_value, eps=eps),
        dict(lr=0.1, lr_decay=0.1, weight_decay=0.05, initial_accumulator_value=0.1, eps=1e-2)),
    # scale_by_adagrad (the chain's plain path; its lowering for concrete values)
    "adagrad_chain": Opt(lambda lr_decay, initial_accumulator_value, eps: optim.as_optimizer(
        optim.chain(optim.add_decayed_weights(0.05),
                    optim.scale_by_adagrad(lr_decay, initial_accumulator_value, eps),
                    optim.scale_by_learning_rate(0.1))),
        dict(lr_decay=0.1, initial_accumulator_value=0.1, eps=1e-2)),
    "rmsprop": Opt(lambda lr, alpha, eps, weight_decay, momentum: optim.rmsprop(
        lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
        centered=True), dict(lr=0.01, alpha=0.9, eps=1e-2, weight_decay=0.05, momentum=0.5)),
    "rmsprop_chain": Opt(lambda alpha, eps: optim.as_optimizer(optim.chain(  # scale_by_rms
        optim.add_decayed_weights(0.05), optim.scale_by_rms(alpha, eps, centered=True),
        optim.trace(0.5), optim.scale_by_learning_rate(0.01))),
        dict(alpha=0.9, eps=1e-2)),
    "adadelta": Opt(lambda lr, rho, eps, weight_decay: optim.adadelta(
        lr=lr, rho=rho, eps=eps, weight_decay=weight_decay),
        dict(lr=1.0, rho=0.9, eps=1e-3, weight_decay=0.05)),
    "adafactor": Opt(lambda lr, beta2_decay, eps2, d, weight_decay: optim.adafactor(
        lr=lr, beta2_decay=beta2_decay, eps=(None, eps2), d=d, weight_decay=weight_decay),
        dict(lr=0.05, beta2_decay=-0.8, eps2=1e-3, d=1.01, weight_decay=0.1)),
    # eps1 = 1: the clamps it sets bind here (at 1e-3 the loss does not depend on it)
    "adafactor-eps1": Opt(lambda eps1: optim.adafactor(
        lr=0.05, eps=(eps1, 1e-3), d=1.01, weight_decay=0.1), dict(eps1=1.0)),
    "adamax": Opt(lambda lr, beta1, beta2, eps, weight_decay: optim.adamax(
        lr=lr, betas=pair(beta1, beta2), eps=eps, weight_decay=weight_decay),
        dict(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-2, weight_decay=0.05)),
    "nadam": Opt(lambda lr, beta1, beta2, eps, weight_decay, momentum_decay: optim.nadam(
        lr=lr, betas=pair(beta1, beta2), eps=eps, weight_decay=weight_decay,
        momentum_decay=momentum_decay),
        dict(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-2, weight_decay=0.05, momentum_decay=0.1)),
    "nadam-decoupled": Opt(lambda lr, beta1, weight_decay: optim.nadam(
        lr=lr, betas=pair(beta1, 0.9), eps=1e-2, weight_decay=weight_decay,
        momentum_decay=0.1, decoupled_weight_decay=True),
        dict(lr=0.05, beta1=0.8, weight_decay=0.2)),
    # 7 updates: RAdam's rectified branch starts at update 6 (rho_t > 5)
    "radam": Opt(lambda lr, beta1, beta2, eps, weight_decay: optim.radam(
        lr=lr, betas=pair(beta1, beta2), eps=eps, weight_decay=weight_decay),
        dict(lr=0.05, beta1=0.8, beta2=0.999, eps=1e-2, weight_decay=0.05), steps=7),
    "radam-decoupled": Opt(lambda lr, beta2, weight_decay: optim.radam(
        lr=lr, betas=pair(0.8, beta2), eps=1e-2, weight_decay=weight_decay,
        decoupled_weight_decay=True),
        dict(lr=0.05, beta2=0.999, weight_decay=0.2), steps=7),
    "muon": Opt(lambda lr, weight_decay, momentum: optim.muon(
        lr=lr, weight_decay=weight_decay, momentum=momentum),
        # one update for the hypergradients: Newton-Schulz runs in bfloat16 (as torch's), so
        # after it the loss is a bfloat16 step function of lr and weight_decay
        dict(lr=0.05, weight_decay=0.1, momentum=0.9), matrix_only=True, hyper_steps=1),
    # eps = 2 binds (the first update's norm is about 0.8; below it the loss does not depend on
    # eps); the initialization's gradient is the "muon" case's
    "muon-ns": Opt(lambda eps, ns_a, ns_b, ns_c: optim.muon(
        lr=0.05, weight_decay=0.1, momentum=0.9, ns_coefficients=(ns_a, ns_b, ns_c), eps=eps),
        dict(eps=2.0, ns_a=3.4445, ns_b=-4.775, ns_c=2.0315), matrix_only=True, hyper_steps=1,
        maml=False),
    "lion": Opt(lambda lr, beta1, beta2, weight_decay: optim.lion(
        lr=lr, betas=pair(beta1, beta2), weight_decay=weight_decay),
        dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.5)),
    "schedule_free_adamw": Opt(
        lambda lr, beta1, beta2, eps, weight_decay, r, weight_lr_power: optim.schedule_free_adamw(
            lr=lr, betas=pair(beta1, beta2), eps=eps, weight_decay=weight_decay,
            warmup_steps=2, r=r, weight_lr_power=weight_lr_power),
        dict(lr=0.05, beta1=0.9, beta2=0.9, eps=1e-2, weight_decay=0.05, r=0.5,
             weight_lr_power=2.0)),
    "chain": Opt(_chain, dict(lr=0.05, max_norm=0.5, beta1=0.8, beta2=0.9, eps=0.1,
                              weight_decay=0.05, gamma=0.7)),
    "inject_hyperparams": Opt(_injected, dict(lr=0.05, weight_decay=0.05)),
}


@functools.cache
def problem(matrix_only: bool = False, steps: int = K):
    """Linear regression, 3 -> 2, float64: init params, ``steps`` training batches, a
    validation batch (made once: no random ops under ``vmap``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps, 6, 3, generator=g, dtype=F64)
    w_true = torch.randn(3, 2, generator=g, dtype=F64)
    y = x @ w_true + 0.1 * torch.randn(steps, 6, 2, generator=g, dtype=F64)
    params = {"w": 0.3 * torch.randn(3, 2, generator=g, dtype=F64)}
    if not matrix_only:
        params["b"] = torch.zeros(2, dtype=F64)
    val_x = torch.randn(16, 3, generator=g, dtype=F64)
    return params, list(zip(x, y, strict=True)), (val_x, val_x @ w_true)


def loss_fn(params, batch):
    x, y = batch
    pred = x @ params["w"]
    if "b" in params:
        pred = pred + params["b"]
    return ((pred - y) ** 2).mean()


def run(name: str, hyper: dict[str, Any], params=None, steps: int | None = None):
    """The params after the optimizer's unrolled updates, with ``hyper`` over its defaults."""
    opt = OPTIMIZERS[name]
    init, batches, _ = problem(opt.matrix_only, opt.steps)
    return optim.unroll(opt.make(**{**opt.defaults, **hyper}), loss_fn,
                    init if params is None else params, batches[:steps]).params


def validation(name: str, hyper: dict[str, Any], params=None, steps: int | None = None):
    opt = OPTIMIZERS[name]
    _, _, val = problem(opt.matrix_only, opt.steps)
    return loss_fn(run(name, hyper, params, steps), val)


def five_point(f, x: float, h: float) -> float:
    """Central finite difference of order 4 (under no_grad)."""
    with torch.no_grad():
        return float((8 * (f(x + h) - f(x - h)) - (f(x + 2 * h) - f(x - 2 * h))) / (12 * h))


# ------------------------------------------------------------------------------------------
# What each case expects

# Finite-difference step (relative to the value) and rtol where 1e-4 and 1e-5 cannot hold.
FLOAT32_HELD = (1e-2, 2e-3)  # the loss is a float32 step function of this hyperparameter
FD = {
    ("nadam", "beta1"): FLOAT32_HELD,  # mu_product held in float32, as torch holds it
    ("nadam", "momentum_decay"): FLOAT32_HELD,
    ("nadam-decoupled", "beta1"): FLOAT32_HELD,
}
# No finite differences at all: the loss is a bfloat16 step function of the hyperparameter
# (Newton-Schulz's input is rounded to bfloat16); autograd and torch.func must agree instead.
NO_FD = {("muon", "momentum"), *(("muon-ns", hp) for hp in ("eps", "ns_a", "ns_b", "ns_c"))}
SIGN_BASED_ZERO = {("lion", "beta1"), ("lion", "beta2")}  # sign(...) of them: d/d = 0 a.e.
BELOW_ONE = ("beta1", "beta2", "rho", "momentum")


# vmap of Newton-Schulz's bfloat16 addmm rounds otherwise than addmm (torch's batching rule),
# and the iteration amplifies it: Muon's members match their runs to bfloat16 rounding only.
VMAP_TOLERANCE = {"muon": dict(rtol=2e-2, atol=2e-2), "muon-ns": dict(rtol=2e-2, atol=2e-2)}


def cases() -> list:
    return [pytest.param(name, hp, id=f"{name}-{hp}")
            for name, opt in OPTIMIZERS.items() for hp in opt.defaults]


@functools.cache
def finite_difference(name: str, hp: str) -> float:
    opt = OPTIMIZERS[name]
    value = opt.defaults[hp]
    rel, _ = FD.get((name, hp), (1e-4, 1e-5))
    # float64 tensors (inject_hyperparams would hold a Python float in float32)
    # a beta's scale is its distance to 1 as well (RAdam's rho_inf = 2 / (1 - beta2) - 1)
    scale = min(value, 1 - value) if hp in BELOW_ONE else abs(value)
    return five_point(lambda v: validation(
        name, {hp: torch.tensor(v, dtype=F64)}, steps=opt.hyper_steps),
        value, rel * scale)


def check_hypergradient(name: str, hp: str, got: Tensor, other) -> None:
    if (name, hp) in NO_FD:
        assert abs(float(got)) > 1e-4, "a vacuous check"
        torch.testing.assert_close(got, other(), rtol=1e-10, atol=1e-12)
        return
    want = torch.tensor(finite_difference(name, hp), dtype=F64)
    _, rtol = FD.get((name, hp), (1e-4, 1e-5))
    if (name, hp) in SIGN_BASED_ZERO:
        assert float(got) == 0.0 and float(want) == 0.0
    assert (name, hp) in SIGN_BASED_ZERO or abs(float(want)) > 1e-4, "a vacuous check"
    torch.testing.assert_close(got.detach(), want, rtol=rtol, atol=1e-9)


def autograd_hypergradient(name: str, hp: str) -> Tensor:
    opt = OPTIMIZERS[name]
    x = torch.tensor(opt.defaults[hp], dtype=F64, requires_grad=True)
    return torch.autograd.grad(validation(name, {hp: x}, steps=opt.hyper_steps), x)[0]


def func_hypergradient(name: str, hp: str) -> Tensor:
    opt = OPTIMIZERS[name]
    return torch.func.grad(lambda x: validation(name, {hp: x}, steps=opt.hyper_steps))(
        torch.tensor(opt.defaults[hp], dtype=F64))


def test_every_optimizer_of_the_registry_is_unrolled():
    unrolled = {name.split("-")[0] for name in OPTIMIZERS}
    assert {entry.alias for entry in REGISTRY} <= unrolled


# ------------------------------------------------------------------------------------------
# 1. Hypergradients


@pytest.mark.parametrize(("name", "hp"), cases())
def test_hypergradient_by_autograd(name, hp):
    check_hypergradient(name, hp, autograd_hypergradient(name, hp),
                        lambda: func_hypergradient(name, hp))


@pytest.mark.parametrize(("name", "hp"), cases())
def test_hypergradient_by_torch_func_grad(name, hp):
    check_hypergradient(name, hp, func_hypergradient(name, hp),
                        lambda: autograd_hypergradient(name, hp))


# ------------------------------------------------------------------------------------------
# 2. vmap over a hyperparameter


def sweep_values(hp: str, value: float) -> list[float]:
    step = (1 - value) / 2 if hp in BELOW_ONE else 0.2 * abs(value)
    if hp == "d":  # Adafactor's clipping threshold must stay >= 1
        step = 0.005
    if hp == "alpha" and value + step > 1:  # RMSprop's alpha must stay <= 1
        step = (1 - value) / 2
    if hp.startswith("ns_"):  # Newton-Schulz's coefficients: 20% off, its iteration diverges
        step = 0.02 * abs(value)
    return [value - step, value, value + step]


@pytest.mark.parametrize(("name", "hp"), cases())
def test_vmap_over_a_hyperparameter_equals_separate_runs(name, hp):
    opt = OPTIMIZERS[name]
    problem(opt.matrix_only, opt.steps)  # made outside vmap
    values = sweep_values(hp, opt.defaults[hp])
    try:
        batched = torch.func.vmap(lambda x: run(name, {hp: x}))(torch.tensor(values, dtype=F64))
    except ValueError as err:  # a refusal is fine when it is one line naming the argument
        message = str(err)
        assert "\n" not in message and hp.rstrip("12") in message, message
        return
    for index, value in enumerate(values):
        alone = run(name, {hp: torch.tensor(value, dtype=F64)})
        for key in alone:
            torch.testing.assert_close(batched[key][index], alone[key].detach(),
                                       **VMAP_TOLERANCE.get(name, dict(rtol=1e-10, atol=1e-12)))


# ------------------------------------------------------------------------------------------
# 3. The gradient with respect to the initialization (MAML)


@pytest.mark.parametrize("name", [name for name, opt in OPTIMIZERS.items() if opt.maml])
def test_gradient_with_respect_to_the_initialization(name):
    opt = OPTIMIZERS[name]
    init, _, _ = problem(opt.matrix_only, opt.steps)
    meta_grad = torch.func.grad(lambda p: validation(name, {}, p))(init)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in init.items()}
    by_autograd = torch.autograd.grad(validation(name, {}, leaves), list(leaves.values()))
    for a, b in zip(by_autograd, meta_grad.values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if name == "muon":
        return  # bfloat16 Newton-Schulz: no finite differences (see the report / NO_FD)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        direction = {k: torch.randn(v.shape, generator=g, dtype=F64) for k, v in init.items()}
        fd = five_point(lambda t, d=direction: validation(
            name, {}, {k: init[k] + t * d[k] for k in init}), 0.0, 1e-4)
        directional = sum(float((meta_grad[k] * direction[k]).sum()) for k in init)
        assert abs(fd) > 1e-3
        assert directional == pytest.approx(fd, rel=1e-6)


# torch's forward AD scripts its jvp decompositions on first use, with torch.jit's warning (a
# DeprecationWarning on torch 2.13, a FutureWarning on 2.14)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("entry", [e for e in REGISTRY if not e.matrices_only], ids=str)
def test_forward_mode_dual_tensors_keep_their_tangents_through_every_optimizer(entry):
    """``torch.autograd.forward_ad``'s dual params and grads (neither functorch-wrapped nor
    requiring grad): two updates give the tangents central finite differences give (float64),
    for every optimizer, pure and donated (a kernel on the primals alone would drop them)."""
    import torch.autograd.forward_ad as fw

    from tests.optim.conftest import make_grads, make_params

    params = mt.tree.map(lambda t: t.to(F64), make_params(entry))
    grads_seq = [mt.tree.map(lambda t: t.to(F64), g) for g in make_grads(params, 2)]
    directions = mt.tree.map(torch.ones_like, (params, grads_seq))
    opt = entry.make()

    def two_updates(p, gs):
        state = opt.init(p)
        for g in gs:
            p, state = opt.update(g, state, p)
        return p

    h = 1e-6
    ahead, behind = (two_updates(*mt.tree.map(lambda x, d, s=sign: x + s * h * d,
                                              (params, grads_seq), directions))
                     for sign in (1, -1))
    want = mt.tree.map(lambda a, b: (a - b) / (2 * h), ahead, behind)
    for donate in (False, True):
        with fw.dual_level():
            p, gs = mt.tree.map(fw.make_dual, (params, grads_seq), directions)
            state = opt.init(p)
            for g in gs:
                p, state = opt.update(g, state, p, donate=donate)
            got = mt.tree.map(lambda t: fw.unpack_dual(t).tangent, p)
        for name, tangent in mt.tree.named_leaves(got):
            assert tangent is not None, f"{name}: the tangent was dropped"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
