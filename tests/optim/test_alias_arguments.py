"""The aliases' arguments beyond the registry's configurations: values torch refuses, one-element
tensors where torch takes numbers (squeezed as torch squeezes them), concrete tensors that must
give the numbers of their floats, a differentiable initial accumulator, tensors that hold no
real value, and a sweep that varies eps and alpha per member.

Hand-built chains stand beside the aliases: each is the chain the alias documents.
"""

from __future__ import annotations

import re

import pytest
import torch

import minitrain as mt
from tests.optim_db_harness import ATOL, RTOL, grads_sequence, run_minitrain, run_torch

optim = mt.optim
F64 = torch.float64


def adam_chain(lr=1e-3, eps=1e-8):
    return optim.chain(optim.scale_by_adam(eps=eps), optim.scale_by_learning_rate(lr))


def rmsprop_chain(lr=1e-2, alpha=0.99, eps=1e-8):
    return optim.chain(optim.scale_by_rms(alpha, eps), optim.scale_by_learning_rate(lr))


def adagrad_chain(lr=1e-2, lr_decay=0.0, initial_accumulator_value=0.0, eps=1e-10):
    return optim.chain(optim.scale_by_adagrad(lr_decay, initial_accumulator_value, eps),
                       optim.scale_by_learning_rate(lr))


def sgd_chain(lr=1e-3, momentum=0.9, dampening=0.0):
    return optim.chain(optim.trace(momentum, dampening), optim.scale_by_learning_rate(lr))


# --------------------------------------------------------------------------------------------
# Values torch refuses


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: mt.optim.sgd(lr=-1.0), "lr"),
        (lambda: mt.optim.sgd(lr=0.1, nesterov=True), "nesterov"),
        (lambda: mt.optim.sgd(lr=0.1, momentum=-0.5), "momentum"),
        (lambda: mt.optim.adam(betas=(1.0, 0.999)), "betas[0]"),
        (lambda: mt.optim.adamw(betas=(0.9, -0.1)), "betas[1]"),
        (lambda: mt.optim.adam(eps=-1e-8), "eps"),
        (lambda: mt.optim.adamw(weight_decay=-0.1), "weight_decay"),
        (lambda: mt.optim.adagrad(lr_decay=-1.0), "lr_decay"),
        (lambda: mt.optim.rmsprop(alpha=1.5), "alpha"),
        (lambda: mt.optim.lion(betas=(1.5, 0.9)), "betas"),
        (lambda: mt.optim.lion(weight_decay=-0.1), "weight_decay"),
        (lambda: mt.optim.lion(lr=torch.tensor([0.1, 0.2])), "lr"),
    ],
)
def test_invalid_hyperparameters_raise_value_error_naming_them(call, needle):
    with pytest.raises(ValueError, match=re.escape(f"invalid {needle}")):
        call()


@pytest.mark.parametrize("call", [
    lambda: mt.optim.sgd(lr=torch.tensor([0.1, 0.2])),
    lambda: mt.optim.adam(lr=torch.tensor([0.1, 0.2])),
    lambda: mt.optim.adamw(betas=(0.9, torch.tensor(0.999))),
    lambda: mt.optim.adam(betas=(torch.tensor(0.9), 0.999)),
    lambda: mt.optim.nadam(betas=(0.9, torch.tensor(0.99))),
    lambda: mt.optim.radam(betas=(0.9, torch.tensor(0.99))),
    lambda: mt.optim.adamax(betas=(0.9, torch.tensor(0.99))),
], ids=["sgd-lr", "adam-lr", "adamw-betas", "adam-betas", "nadam-betas", "radam-betas",
        "adamax-betas"])
def test_a_tensor_of_two_values_or_betas_mixing_a_float_and_a_tensor_are_refused(call):
    """torch.optim refuses both (a beta pair is two numbers or two tensors)."""
    with pytest.raises(ValueError, match=r"lr|betas"):
        call()


# --------------------------------------------------------------------------------------------
# One-element tensors, squeezed as torch squeezes them


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1), (1,)])
@pytest.mark.parametrize("factory", [mt.optim.adam, mt.optim.adamw])
def test_one_element_tensor_betas_are_squeezed_like_torch(factory, shape):
    betas = (torch.full(shape, 0.8), torch.full(shape, 0.9))
    opt = factory(lr=0.1, betas=betas)
    params = {"w": torch.ones(4, 3)}
    new, _ = opt.update({"w": torch.ones(4, 3)}, opt.init(params), params)
    assert new["w"].shape == (4, 3)


FAMILY = {"NAdam": optim.nadam, "RAdam": optim.radam, "Adamax": optim.adamax,
          "Adadelta": optim.adadelta, "Adafactor": optim.adafactor}


