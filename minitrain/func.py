"""Function transforms: thin wrappers over ``torch.func`` with JAX's argument order.

``torch.func.grad_and_value`` returns ``(grads, value)``; :func:`value_and_grad` returns
``(value, grads)`` as ``jax.value_and_grad`` does. :func:`from_module` turns any ``nn.Module``
into a params pytree and a pure apply function through ``torch.func.functional_call``.

>>> import torch
>>> loss = lambda params, x: (params["w"] * x).sum()
>>> value_and_grad(loss)({"w": torch.tensor([2.0])}, torch.tensor([3.0]))
(tensor(6.), {'w': tensor([3.])})
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minitrain.tree import Params

__all__ = ["value_and_grad", "grad", "vmap", "from_module"]

vmap = torch.func.vmap
"""``torch.func.vmap``, re-exported: ``vmap(f, in_dims=0, out_dims=0, randomness="error")``."""


def value_and_grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Return ``f(*args) -> (value, grads)``; with ``has_aux``, ``((value, aux), grads)``.

    ``fn`` must return a 0-d tensor (or ``(0-d tensor, aux)`` with ``has_aux``, aux a pytree of
    tensors). Grads have the
    structure of the argument(s) named by ``argnums``.

    >>> f = lambda p: ((p["w"] ** 2).sum(), {"w_max": p["w"].max()})
    >>> (v, aux), g = value_and_grad(f, has_aux=True)({"w": torch.tensor([1.0, 2.0])})
    >>> v, aux, g
    (tensor(5.), {'w_max': tensor(2.)}, {'w': tensor([2., 4.])})
    """
    grad_and_value = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        grads, value = grad_and_value(*args, **kwargs)
        return value, grads

    return wrapped


def grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """Return ``f(*args) -> grads`` (``(grads, aux)`` with ``has_aux``), as ``jax.grad``.

    >>> grad(lambda w: (w ** 3).sum())(torch.tensor([1.0, 2.0]))
    tensor([ 3., 12.])
    """
    return torch.func.grad(fn, argnums=argnums, has_aux=has_aux)


def from_module(module: nn.Module) -> tuple[Params, Callable[..., Any]]:
    """Split an ``nn.Module`` into ``(params, apply)`` with ``apply(params, *args, **kwargs)``.

    ``params`` is a dict of detached copies of the trainable parameters, keyed by their
    ``named_parameters()`` names; buffers (e.g. BatchNorm statistics) are copied too and held by
    ``apply``. The module itself is only a template: training ``params`` never changes it.

    >>> net = torch.nn.Linear(3, 2)
    >>> params, apply = from_module(net)
    >>> sorted(params), apply(params, torch.zeros(4, 3)).shape
    (['bias', 'weight'], torch.Size([4, 2]))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_module expects a torch.nn.Module, got {type(module).__name__}")
    params = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    frozen = {
        name: p.detach().clone() for name, p in module.named_parameters() if not p.requires_grad
    }
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}

    def apply(params: Params, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, (params, frozen, buffers), args, kwargs)

    return params, apply
