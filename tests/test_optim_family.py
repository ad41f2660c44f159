"""Adadelta, Adafactor, Adamax, ASGD, NAdam, RAdam, Rprop and Muon against torch.optim, step for
step over torch's own test configurations (``optim_db``), and torch's error inputs."""

from __future__ import annotations

import re

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import minitrain as mt

FAMILY = {
    "Adadelta": mt.optim.adadelta,
    "Adafactor": mt.optim.adafactor,
    "Adamax": mt.optim.adamax,
    "ASGD": mt.optim.asgd,
    "NAdam": mt.optim.nadam,
    "RAdam": mt.optim.radam,
    "Rprop": mt.optim.rprop,
    "Muon": mt.optim.muon,
}
INFOS = {info.optim_cls.__name__: info for info in optim_db}
RTOL, ATOL = 1e-5, 1e-6
STEPS = 12
# Flags that choose torch's implementation, not the math.
IMPLEMENTATION_FLAGS = {"foreach", "fused", "capturable", "differentiable"}
# optim_db's error inputs about torch's param groups; minitrain's params are a pytree.
PARAM_GROUP_ERRORS = {
    "invalid param type",
    "a param group cannot have duplicate parameters",
    "duplicate parameters should not occur across param groups either",
    "all optimizer params should be with/without names",
    "all optimizer param groups should be with/without names.",
}
# torch's state keys that hold O(1) scalars rather than per-leaf buffers.
SCALAR_KEYS = {"step", "mu_product", "eta", "mu"}


def configs(name: str) -> list[tuple[str, dict]]:
    inputs = INFOS[name].optim_inputs_func(device="cpu", dtype=torch.float32)
    return [(f"{name}-{i.desc}", i.kwargs) for i in inputs]


CASES = [case for name in FAMILY for case in configs(name)]


def make_params(name: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "v": (3, 5)} if name == "Muon" else {
        "w": (4, 3), "b": (5,), "s": (), "t": (2, 3, 4)}
    return {key: torch.randn(shape, generator=g) for key, shape in shapes.items()}


def grads_sequence(params: dict, steps: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g) for k, p in params.items()}
            for _ in range(steps)]


def run_torch(name, kwargs, params, grads_seq):
    leaves = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = INFOS[name].optim_cls(list(leaves.values()), **kwargs)
    for grads in grads_seq:
        for k, p in leaves.items():
            p.grad = grads[k].clone()
        opt.step()
    states = {k: opt.state[p] for k, p in leaves.items()}
    return {k: p.detach() for k, p in leaves.items()}, states


def run_minitrain(name, kwargs, params, grads_seq, plain: bool):
    opt = FAMILY[name](**{k: v for k, v in kwargs.items() if k not in IMPLEMENTATION_FLAGS})
    if plain:  # leaves that require grad, under grad mode: the per-leaf tensor-ops path
        params = {k: p.clone().requires_grad_() for k, p in params.items()}
    state = opt.init(params)
    with torch.enable_grad() if plain else torch.no_grad():
        for grads in grads_seq:
            params, state = opt.update(grads, state, params)
    return {k: p.detach() for k, p in params.items()}, state


def named_buffers(state) -> dict[str, dict]:
    """Every per-leaf buffer field in a (chain of) transformation states, by field name."""
    found = {}
    if hasattr(state, "_fields"):
        for field in state._fields:
            value = getattr(state, field)
            if isinstance(value, dict):
                found[field] = value
            elif isinstance(value, tuple):
                found.update(named_buffers(value))
    elif isinstance(state, tuple):
        for inner in state:
            found.update(named_buffers(inner))
    return found


@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
@pytest.mark.parametrize(("case", "kwargs"), CASES, ids=[case for case, _ in CASES])
def test_matches_torch_step_for_step_over_optim_db(case, kwargs, plain):
    name = case.split("-")[0]
    params = make_params(name)
    grads_seq = grads_sequence(params, STEPS)
    want, torch_state = run_torch(name, kwargs, params, grads_seq)
    got, state = run_minitrain(name, kwargs, params, grads_seq, plain)
    for key in params:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL)
    buffers = named_buffers(state)
    compared = 0
    for key, leaf_state in torch_state.items():
        for field, value in leaf_state.items():
            if field in SCALAR_KEYS:
                continue
            assert field in buffers, f"state has no {field!r} (has {sorted(buffers)})"
            torch.testing.assert_close(buffers[field][key].detach(), value, rtol=RTOL, atol=ATOL)
            compared += 1
    assert compared > 0


ERROR_CASES = [
    (name, error)
    for name in FAMILY
    for error in INFOS[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)
    if error.optimizer_error_input.desc not in PARAM_GROUP_ERRORS
]