@pytest.mark.parametrize("name", FAMILY)
def test_tensor_hyperparameters_squeeze_like_torch(name):
    g = torch.Generator().manual_seed(0)
    params = {key: torch.randn(shape, generator=g) for key, shape in
              {"w": (4, 3), "b": (5,), "s": (), "t": (2, 3, 4)}.items()}
    grads_seq = grads_sequence(params, 4)
    kwargs = {"lr": torch.tensor([[0.01]])}
    if name in ("NAdam", "RAdam", "Adamax"):
        kwargs["betas"] = (torch.tensor([[[0.9]]]), torch.tensor([[0.99]]))
    got, _ = run_minitrain(FAMILY[name], kwargs, params, grads_seq, plain=False)
    torch_kwargs = {"lr": 0.01, **({"betas": (0.9, 0.99)} if "betas" in kwargs else {})}
    want, _ = run_torch(name, torch_kwargs, params, grads_seq)
    for key in params:
        assert got[key].shape == params[key].shape
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------
# Concrete tensors: the numbers of their floats

# (name, factory(value) -> Optimizer, value): one per tensor hyperparameter, with a value that
# binary floating point cannot hold exactly (a float32 tensor's rounding then shows).
CASES = [
    ("adam-eps", lambda v: optim.adam(lr=0.1, eps=v, weight_decay=0.1), 1e-3),
    ("adam-amsgrad-eps", lambda v: optim.adam(lr=0.1, eps=v, amsgrad=True), 1e-3),
    ("adamw-eps", lambda v: optim.adamw(lr=0.1, eps=v), 1e-3),
    ("adagrad-eps", lambda v: optim.adagrad(lr=0.1, lr_decay=0.01, eps=v), 1e-3),
    ("adagrad-lr_decay", lambda v: optim.adagrad(lr=0.1, lr_decay=v, weight_decay=0.1), 0.01),
    ("adagrad-initial_accumulator_value",
     lambda v: optim.adagrad(lr=0.1, initial_accumulator_value=v), 0.1),
    ("rmsprop-alpha", lambda v: optim.rmsprop(lr=0.01, alpha=v, momentum=0.5, centered=True),
     0.9),
    ("rmsprop-eps", lambda v: optim.rmsprop(lr=0.01, eps=v, weight_decay=0.1), 1e-3),
    ("sgd-dampening", lambda v: optim.sgd(lr=0.1, momentum=0.9, dampening=v), 0.1),
    ("adam_chain-eps", lambda v: optim.as_optimizer(adam_chain(lr=0.1, eps=v)), 1e-3),
    ("rmsprop_chain-alpha",
     lambda v: optim.as_optimizer(rmsprop_chain(lr=0.01, alpha=v, eps=1e-3)), 0.9),
    ("rmsprop_chain-eps", lambda v: optim.as_optimizer(rmsprop_chain(lr=0.01, eps=v)), 1e-3),
    ("adagrad_chain-eps", lambda v: optim.as_optimizer(adagrad_chain(lr=0.1, eps=v)), 1e-3),
    ("adagrad_chain-lr_decay",
     lambda v: optim.as_optimizer(adagrad_chain(lr=0.1, lr_decay=v)), 0.01),
    ("adagrad_chain-initial_accumulator_value", lambda v: optim.as_optimizer(
        adagrad_chain(lr=0.1, initial_accumulator_value=v)), 0.1),
    ("sgd_chain-dampening",
     lambda v: optim.as_optimizer(sgd_chain(lr=0.1, momentum=0.9, dampening=v)), 0.1),
]


def _updates(opt, dtype, donate, steps=3):
    """The params and state after ``steps`` updates of a small problem in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 4, generator=g, dtype=dtype),
              "b": torch.randn(4, generator=g, dtype=dtype)}
    state = opt.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g, dtype=dtype) for k, v in params.items()}
        params, state = opt.update(grads, state, params, donate=donate)
    return mt.tree.leaves((params, state))


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("hyper_dtype", [torch.float32, F64], ids=["tensor32", "tensor64"])
@pytest.mark.parametrize(("name", "factory", "value"), CASES, ids=[c[0] for c in CASES])
def test_a_concrete_tensor_gives_the_numbers_of_its_float(name, factory, value, hyper_dtype,
                                                         dtype, donate):
    tensor = torch.tensor(value, dtype=hyper_dtype)
    with torch.no_grad():
        got = _updates(factory(tensor), dtype, donate)
        want = _updates(factory(float(tensor)), dtype, donate)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("make", [
    lambda v: optim.adagrad(lr=0.1, initial_accumulator_value=v),
    lambda v: optim.as_optimizer(adagrad_chain(lr=0.1, initial_accumulator_value=v)),
], ids=["adagrad", "adagrad_chain"])
def test_the_initial_accumulator_is_differentiable_through_the_state(make):
    """Params that need no grad: only the state (made by init) carries the accumulator's
    history, which a fused kernel would detach."""
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(3, 2, generator=g, dtype=F64)}
    grads = [{"w": torch.randn(3, 2, generator=g, dtype=F64)} for _ in range(3)]

    def final(value):
        opt = make(value)
        p, state = params, opt.init(params)
        for grad in grads:
            p, state = opt.update(grad, state, p)
        return (p["w"] ** 2).sum()

    x = torch.tensor(0.1, dtype=F64, requires_grad=True)
    got = torch.autograd.grad(final(x), x)[0]
    h = 1e-5
    with torch.no_grad():
        want = (final(torch.tensor(0.1 + h, dtype=F64))
                - final(torch.tensor(0.1 - h, dtype=F64))) / (2 * h)
    assert abs(float(want)) > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(("chain", "alias", "kwargs"), [
    (adam_chain, optim.adam, dict(lr=0.1, eps=1e-3)),
    (rmsprop_chain, optim.rmsprop, dict(lr=0.01, alpha=0.9, eps=1e-3)),
    (adagrad_chain, optim.adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1,
                                        eps=1e-3)),
    (sgd_chain, optim.sgd, dict(lr=0.1, momentum=0.9, dampening=0.1)),
], ids=["adam", "rmsprop", "adagrad", "sgd"])
def test_inject_hyperparams_holds_them_as_tensors(chain, alias, kwargs):
    """inject_hyperparams passes every numeric argument as a float32 tensor: the alias given
    the same float32 values agrees."""
    injected = optim.as_optimizer(optim.inject_hyperparams(chain)(**kwargs))
    rounded = {k: float(torch.tensor(v, dtype=torch.float32)) for k, v in kwargs.items()}
    with torch.no_grad():
        got = _updates(injected, torch.float32, donate=False)[:2]
        want = _updates(alias(**rounded), torch.float32, donate=False)[:2]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# A sweep over eps and alpha; tensors that hold no real value


TOY = """
import torch
import minitrain as mt

