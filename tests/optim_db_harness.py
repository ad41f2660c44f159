"""mt.optim against torch's own optimizer test configurations and error inputs (``optim_db`` in
``torch.testing._internal.common_optimizers``), shared by the optimizer test modules.

Functions (``name`` is the torch.optim class name, e.g. ``"AdamW"``; ``factory`` the mt.optim
function taking torch's keyword arguments):

* ``configs(name) -> list[tuple[str, dict]]``: ``(case id, kwargs)`` of every
  ``optim_inputs_func`` configuration on CPU float32.
* ``check_matches_torch(name, factory, kwargs, *, plain, steps=STEPS, params=None, rtol=RTOL,
  atol=ATOL) -> None``: run torch.optim and ``factory(**kwargs)`` (implementation flags such as
  ``foreach`` / ``fused`` dropped) side by side for ``steps`` updates, on the fast path or, with
  ``plain=True``, on leaves that require grad under grad mode; assert params and every per-leaf
  state buffer torch keeps (matched by torch's state key) are close.
* ``error_cases(names) -> list[tuple[str, ErrorOptimizerInput]]``: torch's error inputs, without
  the ones about param groups (minitrain's params are a pytree).
* ``left_out_errors(names) -> set[str]``: the descriptions ``error_cases`` leaves out.
* ``check_rejects(name, factory, error) -> None``: ``factory`` (or its first update) raises a
  one-line ``ValueError`` naming an argument torch rejects on its own.
* ``named_buffers(state) -> dict[str, dict]``: per-leaf buffer fields of a (chain) state.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

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


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "b": (5,), "s": (), "t": (2, 3, 4)}
    return {key: torch.randn(shape, generator=g) for key, shape in shapes.items()}


def grads_sequence(params: dict, steps: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g) for k, p in params.items()}
            for _ in range(steps)]


def run_torch(name: str, kwargs: dict, params: dict, grads_seq: list[dict]):
    leaves = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = INFOS[name].optim_cls(list(leaves.values()), **kwargs)
    for grads in grads_seq:
        for k, p in leaves.items():
            p.grad = grads[k].clone()
        opt.step()
    return {k: p.detach() for k, p in leaves.items()}, {k: opt.state[p] for k, p in leaves.items()}


def run_minitrain(factory: Callable, kwargs: dict, params: dict, grads_seq: list[dict],
                  plain: bool):
    opt = factory(**{k: v for k, v in kwargs.items() if k not in IMPLEMENTATION_FLAGS})
    if plain:  # leaves that require grad, under grad mode: the per-leaf tensor-ops path
        params = {k: p.clone().requires_grad_() for k, p in params.items()}
    state = opt.init(params)
    with torch.enable_grad() if plain else torch.no_grad():
        for grads in grads_seq:
            params, state = opt.update(grads, state, params)
    return {k: p.detach() for k, p in params.items()}, state


def named_buffers(state: Any) -> dict[str, dict]:
    """Every per-leaf buffer field in a (chain of) transformation states, by field name."""
    found: dict[str, dict] = {}
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


def check_matches_torch(name: str, factory: Callable, kwargs: dict, *, plain: bool,
                        steps: int = STEPS, params: dict | None = None, rtol: float = RTOL,
                        atol: float = ATOL) -> None:
    params = make_params() if params is None else params
    grads_seq = grads_sequence(params, steps)
    want, torch_state = run_torch(name, kwargs, params, grads_seq)
    got, state = run_minitrain(factory, kwargs, params, grads_seq, plain)
    for key in params:
        torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol)
    buffers = named_buffers(state)
    compared = 0
    for key, leaf_state in torch_state.items():
        for field, value in leaf_state.items():
            if field in SCALAR_KEYS:
                continue
            assert field in buffers, f"state has no {field!r} (has {sorted(buffers)})"
            torch.testing.assert_close(buffers[field][key].detach(), value, rtol=rtol, atol=atol)
            compared += 1
    # Every torch optimizer keeps per-leaf state except SGD without momentum.
    assert compared > 0 or name == "SGD" and not kwargs.get("momentum")


def error_cases(names: list[str]) -> list[tuple[str, Any]]:
    return [
        (name, error)
        for name in names
        for error in INFOS[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)
        if error.optimizer_error_input.desc not in PARAM_GROUP_ERRORS
        and not IMPLEMENTATION_FLAGS & set(error.optimizer_error_input.kwargs)
    ]


def left_out_errors(names: list[str]) -> set[str]:
    """Descriptions of the error inputs :func:`error_cases` leaves out: param-group errors and
    errors about torch's implementation flags (``foreach=True`` with tensor hyperparameters),
    which minitrain does not have."""
    return {
        error.optimizer_error_input.desc
        for name in names
        for error in INFOS[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)
        if error.optimizer_error_input.desc in PARAM_GROUP_ERRORS
        or IMPLEMENTATION_FLAGS & set(error.optimizer_error_input.kwargs)
    }


def culprits(name: str, kwargs: dict) -> set[str]:
    """The arguments torch rejects on their own: the ones an error must name."""
    bad = set()
    for key, value in kwargs.items():
        try:
            INFOS[name].optim_cls([torch.nn.Parameter(torch.zeros(2, 2))], **{key: value})
        except (ValueError, RuntimeError):
            bad.add(key)
    return bad


def check_rejects(name: str, factory: Callable, error: Any) -> None:
    given = error.optimizer_error_input
    kwargs = {k: v for k, v in given.kwargs.items() if k not in IMPLEMENTATION_FLAGS}
    params = None
    if given.params is not None:
        params = {f"p{i}": p.detach() for i, p in enumerate(given.params)}
    with pytest.raises(ValueError) as raised:
        opt = factory(**kwargs)
        params = params or {"w": torch.zeros(2, 2)}
        state = opt.init(params)
        opt.update({k: torch.ones_like(p) for k, p in params.items()}, state, params)
    message = str(raised.value)
    assert "\n" not in message, message
    if given.params is None:
        names = culprits(name, kwargs)
        assert names and any(re.search(rf"\b{key}\b", message) for key in names), message
    elif error.error_on == OptimizerErrorEnum.STEP_ERROR:
        assert "complex" in message, message