def test_param_group_errors_are_the_only_ones_left_out():
    left_out = {
        error.optimizer_error_input.desc
        for name in FAMILY
        for error in INFOS[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)
        if error.optimizer_error_input.desc in PARAM_GROUP_ERRORS
    }
    assert left_out == PARAM_GROUP_ERRORS


def culprits(name: str, kwargs: dict) -> set[str]:
    """The arguments torch rejects on their own: the ones an error must name."""
    bad = set()
    for key, value in kwargs.items():
        try:
            INFOS[name].optim_cls([torch.nn.Parameter(torch.zeros(2, 2))], **{key: value})
        except (ValueError, RuntimeError):
            bad.add(key)
    return bad


@pytest.mark.parametrize(("name", "error"), ERROR_CASES,
                         ids=[f"{n}-{e.optimizer_error_input.desc}" for n, e in ERROR_CASES])
def test_rejects_torchs_error_inputs_with_a_value_error_naming_the_argument(name, error):
    given = error.optimizer_error_input
    kwargs = {k: v for k, v in given.kwargs.items() if k not in IMPLEMENTATION_FLAGS}
    params = None
    if given.params is not None:
        params = {f"p{i}": p.detach() for i, p in enumerate(given.params)}
    with pytest.raises(ValueError) as raised:
        opt = FAMILY[name](**kwargs)
        params = params or {"w": torch.zeros(2, 2)}
        state = opt.init(params)
        opt.update({k: torch.ones_like(p) for k, p in params.items()}, state, params)
    message = str(raised.value)
    assert "\n" not in message
    if given.params is None:
        names = culprits(name, kwargs)
        assert names and any(re.search(rf"\b{key}\b", message) for key in names), message
    elif error.error_on == OptimizerErrorEnum.STEP_ERROR:
        assert "complex" in message
    else:
        assert "2-D" in message or "adjust_lr_fn" in message


def test_muon_rejects_a_non_matrix_naming_the_leaf():
    opt = mt.optim.muon()
    with pytest.raises(ValueError, match="'bias' has shape \\(3,\\)"):
        opt.init({"weight": torch.zeros(3, 3), "bias": torch.zeros(3)})


@pytest.mark.parametrize("factory", [mt.optim.nadam, mt.optim.radam, mt.optim.adamax])
def test_betas_mixing_a_float_and_a_tensor_are_refused(factory):
    with pytest.raises(ValueError, match="betas"):
        factory(betas=(0.9, torch.tensor(0.99)))


@pytest.mark.parametrize("name", ["NAdam", "RAdam", "Adamax", "Adadelta", "Adafactor"])
def test_tensor_hyperparameters_squeeze_like_torch(name):
    params = make_params(name)
    grads_seq = grads_sequence(params, 4)
    kwargs = {"lr": torch.tensor([[0.01]])}
    if name in ("NAdam", "RAdam", "Adamax"):
        kwargs["betas"] = (torch.tensor([[[0.9]]]), torch.tensor([[0.99]]))
    got, _ = run_minitrain(name, kwargs, params, grads_seq, plain=False)
    torch_kwargs = {"lr": 0.01, **({"betas": (0.9, 0.99)} if "betas" in kwargs else {})}
    want, _ = run_torch(name, torch_kwargs, params, grads_seq)
    for key in params:
        assert got[key].shape == params[key].shape
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(FAMILY))
def test_update_never_mutates_its_inputs(name):
    params = make_params(name)
    opt = FAMILY[name]()
    state = opt.init(params)
    grads = grads_sequence(params, 1)[0]
    before = [t.clone() for t in mt.tree.leaves((params, state, grads))]
    for _ in range(2):
        opt.update(grads, state, params)
    after = mt.tree.leaves((params, state, grads))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(("factory", "kwargs", "lrs"), [
    (mt.optim.nadam, dict(lr=0.01), [0.01, 0.01]),
    (mt.optim.asgd, dict(lr=0.1, lambd=1.0, alpha=1.0), [0.1, 0.1 / 1.1]),  # lr / (1 + lr t)
    (mt.optim.rprop, dict(lr=0.2), [0.2, 0.2]),
    (mt.optim.schedule_free_adamw, dict(lr=0.1, warmup_steps=4), [0.025, 0.05]),
    (mt.optim.adafactor, dict(lr=mt.optim.step_schedule(0.05, 1, gamma=0.5)), [0.05, 0.025]),
])
def test_learning_rate_reads_the_lr_of_the_last_update(factory, kwargs, lrs):
    opt = factory(**kwargs)
    params = {"w": torch.ones(2, 2)}
    state = opt.init(params)
    seen = []
    for _ in range(2):
        params, state = opt.update({"w": torch.ones(2, 2)}, state, params)
        seen.append(mt.optim.learning_rate(state))
    assert seen == pytest.approx(lrs, rel=1e-6)
