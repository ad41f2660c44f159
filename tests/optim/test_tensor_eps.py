"""eps (and RMSprop's alpha, AdaGrad's lr_decay and initial accumulator, SGD's dampening) as
0-d tensor hyperparameters, beyond what ``test_unrolled_every_optimizer.py`` checks: a concrete
tensor gives the numbers of its float on the fast paths (streaming, fused and foreach kernels,
and chains lowered to them); a differentiable initial accumulator is watched where it reaches
the update only through the state; a sweep may vary eps per member; a tensor that holds no real
value is refused with a one-line ``ValueError`` naming the argument."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt

optim = mt.optim
F64 = torch.float64

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
    # chains built by hand, lowered to the aliases' kernels
    ("adam_chain-eps", lambda v: optim.as_optimizer(optim.adam_chain(lr=0.1, eps=v)), 1e-3),
    ("rmsprop_chain-alpha",
     lambda v: optim.as_optimizer(optim.rmsprop_chain(lr=0.01, alpha=v, eps=1e-3)), 0.9),
    ("rmsprop_chain-eps", lambda v: optim.as_optimizer(optim.rmsprop_chain(lr=0.01, eps=v)),
     1e-3),
    ("adagrad_chain-eps", lambda v: optim.as_optimizer(optim.adagrad_chain(lr=0.1, eps=v)),
     1e-3),
    ("adagrad_chain-lr_decay",
     lambda v: optim.as_optimizer(optim.adagrad_chain(lr=0.1, lr_decay=v)), 0.01),
    ("adagrad_chain-initial_accumulator_value", lambda v: optim.as_optimizer(
        optim.adagrad_chain(lr=0.1, initial_accumulator_value=v)), 0.1),
    ("sgd_chain-dampening",
     lambda v: optim.as_optimizer(optim.sgd_chain(lr=0.1, momentum=0.9, dampening=v)), 0.1),
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
    lambda v: optim.as_optimizer(optim.adagrad_chain(lr=0.1, initial_accumulator_value=v)),
], ids=["adagrad", "adagrad_chain"])
def test_the_initial_accumulator_is_differentiable_through_the_state(make):
    """Params that need no grad: only the state (made by init) carries the accumulator's
    history, which the fast path (a lowered chain's too) would detach."""
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
    (optim.adam_chain, optim.adam, dict(lr=0.1, eps=1e-3)),
    (optim.rmsprop_chain, optim.rmsprop, dict(lr=0.01, alpha=0.9, eps=1e-3)),
    (optim.adagrad_chain, optim.adagrad, dict(lr=0.1, lr_decay=0.01,
                                              initial_accumulator_value=0.1, eps=1e-3)),
    (optim.sgd_chain, optim.sgd, dict(lr=0.1, momentum=0.9, dampening=0.1)),
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
