"""Optimizer state bytes per param, for every optimizer in :mod:`minitrain.optim`.

What memory accounting needs to know about an optimizer: how many bytes of state it keeps for
a given set of params. Most keep a whole number of buffers shaped like each param (Adam two,
Lion one, SGD without momentum none); Adafactor keeps, for a leaf of two or more dims, only a
row and a column of means (Shazeer & Stern 2018, section 3), so its bytes depend on shapes;
Muon takes matrices only, so any other leaf is counted as its AdamW fallback (two moments).
Counted: per-leaf buffers in the param's dtype, as ``opt.init(params)`` makes them (and as
torch.optim keeps them); not counted: O(1) scalars (step counts, NAdam's ``mu_product``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from minitrain._torch import pytree as _pytree
from minitrain.optim._adafactor import factored_shapes
from minitrain.optim._transforms_rules import keeps_momentum_buffer

__all__ = ["state_bytes", "state_buffers", "STATE_BUFFERS"]


def _sgd(momentum: Any = 0.0, **_: Any) -> int:
    return int(keeps_momentum_buffer(momentum))


def _adam(amsgrad: bool = False, **_: Any) -> int:
    return 3 if amsgrad else 2


def _rmsprop(momentum: Any = 0.0, centered: bool = False, **_: Any) -> int:
    return 1 + keeps_momentum_buffer(momentum) + bool(centered)


def _fixed(count: int) -> Callable[..., int]:
    return lambda **_: count


# Buffers shaped like each param, as a function of the optimizer's hyperparameters.
STATE_BUFFERS: dict[str, Callable[..., int]] = {
    "sgd": _sgd,
    "momentum": _fixed(1),  # SGD with momentum (accounting's name)
    "adam": _adam,
    "adamw": _adam,
    "adagrad": _fixed(1),  # sum
    "rmsprop": _rmsprop,  # square_avg (+ momentum_buffer, grad_avg)
    "adadelta": _fixed(2),  # square_avg, acc_delta
    "adamax": _fixed(2),  # exp_avg, exp_inf
    "asgd": _fixed(1),  # ax
    "nadam": _fixed(2),  # exp_avg, exp_avg_sq
    "radam": _fixed(2),  # exp_avg, exp_avg_sq
    "rprop": _fixed(2),  # prev, step_size
    "muon": _fixed(1),  # momentum_buffer (matrices; any other leaf: AdamW's two moments)
    "lion": _fixed(1),  # exp_avg
    "schedule_free_adamw": _fixed(2),  # z, exp_avg_sq
    "adafactor": _fixed(0),  # shape-dependent: see _leaf_elements
}


def _key(optimizer: str) -> str:
    key = optimizer.strip().lower().replace("-", "_") if isinstance(optimizer, str) else None
    if key not in STATE_BUFFERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; choose one of {', '.join(STATE_BUFFERS)}"
        )
    return key


def _check_hyperparameters(key: str, hyperparameters: dict[str, Any]) -> None:
    """Refuse a keyword the optimizer's factory does not take (a typo would count nothing)."""
    from minitrain import optim  # the factories import this module

    factory = getattr(optim, "sgd" if key == "momentum" else key)
    known = inspect.signature(factory).parameters
    for name in hyperparameters:
        if name not in known:
            raise ValueError(
                f"unknown hyperparameter {name!r} for {key}; pass one of {', '.join(known)}"
            )


def state_buffers(optimizer: str, **hyperparameters: Any) -> int:
    """Buffers shaped like each param that ``optimizer`` keeps (Adafactor: 0, see
    :func:`state_bytes`).

    >>> state_buffers("adam", amsgrad=True), state_buffers("lion"), state_buffers("sgd")
    (3, 1, 0)
    """
    key = _key(optimizer)
    _check_hyperparameters(key, hyperparameters)
    return STATE_BUFFERS[key](**hyperparameters)


def _is_shape(leaf: Any) -> bool:
    return isinstance(leaf, torch.Size | tuple | list) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in leaf
    )


def _shape_and_size(leaf: Any, element_size: int | None) -> tuple[tuple[int, ...], int]:
    if isinstance(leaf, Tensor):
        return tuple(leaf.shape), leaf.element_size()
    if _is_shape(leaf) and all(d >= 0 for d in leaf):
        return tuple(leaf), element_size or 4
    if _is_shape(leaf):
        raise ValueError(f"shape {tuple(leaf)} has a negative size; pass sizes >= 0")
    raise ValueError(
        f"expected params as tensors (real, fake or meta) or shapes, got {type(leaf).__name__}"
    )


def _leaves(params: Any) -> list[Any]:
    """Tensors and shapes of ``params``: a pytree of either (a shape is one leaf)."""
    if isinstance(params, list | tuple) and not params:
        return []
    if isinstance(params, list) and all(_is_shape(p) for p in params):
        return list(params)  # a list of shapes, [[3, 4], [4]] too
    return _pytree.tree_leaves(params, is_leaf=lambda x: isinstance(x, tuple) and _is_shape(x))


def _leaf_elements(key: str, shape: tuple[int, ...], buffers: int) -> int:
    if key == "adafactor":
        return sum(math.prod(s) for s in factored_shapes(shape))
    if key == "muon" and len(shape) != 2:
        return STATE_BUFFERS["adamw"]() * math.prod(shape)
    return buffers * math.prod(shape)


def state_bytes(optimizer: str, params: Any, *, element_size: int | None = None,
                **hyperparameters: Any) -> int:
    """Bytes of per-leaf state ``optimizer`` keeps for ``params``.

    ``params`` is a pytree of tensors (real, fake or on the meta device) or of shapes
    (``element_size`` bytes each, fp32 by default). ``hyperparameters`` are the optimizer's
    keyword arguments (those that change its state: ``momentum``, ``amsgrad``, ``centered``);
    one its factory does not take is refused.

    >>> state_bytes("adamw", [(1024, 1024)])
    8388608
    >>> state_bytes("adafactor", [(1024, 512), (512,)])  # rows + columns, and a full vector
    8192
    >>> state_bytes("sgd", [(10,)], momentum=0.9, element_size=2)
    20
    >>> state_bytes("muon", {"w": (8, 8), "b": (8,)})  # momentum; AdamW's two moments
    320
    """
    key = _key(optimizer)
    if element_size is not None and (
        not isinstance(element_size, int) or isinstance(element_size, bool) or element_size < 1
    ):
        raise ValueError(f"element_size must be a whole number of bytes >= 1, got {element_size!r}")
    buffers = state_buffers(key, **hyperparameters)
    total = 0
    for leaf in _leaves(params):
        shape, size = _shape_and_size(leaf, element_size)
        total += _leaf_elements(key, shape, buffers) * size
    return total
