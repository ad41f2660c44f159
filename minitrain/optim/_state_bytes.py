"""Optimizer state bytes per param, for every optimizer in :mod:`minitrain.optim`.

What memory accounting needs to know about an optimizer: how many bytes of state it keeps for
a given set of params. Most keep a whole number of buffers shaped like each param (Adam two,
Lion one, SGD without momentum none); Adafactor keeps, for a leaf of two or more dims, only a
row and a column of means (Shazeer & Stern 2018, section 3), so its bytes depend on shapes.
Counted: per-leaf buffers in the param's dtype, as ``opt.init(params)`` makes them (and as
torch.optim keeps them); not counted: O(1) scalars (step counts, NAdam's ``mu_product``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._adafactor import factored_shapes

__all__ = ["state_bytes", "state_buffers", "STATE_BUFFERS"]


def _sgd(momentum: float = 0.0, **_: Any) -> int:
    return 1 if momentum else 0


def _adam(amsgrad: bool = False, **_: Any) -> int:
    return 3 if amsgrad else 2


def _rmsprop(momentum: float = 0.0, centered: bool = False, **_: Any) -> int:
    return 1 + bool(momentum) + bool(centered)


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
    "muon": _fixed(1),  # momentum_buffer
    "lion": _fixed(1),  # exp_avg
    "schedule_free_adamw": _fixed(2),  # z, exp_avg_sq
    "adafactor": _fixed(0),  # shape-dependent: see _adafactor_elements
}


def _key(optimizer: str) -> str:
    key = optimizer.strip().lower().replace("-", "_")
    if key not in STATE_BUFFERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; choose one of {', '.join(STATE_BUFFERS)}"
        )
    return key


def state_buffers(optimizer: str, **hyperparameters: Any) -> int:
    """Buffers shaped like each param that ``optimizer`` keeps (Adafactor: 0, see
    :func:`state_bytes`).

    >>> state_buffers("adam", amsgrad=True), state_buffers("lion"), state_buffers("sgd")
    (3, 1, 0)
    """
    return STATE_BUFFERS[_key(optimizer)](**hyperparameters)


def _shape_and_size(leaf: Any, element_size: int | None) -> tuple[tuple[int, ...], int]:
    if isinstance(leaf, Tensor):
        return tuple(leaf.shape), leaf.element_size()
    if isinstance(leaf, torch.Size | tuple | list) and all(isinstance(d, int) for d in leaf):
        return tuple(leaf), element_size or 4
    raise ValueError(
        f"expected params as tensors (real, fake or meta) or shapes, got {type(leaf).__name__}"
    )


def state_bytes(optimizer: str, params: Any, *, element_size: int | None = None,
                **hyperparameters: Any) -> int:
    """Bytes of per-leaf state ``optimizer`` keeps for ``params``.

    ``params`` is a pytree of tensors (real, fake or on the meta device) or a list of shapes
    (``element_size`` bytes each, fp32 by default). ``hyperparameters`` are the optimizer's
    keyword arguments that change its state (``momentum``, ``amsgrad``, ``centered``).

    >>> state_bytes("adamw", [(1024, 1024)])
    8388608
    >>> state_bytes("adafactor", [(1024, 512), (512,)])  # rows + columns, and a full vector
    8192
    >>> state_bytes("sgd", [(10,)], momentum=0.9, element_size=2)
    20
    """
    key = _key(optimizer)
    if isinstance(params, list | tuple) and params and all(
        isinstance(p, torch.Size | tuple | list) and all(isinstance(d, int) for d in p)
        for p in params
    ):
        leaves = list(params)
    else:
        leaves = tree.leaves(params)
    total = 0
    for leaf in leaves:
        shape, size = _shape_and_size(leaf, element_size)
        if key == "adafactor":
            elements = sum(math.prod(s) for s in factored_shapes(shape))
        else:
            elements = STATE_BUFFERS[key](**hyperparameters) * math.prod(shape)
        total += elements * size
    return total
