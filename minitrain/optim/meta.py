"""Differentiable optimization: K pure updates unrolled, differentiable end to end with
respect to the initial params (MAML, Finn et al. 2017) or hyperparameters given as tensors
("hypergradients", Maclaurin et al. 2015), by autograd or ``torch.func``. Memory grows with K:
every update's intermediates are kept for the backward pass."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import is_traced
from minitrain.optim.base import EmptyState, Optimizer, apply_updates
from minitrain.optim.kernels import members
from minitrain.optim.transforms import ScaleByLearningRateState
from minitrain.tree import OptState, Params, PyTree

__all__ = ["Unrolled", "unroll"]


class Unrolled:
    """What :func:`unroll` returns, unpacked as ``params, state, losses``: the params and state
    after the last update and the loss before each update, ``(K,)``. The state and losses are
    built when first read (a MAML task loss reads only the params: 1% of its step)."""

    __slots__ = ("params", "_rest")
    _fields = ("params", "state", "losses")

    def __new__(cls, params: Params, state: OptState, losses: Any, _later: Any = None) -> Unrolled:
        unrolled = object.__new__(cls)  # (__new__, as a tuple's: a pickled NamedTuple loads)
        unrolled.params, unrolled._rest = params, (state, losses) if _later is None else _later
        return unrolled

    def _built(self) -> tuple[OptState, Any]:
        if callable(self._rest):  # unroll's _later (no state is callable)
            self._rest = self._rest()
        return self._rest

    state = property(lambda self: self._built()[0], doc="The optimizer state.")
    losses = property(lambda self: self._built()[1], doc="The loss before each update, (K,).")

    def __iter__(self) -> Iterator[Any]:
        return iter((self.params, *self._built()))

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int | slice) -> Any:
        return tuple(self)[index]

    def __repr__(self) -> str:
        return "Unrolled(params={!r}, state={!r}, losses={!r})".format(*self)

    def __reduce__(self) -> tuple:  # (pickled and copied built)
        return Unrolled, tuple(self)


_pytree.register_pytree_node(
    Unrolled, lambda u: (list(u), None), lambda leaves, _: Unrolled(*leaves),
    serialized_type_name="minitrain.optim.Unrolled",
    flatten_with_keys_fn=lambda u: (
        [(_pytree.GetAttrKey(k), v) for k, v in zip(Unrolled._fields, u, strict=True)], None))


def unroll(optimizer: Any, loss_fn: Callable[[Params, PyTree], Tensor], params: Params,
           batches: Iterable[PyTree]) -> Unrolled:
    """Take one update per batch of ``loss_fn(params, batch)``; differentiable throughout.

    ``optimizer`` is an optimizer or a gradient transformation (whose updates are added to the
    params), started from ``optimizer.init(params)``. Hyperparameters to differentiate are
    passed to the optimizer as tensors (``sgd(lr=lr_tensor)``).

    >>> import torch, minitrain as mt
    >>> lr = torch.tensor(0.1, requires_grad=True)
    >>> loss_fn = lambda p, x: ((p["w"] - x) ** 2).sum()
    >>> out = unroll(mt.optim.sgd(lr=lr), loss_fn, {"w": torch.zeros(1)}, [torch.ones(1)] * 3)
    >>> out.params["w"].detach()  # 1 - (1 - 2 lr)^3
    tensor([0.4880])
    >>> torch.autograd.grad(out.params["w"].sum(), lr)  # 6 (1 - 2 lr)^2
    (tensor(3.8400),)
    """
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ValueError(f"unroll needs an optimizer or gradient transformation (init, update), "
                         f"got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise ValueError("unroll needs loss_fn(params, batch) -> 0-d tensor")
    if torch.is_grad_enabled() and _torch.peek_interpreter_stack() is None:
        params = _differentiable(params)
    shape = getattr(getattr(optimizer.update, "lowered", None), "shape", None)
    lr = members.plain_sgd_lr(shape)
    if lr is not None:  # flattened once, for the adds below (a dict of tensors as it is)
        keys = list(params) if type(params) is dict and all(  # (nested: flattened)
            isinstance(p, Tensor) for p in params.values()) else None
        leaves, structure = (list(params.values()), None) if keys is not None else \
            _pytree.tree_flatten(params)
        lr = lr if leaves and all(isinstance(p, Tensor) and p.is_floating_point()
                                  for p in leaves) else None
    state = optimizer.init(params) if lr is None else None
    grad_and_value = torch.func.grad_and_value(loss_fn)
    losses = []
    for batch in batches:
        grads, loss = grad_and_value(params, batch)
        if lr is not None:  # plain SGD: torch.optim.SGD's one op a leaf, the chain's checks met
            leaves = [torch.add(p, g, alpha=-lr) for p, g in zip(leaves, [grads[k] for k in keys]
                      if keys is not None else _pytree.tree_leaves(grads), strict=True)]
            params = dict(zip(keys, leaves, strict=True)) if keys is not None else \
                _pytree.tree_unflatten(leaves, structure)
        elif isinstance(optimizer, Optimizer):
            params, state = optimizer.update(grads, state, params)
        else:
            updates, state = optimizer.update(grads, state, params)
            params = apply_updates(params, updates)
        losses.append(loss)
    if not losses:
        raise ValueError("unroll got no batches; pass one batch per update")

    def rest(modes: tuple = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())) -> tuple:
        with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):  # the updates'
            stacked = torch.stack(losses) if len(losses) > 1 else losses[0].unsqueeze(0)
        if lr is None:
            return state, stacked
        lr_state = ScaleByLearningRateState(  # the chain's state: all empty but the lr's
            torch.scalar_tensor(len(losses), dtype=torch.int64, device="cpu"),
            torch.scalar_tensor(lr, dtype=torch.float32, device="cpu"))
        return tuple(lr_state if i == shape.lr_position else EmptyState()
                     for i in range(shape.length)), stacked

    return Unrolled(params, None, None, rest)


def _differentiable(params: Params) -> Params:
    """``params`` with every plain floating leaf requiring grad (an alias where it did not), so
    every update outside ``torch.func`` takes the differentiable path, even where only a
    hyperparameter the optimizer does not watch (eps, a value in its state) needs grad."""
    def leaf(p: Any) -> Any:
        return p if (not isinstance(p, Tensor) or p.requires_grad or not p.is_floating_point()
                     or is_traced(p)) else p.detach().requires_grad_(True)

    return tree.map(leaf, params)
