"""Rprop (Riedmiller & Braun 1993), as torch.optim.Rprop computes it."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import check_pair, scalar
from minitrain.optim._family import (
    Rule,
    check_range,
    family_optimizer,
    rule_transform,
    zeros,
)
from minitrain.optim._host import host_tensor
from minitrain.optim.base import Optimizer
from minitrain.tree import Params

__all__ = ["rprop", "scale_by_rprop", "ScaleByRpropState"]


class ScaleByRpropState(NamedTuple):
    """``count``, ``lr`` (the initial step size, torch's group ``lr``), ``prev`` (last
    gradient, zero where it changed sign) and ``step_size``."""

    count: Tensor
    lr: Tensor
    prev: Params
    step_size: Params


def rprop_leaf(g, buffers, p, step, etaminus, etaplus, step_size_min, step_size_max):
    """torch's ``_single_tensor_rprop``: grow each step size by ``etaplus`` where the gradient
    kept its sign, shrink it by ``etaminus`` (and skip the step) where it flipped; the update
    is ``-sign(g) * step_size``."""
    sign = torch.sign(g * buffers["prev"])
    # The factors in the leaf's dtype, as torch writes them into its ``sign`` tensor (Python
    # numbers alone would make a float32 ``where``: float32 etas for float64 leaves, a float32
    # step size for bf16 / fp16 ones).
    factor = torch.where(sign > 0, etaplus,
                         torch.where(sign < 0, etaminus, torch.ones_like(sign)))
    step_size = torch.clamp(buffers["step_size"] * factor, step_size_min, step_size_max)
    kept = torch.where(sign < 0, 0.0, g)
    return -torch.sign(kept) * step_size, {"prev": kept, "step_size": step_size}


def _initial_step_size(p: Tensor, lr: Any) -> Tensor:
    """torch's ``full_like(grad, lr)``; a tensor lr (traced under ``vmap``, say) is added to
    zeros, which needs no ``item()``."""
    if isinstance(lr, Tensor):
        return zeros(p) + lr
    return torch.full_like(p, lr, memory_format=torch.preserve_format)


def _rule(lr: Any, etas: Any, step_sizes: Any) -> Rule:
    if callable(lr) and not isinstance(lr, Tensor):
        raise ValueError("invalid lr: Rprop's lr is its initial step size; pass a number")
    lr = check_range("lr", lr, 0.0)
    etaminus, etaplus = check_pair("etas", etas)
    low, high = scalar(etaminus), scalar(etaplus)  # traced ones (vmap) stay unchecked
    if isinstance(low, int | float) and not 0.0 < low < 1.0 \
            or isinstance(high, int | float) and not 1.0 < high:
        raise ValueError(
            f"invalid etas=({low}, {high}): they must satisfy 0 < etas[0] < 1 < etas[1]; "
            f"pass e.g. (0.5, 1.2)"
        )
    smallest, largest = check_pair("step_sizes", step_sizes)
    check_range("step_sizes[0]", smallest, 0.0)
    floor = scalar(smallest)  # a traced one (torch.func) bounds step_sizes[1] by 0 alone
    check_range("step_sizes[1]", largest, floor if isinstance(floor, int | float) else 0.0)
    init_leaf = lambda p: {"prev": zeros(p),  # noqa: E731
                           "step_size": _initial_step_size(p, lr)}
    initial = host_tensor(lr, torch.float32)
    return Rule("scale_by_rprop", ScaleByRpropState, init_leaf, rprop_leaf,
                dict(etaminus=etaminus, etaplus=etaplus, step_size_min=smallest,
                     step_size_max=largest),
                scalars={"lr": lambda: initial.clone()},
                advance=lambda step, lr: ({"lr": lr}, {}))




def scale_by_rprop(lr: Any = 1e-2, etas: tuple[Any, Any] = (0.5, 1.2),
                   step_sizes: tuple[Any, Any] = (1e-6, 50)):
    """Rprop's whole step; ``lr`` is the initial step size of every coordinate.

    >>> import torch
    >>> tx = scale_by_rprop(lr=0.1)
    >>> state = tx.init([torch.zeros(2)])
    >>> for g in ([1.0, 1.0], [1.0, -1.0]):
    ...     updates, state = tx.update([torch.tensor(g)], state)
    >>> updates
    [tensor([-0.1200, -0.0000])]
    """
    return rule_transform(_rule(lr, etas, step_sizes))


def rprop(lr: Any = 1e-2, etas: tuple[Any, Any] = (0.5, 1.2),
          step_sizes: tuple[Any, Any] = (1e-6, 50), *, maximize: bool = False) -> Optimizer:
    """torch.optim.Rprop.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.rprop(lr=0.1)
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> params, state = opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.9000, 1.1000])
    """
    return family_optimizer(_rule(lr, etas, step_sizes), maximize=maximize)