CONFIG = {"dim": 6, "batch_size": 4, "eps": 1e-3, "alpha": 0.9, "steps": 20}


def experiment(config):
    true_w = torch.linspace(-1.0, 1.0, config["dim"])

    def next_batch(generator):
        x = torch.randn(config["batch_size"], config["dim"], generator=generator)
        return x, x @ true_w

    def loss(params, batch):
        x, y = batch
        return mt.losses.mse(mt.models.cruncher(params, x), y)

    return mt.Experiment(
        name="toy",
        init=lambda g: mt.models.cruncher_init(dim=config["dim"], num_layers=1, generator=g),
        loss=loss,
        next_batch=next_batch,
        optimizer=mt.optim.rmsprop(lr=0.01, alpha=config["alpha"], eps=config["eps"]),
        steps=config["steps"],
    )
"""


def test_a_sweep_varies_eps_and_alpha_per_member(tmp_path):
    from minitrain.precision import get_backend
    from minitrain.train import fit, load_experiment
    from minitrain.train.sweep import fit_sweep, load_sweep

    path = tmp_path / "toy.py"
    path.write_text(TOY)
    ensemble = load_sweep(str(path), ["eps=0.001,0.5", "alpha=0.5,0.9"], seeds=[3], steps=20)
    assert ensemble.swept == ("eps", "alpha") and ensemble.size == 4
    cpu = get_backend("cpu")
    result = fit_sweep(ensemble, cpu, progress=False)
    finals = []
    for member, params in zip(ensemble.members, mt.tree.unstack(result.params), strict=True):
        overrides = {key: str(value) for key, value in member.config.items()}
        experiment, config = load_experiment(str(path), overrides, steps=20)
        run = fit(experiment, cpu, seed=member.seed, progress=False, config=config)
        for got, want in zip(mt.tree.leaves(params), mt.tree.leaves(run.params), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        finals.append(float(mt.tree.leaves(params)[0].sum()))
    assert len(set(finals)) == 4  # the members did differ


REFUSING = [
    ("adam", lambda v: optim.adam(eps=v), "eps"),
    ("adamw", lambda v: optim.adamw(eps=v), "eps"),
    ("rmsprop-alpha", lambda v: optim.rmsprop(alpha=v), "alpha"),
    ("rmsprop-eps", lambda v: optim.rmsprop(eps=v), "eps"),
    ("adagrad-lr_decay", lambda v: optim.adagrad(lr_decay=v), "lr_decay"),
    ("adagrad-initial", lambda v: optim.adagrad(initial_accumulator_value=v),
     "initial_accumulator_value"),
    ("adagrad-eps", lambda v: optim.adagrad(eps=v), "eps"),
    ("sgd", lambda v: optim.sgd(momentum=0.9, dampening=v), "dampening"),
    ("scale_by_adam", lambda v: optim.scale_by_adam(eps=v), "eps"),
    ("scale_by_rms", lambda v: optim.scale_by_rms(eps=v), "eps"),
    ("scale_by_adagrad", lambda v: optim.scale_by_adagrad(initial_accumulator_value=v),
     "initial_accumulator_value"),
    ("trace", lambda v: optim.trace(dampening=v), "dampening"),
]


@pytest.mark.parametrize(("make", "name"), [c[1:] for c in REFUSING],
                         ids=[c[0] for c in REFUSING])
@pytest.mark.parametrize("value", [
    torch.tensor([1e-3, 1e-3]), torch.tensor(1e-3 + 0j), torch.empty((), device="meta"),
], ids=["two-elements", "complex", "meta"])
def test_a_tensor_without_one_real_value_is_refused_naming_the_argument(make, name, value):
    with pytest.raises(ValueError, match=rf"^invalid {name}\b") as info:
        make(value)
    assert "\n" not in str(info.value)
