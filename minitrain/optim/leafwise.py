"""Gradient transformations: the composable core of :mod:`minitrain.optim` (optax ``_src/base.py``).

A :class:`GradientTransformation` is a pair of pure functions: ``state = tx.init(params)`` and
``updates, state = tx.update(updates, state, params=None)``. :func:`chain` runs several in order,
:func:`apply_updates` adds the final updates to the params, and :func:`as_optimizer` turns any
transformation into an :class:`~minitrain.optim.Optimizer` (``update(grads, state, params,
donate=False) -> (params, state)``), usable wherever one is: the train loop, sweeps, checkpoints
(states are NamedTuples with tensor leaves).

A rule is written once, as a plain function of one leaf, with :func:`leafwise`:

* ``init_leaf(p) -> dict`` gives the leaf's buffers, named like ``torch.optim``'s state keys
  (``exp_avg``, ``square_avg``, ``momentum_buffer``, ...);
* ``update_leaf(g, buffers, p, step, **hyperparams) -> (u, buffers)`` maps one leaf's incoming
  update ``g`` to its outgoing update ``u`` with out-of-place tensor ops. ``step`` is the
  1-based number of this update (torch.optim's ``step``): a Python int, or a float64 0-d tensor
  when the count is traced (vmap, compile). ``p`` is the param (None when the caller passed no
  params and the rule did not ask for them).

The state is ``<Name>State(count, *buffers)``: ``count`` a 0-d int64 tensor of updates done,
each buffer a pytree like params. Called on plain tensors without autograd, the update runs
the same function once per group of leaves sharing a device and dtype, on :class:`LeafBatch`
lists whose arithmetic maps to ``torch._foreach_*`` kernels (any op without a foreach kernel
runs leaf by leaf), so a new rule gets a batched path without writing one. Under vmap, grad,
``torch.compile`` or with leaves that require grad it loops over leaves with ordinary ops.
Hyperparameters are numbers or one-element tensors (squeezed to 0-d like ``torch.optim``'s
``_to_scalar``; more elements are a ``ValueError`` naming the argument).

Lion (Chen et al. 2023, Algorithm 2) in a few lines:

>>> import torch, minitrain as mt
>>> from minitrain.optim import leafwise
>>> def lion(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
...     def update_leaf(g, buffers, p, step, beta1, beta2):
...         m = buffers["exp_avg"]
...         direction = torch.sign(torch.lerp(m, g, 1 - beta1))  # c = b1 m + (1 - b1) g
...         return direction, {"exp_avg": torch.lerp(m, g, 1 - beta2)}
...     return mt.optim.chain(
...         leafwise("scale_by_lion", lambda p: {"exp_avg": torch.zeros_like(p)}, update_leaf,
...                  hyperparams={"beta1": betas[0], "beta2": betas[1]}),
...         mt.optim.add_decayed_weights(weight_decay),
...         mt.optim.scale_by_learning_rate(lr))
>>> tx = lion(lr=0.1)
>>> params = {"w": torch.tensor([1.0, -1.0])}
>>> state = tx.init(params)
>>> updates, state = tx.update({"w": torch.tensor([3.0, -0.5])}, state, params)
>>> mt.optim.apply_updates(params, updates)["w"]
tensor([ 0.9000, -0.9000])
>>> opt = mt.optim.as_optimizer(lion(lr=0.1))  # the same rule as an Optimizer
>>> params, opt_state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
>>> params["w"]
tensor([ 0.9000, -1.1000])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import (
    check_state_type,
    hyperparameter,
    scalar,
    tensor_leaves,
    use_plain_path,
)
from minitrain.optim._host import next_step, zero_count
from minitrain.optim.base import GradientTransformation, Updates, tagged
from minitrain.tree import OptState, Params

__all__ = ["leafwise", "LeafBatch", "unused"]


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\W]+", name) if part)


def _state_type(name: str, init_leaf: Callable, state_type: type | None) -> tuple[type, tuple]:
    """``(state type, buffer names)``: ``state_type`` checked, or one made from ``name``."""
    if state_type is not None:
        fields = tuple(state_type._fields)
        if fields[:1] != ("count",):
            raise ValueError(f"{name}: state_type {state_type.__name__} must start with 'count'")
        return state_type, fields[1:]
    buffers = tuple(init_leaf(torch.zeros(1, device="cpu")))
    fields = [("count", Tensor), *((b, Any) for b in buffers)]
    state_type = NamedTuple(f"{_camel(name)}State", fields)  # type: ignore[misc]
    state_type.__doc__ = f"``count`` updates done and {name}'s per-leaf buffers."
    return state_type, buffers


def leafwise(
    name: str,
    init_leaf: Callable[[Tensor], dict[str, Tensor]],
    update_leaf: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    state_type: type | None = None,
    hyperparams: dict[str, Any] | None = None,
    *,
    needs_params: bool = False,
    also_watch: tuple[Any, ...] = (),
) -> GradientTransformation:
    """A transformation from a per-leaf rule (see the module docstring for the contract).

    Args:
        name: the rule's name, in errors and in :func:`spec`.
        init_leaf: ``p -> {buffer name: tensor}`` (an empty dict for a rule without state).
        update_leaf: ``(g, buffers, p, step, **hyperparams) -> (u, new_buffers)``.
        state_type: a NamedTuple with fields ``count`` then the buffer names; made from
            ``name`` (``scale_by_foo`` -> ``ScaleByFooState``) when None.
        hyperparams: keyword arguments for ``update_leaf``, checked by :func:`hyperparameter`.
        needs_params: whether ``update`` must be given params.
        also_watch: values ``update_leaf`` does not take that still choose the plain path
            when traced or requiring grad (a hyperparameter carried in the buffers).

    >>> import torch
    >>> tx = leafwise("double", lambda p: {}, lambda g, b, p, step: (2 * g, b))
    >>> tx.update([torch.ones(2)], tx.init([torch.ones(2)]))[0]
    [tensor([2., 2.])]
    """
    hyper = {key: hyperparameter(key, value) for key, value in (hyperparams or {}).items()}
    state_type, buffers = _state_type(name, init_leaf, state_type)

    def init(params: Params) -> OptState:
        tensor_leaves(name, params, "param", floating=bool(buffers))  # state in params' dtypes
        leaves, treespec = _pytree.tree_flatten(params)
        per_leaf = [init_leaf(p) for p in leaves]
        for leaf_buffers in per_leaf:
            if tuple(leaf_buffers) != buffers:
                raise ValueError(
                    f"{name}: init_leaf returned buffers {tuple(leaf_buffers)}, expected {buffers}"
                )
        return state_type(
            zero_count(),
            *(() if unused(per_leaf, key) else
              _pytree.tree_unflatten([b[key] for b in per_leaf], treespec) for key in buffers),
        )

    def update(updates: Updates, state: OptState, params: Params | None = None):
        check_state_type(name, state_type, state)
        if needs_params and params is None:
            raise ValueError(f"{name} needs params: call update(updates, state, params)")
        g_leaves, treespec = _pytree.tree_flatten(updates)
        p_leaves = [None] * len(g_leaves) if params is None else _leaves_like(
            params, g_leaves, treespec, "params", same_dtype=False
        )
        buffer_leaves = {
            key: [()] * len(g_leaves) if _empty(getattr(state, key)) else
            _leaves_like(getattr(state, key), g_leaves, treespec, f"state.{key}")
            for key in buffers
        }
        tensors = [*g_leaves, *(p for p in p_leaves if p is not None), state.count]
        step = next_step(state.count)
        if use_plain_path(tensors, [*hyper.values(), *also_watch]):
            new_u, new_buffers = _plain(update_leaf, g_leaves, p_leaves, buffer_leaves, step, hyper)
            count = state.count + 1
        else:
            # Concrete 0-d tensors become numbers: the foreach kernels' scalar overloads.
            numbers = {key: scalar(value) for key, value in hyper.items()}
            with torch.no_grad():
                new_u, new_buffers = _batched(
                    update_leaf, g_leaves, p_leaves, buffer_leaves, step, numbers
                )
            count = torch.tensor(step, dtype=torch.int64, device="cpu")
        return _pytree.tree_unflatten(new_u, treespec), state_type(
            count, *(() if _empty(getattr(state, key)) else
                     _pytree.tree_unflatten(new_buffers[key], treespec) for key in buffers)
        )

    watched = {"also_watch": also_watch} if also_watch else {}  # a lowering watches them too
    return tagged(name, GradientTransformation(init, update), update_leaf=update_leaf, **hyper,
                  **watched)


def unused(per_leaf: list[dict[str, Any]], key: str) -> bool:
    """Whether buffer ``key`` is ``()`` for every leaf: a buffer this configuration does not use
    (AMSGrad's max without amsgrad); its state field is then ``()``."""
    return all(_empty(b[key]) for b in per_leaf)


def _empty(value: Any) -> bool:
    return type(value) is tuple and len(value) == 0


def _leaves_like(value: Any, g_leaves: list[Tensor], treespec: Any, what: str,
                 same_dtype: bool = True) -> list[Any]:
    leaves, value_spec = _pytree.tree_flatten(value)
    if value_spec != treespec:
        if len(leaves) != len(g_leaves):
            raise ValueError(
                f"{what} has {len(leaves)} leaves but the updates have {len(g_leaves)}; "
                f"pass {what} for the same params (create the state with init(params))"
            )
        raise ValueError(f"{what} and the updates differ in structure; pass matching pytrees")
    for (path, _), leaf, g in zip(_pytree.tree_flatten_with_path(value)[0], leaves, g_leaves,
                                  strict=True):
        if isinstance(leaf, Tensor) and leaf.shape != g.shape:
            raise ValueError(
                f"{what} leaf {tree._path_name(path)!r} has shape {tuple(leaf.shape)} but its "
                f"update has {tuple(g.shape)}; create the state with init(params)"
            )
        if same_dtype and isinstance(leaf, Tensor) and isinstance(g, Tensor) and \
                leaf.dtype != g.dtype:  # a state in another dtype than its update: named
            raise ValueError(
                f"{what} leaf {tree._path_name(path)!r} is {leaf.dtype} but its update is "
                f"{g.dtype}; pass updates in the params' dtype (torch.optim's grads are), or "
                f"create the state with init(params) for params of the updates' dtype"
            )
    return leaves


def _plain(update_leaf, g_leaves, p_leaves, buffer_leaves, step, hyper):
    new_u = []
    new_buffers: dict[str, list[Tensor]] = {key: [] for key in buffer_leaves}
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves, strict=True)):
        u, out = update_leaf(g, {k: v[i] for k, v in buffer_leaves.items()}, p, step, **hyper)
        new_u.append(u.to(g.dtype))  # 0-d leaves would promote to a traced step's float64
        for key, value in out.items():
            old = buffer_leaves[key][i]
            new_buffers[key].append(value.to(old.dtype) if isinstance(old, Tensor) else ())
    return new_u, new_buffers


