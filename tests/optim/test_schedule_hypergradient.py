"""An lr schedule whose value carries a gradient (``lambda step: x * decay(step)``, x a
hyperparameter being tuned) keeps it through every optimizer's update, as a tensor lr does:
the fast paths, which detach their scalars, used to take such updates whenever the params
needed no grad, and the hypergradient was silently lost."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt

optim = mt.optim
FAMILY = ["sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax", "asgd", "nadam",
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
