"""The optimizer interface: ``Optimizer(init, update)`` and the checks every optimizer shares.

An optimizer is a NamedTuple ``(init, update)`` of pure functions (optax ``_src/base.py``):
``state = opt.init(params)`` and ``params, state = opt.update(grads, state, params)``. Every
optimizer in :mod:`minitrain.optim` is ``as_optimizer(chain(...))`` of gradient
transformations; ``minitrain.optim.kernels`` runs the chains it recognises as fused kernels.

Donation: ``opt.update(grads, state, params, donate=True)`` lets the update write the new params
and state into the buffers of ``params`` and ``state`` (JAX's ``donate_argnums``). The caller
must not read the donated inputs afterwards. Donation is a permission, never an obligation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch
from minitrain.optim._host import _PLAIN_TENSOR_TYPES, is_traced
from minitrain.optim._layout import (  # noqa: F401  (re-exported for the optimizer modules)
    WeightDecayMask,
    check_grads,
    check_params,
    decay_flags,
)
from minitrain.tree import OptState, Params

__all__ = [
    "Optimizer",
    "Schedule",
    "ScalarOrSchedule",
    "WeightDecayMask",
    "learning_rate",
]

Schedule = Callable[[Any], Any]
"""A learning-rate schedule: ``step -> lr``, for a Python int or a 0-d integer tensor step."""
ScalarOrSchedule = float | Tensor | Schedule

class Optimizer(NamedTuple):
    """A pair of pure functions: ``init(params) -> state``, ``update(grads, state, params)``.

    ``update`` returns ``(new_params, new_state)`` and accepts ``donate=True`` (see the module
    docstring).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.sgd(lr=0.5)
    >>> params = {"w": torch.tensor([1.0, 2.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params)
    >>> params["w"]
    tensor([0.5000, 1.5000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Params, OptState]]


def learning_rate(state: OptState) -> float:
    """The lr of the most recent update (before the first update: the lr it will use).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adamw(lr=mt.optim.linear_warmup_schedule(1.0, warmup_steps=4))
    >>> params = {"w": torch.ones(2)}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> mt.optim.learning_rate(state)
    0.25
    """
    found = _find_lr(state)
    if found is None:
        raise ValueError(
            f"learning_rate() expects the state of an mt.optim optimizer, got {type(state)!r}"
        )
    return float(found)


def _find_lr(state: Any) -> Any:
    """The ``lr`` field of a state, or the first one inside a chain's tuple of states or a
    ``multi_transform``'s dict of them, in order (also an injected ``lr`` / ``learning_rate``
    hyperparameter)."""
    if hasattr(state, "lr") and isinstance(state.lr, Tensor):
        return state.lr
    hyper = getattr(state, "hyperparams", None)
    if isinstance(hyper, dict):
        for key in ("lr", "learning_rate"):
            if key in hyper:
                return hyper[key]
    inners = state.values() if isinstance(state, dict) else state
    if isinstance(state, tuple | list | dict):
        for inner in inners:
            found = _find_lr(inner)
            if found is not None:
                return found
    return None


# --------------------------------------------------------------------------------------------
# Validation


def check_hyperparameter(name: str, value: Any, low: float, high: float = math.inf,
                         *, low_open: bool = False, high_open: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` when a concrete ``value`` is outside its range.

    Values that cannot be read without tracing (vmapped or compiled tensors) are not checked.
    """
    number = _concrete_number(name, value)
    if number is None:
        return
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if math.isnan(number) or too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(
            f"invalid {name}={number!r}: it must lie in {left}{low}, {high}{right}; "
            f"pass a value in that range"
        )


def _concrete_number(name: str, value: Any) -> float | None:
    """``value`` as a float; None where it cannot be read without tracing (and for a tensor
    subclass of several elements, such as a sweep's per-member values)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Tensor):
        if is_traced(value) or value.numel() != 1 and type(value) is not Tensor:
            return None
        if value.numel() != 1:
            raise ValueError(f"invalid {name}: a tensor of shape {tuple(value.shape)}; pass a "
                             f"number or a one-element tensor")
        if value.is_complex() or value.is_meta:  # no real value to read
            raise ValueError(f"invalid {name}: a {value.dtype} tensor on {value.device.type}; "
                             f"pass a real number or a one-element real tensor holding data")
        return float(value.detach().reshape(()).item())
    raise ValueError(f"invalid {name}={value!r}: pass a number or a one-element tensor")


def check_lr(lr: ScalarOrSchedule) -> None:
    """Check a learning rate given as a number or tensor (a schedule is checked per step)."""
    if callable(lr) and not isinstance(lr, Tensor):
        return
    check_hyperparameter("lr", lr, 0.0)


# --------------------------------------------------------------------------------------------
# Path choice


def use_plain_path(tensors: Sequence[Tensor], hyperparameters: Sequence[Any]) -> bool:
    """Whether an update must take per-leaf tensor ops rather than batched foreach kernels:
    under a compiler or functorch transform, or with grad mode on and a leaf or tensor
    hyperparameter that requires grad (a differentiable lr: foreach kernels would detach it)."""
    if torch.compiler.is_compiling():
        return True
    if any(is_traced(value) for value in hyperparameters):
        return True
    wrapped = _torch.is_functorch_wrapped_tensor
    for t in tensors:  # is_traced, inlined: an update checks every leaf
        if type(t) in _PLAIN_TENSOR_TYPES:
            if wrapped(t):
                return True
        elif is_traced(t):
            return True
    return torch.is_grad_enabled() and (
        any(t.requires_grad for t in tensors)
        or any(isinstance(v, Tensor) and v.requires_grad for v in hyperparameters)
    )


def scalar(value: Any) -> Any:
    """A concrete 0-d tensor hyperparameter as a Python float; anything else unchanged."""
    if isinstance(value, Tensor) and value.numel() == 1 and not is_traced(value):
        return float(value.detach().reshape(()).item())
    return value