def _batched(update_leaf, g_leaves, p_leaves, buffer_leaves, step, hyper):
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(g_leaves):
        groups.setdefault((g.device, g.dtype), []).append(i)
    new_u: list[Any] = [None] * len(g_leaves)
    new_buffers: dict[str, list[Any]] = {key: [None] * len(g_leaves) for key in buffer_leaves}
    for indices in groups.values():
        p = None if p_leaves[indices[0]] is None else LeafBatch(p_leaves[i] for i in indices)
        u, out = update_leaf(
            LeafBatch(g_leaves[i] for i in indices),
            {key: LeafBatch(leaves[i] for i in indices) if isinstance(leaves[0], Tensor) else ()
             for key, leaves in buffer_leaves.items()},
            p, step, **hyper,
        )
        for position, i in enumerate(indices):
            new_u[i] = _as_leaf(u, position, len(indices), g_leaves[i])
            for key, value in out.items():
                new_buffers[key][i] = () if isinstance(value, tuple) and not isinstance(
                    value, LeafBatch) else _as_leaf(value, position, len(indices), g_leaves[i])
    return new_u, new_buffers


def _as_leaf(value: Any, position: int, size: int, like: Tensor) -> Tensor:
    if isinstance(value, LeafBatch):
        if len(value) != size:
            raise ValueError("a rule returned a batch of the wrong length; return per-leaf ops")
        return value[position]
    if isinstance(value, Tensor):  # e.g. the rule returned an input buffer unchanged
        return value
    return torch.full_like(like, float(value))


# -- LeafBatch: lists of tensors that do arithmetic like one tensor --------------------------------


class LeafBatch(list):
    """A list of same-device, same-dtype tensors that does arithmetic like one tensor.

    Arithmetic and the torch functions with a ``torch._foreach_*`` kernel run as one foreach
    call; any other torch function or tensor method runs leaf by leaf, so a per-leaf rule works
    unchanged on a batch.

    >>> b = LeafBatch([torch.ones(2), torch.zeros(3)])
    >>> list(torch.sqrt(b * 4 + 1))
    [tensor([2.2361, 2.2361]), tensor([1., 1., 1.])]
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        foreach = _FOREACH_FUNCTIONS.get(func)
        if foreach is not None:
            result = foreach(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return _per_leaf(func, args, kwargs)

    def _binary(self, other, name):
        if isinstance(other, LeafBatch) or isinstance(other, int | float) and not isinstance(
            other, bool
        ):
            return _fe(name, self, other)
        if isinstance(other, Tensor) and other.dim() == 0 and name in ("add", "mul", "div"):
            return _fe(name, self, other)
        return _per_leaf(getattr(Tensor, f"__{name}__" if name != "div" else "__truediv__"),
                         (self, other), {})

    def __add__(self, other):
        return self._binary(other, "add")

    def __radd__(self, other):
        return self._binary(other, "add")

    def __mul__(self, other):
        return self._binary(other, "mul")

    def __rmul__(self, other):
        return self._binary(other, "mul")

    def __truediv__(self, other):
        return self._binary(other, "div")

    def __sub__(self, other):
        if isinstance(other, LeafBatch) or isinstance(other, int | float):
            return _fe("sub", self, other)
        return _per_leaf(Tensor.__sub__, (self, other), {})

    def __rsub__(self, other):
        if isinstance(other, int | float):  # -x + c equals c - x exactly
            return _fe("add", _fe("neg", self), other)
        return _per_leaf(Tensor.__rsub__, (self, other), {})

    def __rtruediv__(self, other):
        return _per_leaf(Tensor.__rtruediv__, (self, other), {})

    def __neg__(self):
        return _fe("neg", self)

    # Rules are pure: ``x += y`` rebinds x to a new batch (list's += would extend the list).
    __iadd__ = __add__
    __imul__ = __mul__
    __isub__ = __sub__
    __itruediv__ = __truediv__

    def __gt__(self, other):
        return _per_leaf(Tensor.__gt__, (self, other), {})

    def __lt__(self, other):
        return _per_leaf(Tensor.__lt__, (self, other), {})

    def __ge__(self, other):
        return _per_leaf(Tensor.__ge__, (self, other), {})

    def __le__(self, other):
        return _per_leaf(Tensor.__le__, (self, other), {})

    def __pow__(self, other):
        if isinstance(other, int | float):
            return _fe("pow", self, other)
        return _per_leaf(Tensor.__pow__, (self, other), {})

    def __getattr__(self, name):  # tensor methods, leaf by leaf
        method = getattr(Tensor, name)
        if not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: _per_leaf(method, (self, *args), kwargs)

    def sqrt(self):
        return _fe("sqrt", self)

    def abs(self):
        return _fe("abs", self)

    def sign(self):
        return _fe("sign", self)

    def to(self, *args, **kwargs):
        return self if args and args[0] == self[0].dtype and not kwargs else _per_leaf(
            Tensor.to, (self, *args), kwargs
        )


def _fe(name: str, *args: Any, **kwargs: Any) -> LeafBatch:
    """``torch._foreach_<name>`` on plain lists (a LeafBatch argument would dispatch back to
    ``LeafBatch.__torch_function__``)."""
    raw = [list(a) if isinstance(a, LeafBatch) else a for a in args]
    return LeafBatch(_torch.foreach[name](*raw, **kwargs))


def _per_leaf(func: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    n = next(len(a) for a in (*args, *kwargs.values()) if isinstance(a, LeafBatch))

    def pick(value: Any, i: int) -> Any:
        if isinstance(value, LeafBatch):
            return value[i]
        if isinstance(value, tuple | list) and any(isinstance(v, LeafBatch) for v in value):
            return type(value)(pick(v, i) for v in value)
        return value

    results = [
        func(*(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()})
        for i in range(n)
    ]
    if results and isinstance(results[0], tuple):
        return tuple(LeafBatch(column) for column in zip(*results, strict=True))
    return LeafBatch(results)


def _foreach_lerp(start, end, weight):
    if isinstance(start, LeafBatch) and isinstance(end, LeafBatch) and (
        isinstance(weight, int | float) or isinstance(weight, Tensor) and weight.dim() == 0
    ):
        return _fe("lerp", start, end, weight)
    return NotImplemented


def _foreach_maximum(a, b):
    if isinstance(a, LeafBatch) and isinstance(b, LeafBatch):
        return _fe("maximum", a, b)
    return NotImplemented


def _foreach_addcmul(a, t1, t2, *, value=1):
    if all(isinstance(x, LeafBatch) for x in (a, t1, t2)) and isinstance(value, int | float):
        return _fe("addcmul", a, t1, t2, value=value)
    return NotImplemented


_FOREACH_FUNCTIONS: dict[Callable, Callable] = {
    torch.sqrt: lambda x: _fe("sqrt", x),
    torch.abs: lambda x: _fe("abs", x),
    torch.sign: lambda x: _fe("sign", x),
    torch.neg: lambda x: _fe("neg", x),
    torch.exp: lambda x: _fe("exp", x),
    torch.lerp: _foreach_lerp,
    torch.maximum: _foreach_maximum,
    torch.addcmul: _foreach_addcmul,
}
