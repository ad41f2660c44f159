"""Per-leaf rules made into gradient transformations (:func:`leafwise`), and :class:`LeafBatch`.

A rule is written once, as plain functions of one leaf:

* ``init_leaf(p) -> dict`` gives the leaf's buffers, named like ``torch.optim``'s state keys
  (None: zeros like ``p``, or of the shapes ``buffer_shapes(p)`` gives, for each buffer field
  of ``state_type``);
* ``update_leaf(g, buffers, p, step, **hyperparams) -> (u, buffers)`` maps the leaf's update
  ``g`` to ``u`` with out-of-place ops. ``step`` is the 1-based number of this update: an int,
  or a float64 0-d tensor when the count is traced (vmap, compile). ``p`` is the param (None
  when no params were passed).

The state is ``<Name>State(count, *scalars, *buffers)``. On plain tensors without autograd the
update runs ``update_leaf`` once per group of leaves sharing a device and dtype, on
:class:`LeafBatch` lists whose arithmetic maps to ``torch._foreach_*`` kernels, so a new rule
gets a batched path without writing one. Under vmap, grad, ``torch.compile`` or with leaves
that require grad it loops over leaves with ordinary ops."""

from __future__ import annotations

import functools
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
    is_traced,
    next_step,
    scalar,
    tensor_leaves,
    use_plain_path,
    zero_count,
)
from minitrain.optim.base import GradientTransformation, Updates, tagged
from minitrain.tree import OptState, Params

__all__ = ["leafwise", "LeafBatch"]


def _state_type(name: str, init_leaf: Callable | None, state_type: type | None,
                scalars: tuple[str, ...]) -> tuple[type, tuple]:
    """``(state type, buffer names)``: ``state_type`` checked, or one made from ``name``."""
    if state_type is not None:
        fields = tuple(state_type._fields)
        if fields[:1 + len(scalars)] != ("count", *scalars):
            raise ValueError(f"{name}: state_type {state_type.__name__} must start with "
                             f"{('count', *scalars)}")
        return state_type, fields[1 + len(scalars):]
    buffers = tuple(init_leaf(torch.zeros(1, device="cpu")))
    camel = "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\W]+", name) if part)
    state_type = NamedTuple(f"{camel}State",  # type: ignore[misc]
                            [("count", Tensor), *((b, Any) for b in buffers)])
    state_type.__doc__ = f"``count`` updates done and {name}'s per-leaf buffers."
    return state_type, buffers


def leafwise(name: str, init_leaf: Callable[[Tensor], dict[str, Tensor]] | None,
             update_leaf: Callable[..., tuple[Tensor, dict[str, Tensor]]],
             state_type: type | None = None, hyperparams: dict[str, Any] | None = None, *,
             needs_params: bool = False, also_watch: tuple[Any, ...] = (),
             scalars: dict[str, Callable[[], Tensor]] | None = None,
             advance: Callable[..., tuple[dict[str, Any], dict[str, Any]]] | None = None,
             buffer_shapes: Callable[[Tensor], dict[str, tuple[int, ...] | None]] | None = None,
             ) -> GradientTransformation:
    """A transformation from a per-leaf rule (see the module docstring for the contract).

    ``state_type`` (made from ``name`` when None: ``scale_by_foo`` -> ``ScaleByFooState``)
    holds ``count``, the 0-d ``scalars`` (each made by its function), then the buffers;
    ``advance(step, **scalars) -> (new_scalars, per_step)`` gives the next scalars and more
    keyword arguments for ``update_leaf``. ``also_watch``: values that still choose the plain
    path when traced or requiring grad. ``buffer_shapes(p)``: the buffers' shapes where they
    are not the param's (None: a buffer this leaf keeps none of, ``()`` in the state); such a
    rule runs leaf by leaf.

    >>> def sign_leaf(g, buffers, p, step, beta):  # Lion's direction (Chen et al. 2023)
    ...     m = buffers["exp_avg"]
    ...     return torch.sign(torch.lerp(m, g, 1 - beta)), {"exp_avg": torch.lerp(m, g, 0.01)}
    >>> tx = leafwise("scale_by_lion_like", lambda p: {"exp_avg": torch.zeros_like(p)},
    ...               sign_leaf, hyperparams={"beta": 0.9})
    >>> tx.update({"w": torch.tensor([3.0, -0.5])}, tx.init({"w": torch.zeros(2)}))[0]
    {'w': tensor([ 1., -1.])}
    """
    hyper = {key: None if value is None else hyperparameter(key, value)  # None: unset
             for key, value in (hyperparams or {}).items()}
    scalars = scalars or {}
    names = tuple(scalars)
    state_type, buffers = _state_type(name, init_leaf, state_type, names)
    init_leaf = init_leaf or functools.partial(_zeros, buffers, buffer_shapes)

    def init(params: Params) -> OptState:
        tensor_leaves(name, params, "param", floating=bool(buffers))  # state in params' dtypes
        leaves, treespec = _pytree.tree_flatten(params)
        per_leaf = [init_leaf(p) for p in leaves]
        for leaf_buffers in per_leaf:
            if tuple(leaf_buffers) != buffers:
                raise ValueError(f"{name}: init_leaf returned buffers {tuple(leaf_buffers)}, "
                                 f"expected {buffers}")
        return state_type(zero_count(), *(make() for make in scalars.values()), *(
            () if all(_empty(b[key]) for b in per_leaf) else  # unused (AMSGrad's max)
            _pytree.tree_unflatten([b[key] for b in per_leaf], treespec) for key in buffers))

    def update(updates: Updates, state: OptState, params: Params | None = None):
        check_state_type(name, state_type, state)
        if needs_params and params is None:
            raise ValueError(f"{name} needs params: call update(updates, state, params)")
        g_leaves, treespec = _pytree.tree_flatten(updates)
        p_leaves = [None] * len(g_leaves) if params is None else _leaves_like(
            params, g_leaves, treespec, "params", same_dtype=False)
        buffer_leaves = {
            key: [()] * len(g_leaves) if _empty(getattr(state, key)) else
            _leaves_like(getattr(state, key), g_leaves, treespec, f"state.{key}",
                         shapes=buffer_shapes and (buffer_shapes, key)) for key in buffers}
        step = next_step(state.count)
        old = {key: getattr(state, key) for key in names}
        new_scalars, hyper_now = _advance(advance, step, state.count, old, hyper)
        tensors = [*g_leaves, *(p for p in p_leaves if p is not None), state.count]
        if buffer_shapes is not None or use_plain_path(
                tensors, [*hyper_now.values(), *also_watch, *old.values()]):
            new_u, new_buffers = _plain(update_leaf, g_leaves, p_leaves, buffer_leaves, step,
                                        hyper_now)
            count = state.count + 1
        else:
            # Concrete 0-d tensors become numbers: the foreach kernels' scalar overloads.
            numbers = {key: scalar(value) for key, value in hyper_now.items()}
            with torch.no_grad():
                new_u, new_buffers = _batched(update_leaf, g_leaves, p_leaves, buffer_leaves,
                                              step, numbers)
            count = torch.tensor(step, dtype=torch.int64, device="cpu")
        kept = [_like(new_scalars[key], old[key]) for key in names]
        return tree.unflatten(treespec, new_u), state_type(count, *kept, *(
            () if _empty(getattr(state, key)) else
            tree.unflatten(treespec, new_buffers[key]) for key in buffers))

    watched = {"also_watch": also_watch} if also_watch else {}  # a lowering watches them too
    return tagged(name, GradientTransformation(init, update), update_leaf=update_leaf, **hyper,
                  **watched)


def _zeros(buffers: tuple[str, ...], buffer_shapes: Callable | None, p: Tensor) -> dict:
    """The buffers of a rule without ``init_leaf``: zeros like ``p``, or of the shapes
    ``buffer_shapes(p)`` gives (``()`` for None)."""
    if buffer_shapes is None:
        return {key: torch.zeros_like(p, memory_format=torch.preserve_format) for key in buffers}
    return {key: () if shape is None else p.new_zeros(shape)
            for key, shape in buffer_shapes(p).items()}


def _advance(advance: Callable | None, step: Any, count: Tensor, old: dict[str, Any],
             hyper: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The next scalars, and the hyperparameters of this update with ``advance``'s per-step
    ones; the scalars go in as numbers unless traced or requiring grad (whose history is then
    in the hypergradient)."""
    if advance is None:
        return {}, hyper
    traced = is_traced(count) or any(is_traced(v) for v in old.values())
    values = old if traced else {key: v if isinstance(v, Tensor) and v.requires_grad
                                 else scalar(v) for key, v in old.items()}
    new_scalars, per_step = advance(step, **values)
    return new_scalars, {**hyper, **per_step}


def _empty(value: Any) -> bool:
    return type(value) is tuple and len(value) == 0


def _like(value: Any, old: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(old.dtype)
    return torch.tensor(value, dtype=old.dtype, device=old.device)


def _leaves_like(value: Any, g_leaves: list[Tensor], treespec: Any, what: str,
                 same_dtype: bool = True, shapes: tuple[Callable, str] | None = None) -> list[Any]:
    """The leaves of ``value``, refused naming the first whose shape or dtype is not its
    update's; with ``shapes = (buffer_shapes, key)``, whose shape is not
    ``buffer_shapes(g)[key]`` (None: ``()``, a buffer that leaf keeps none of)."""
    leaves, value_spec = _pytree.tree_flatten(value)
    if value_spec != treespec:  # () leaves: compare
        leaves, value_spec = _pytree.tree_flatten(value, is_leaf=_empty if shapes else None)
        if value_spec != _pytree.tree_structure(tree.unflatten(treespec, g_leaves)):
            if len(leaves) != len(g_leaves):
                raise ValueError(
                    f"{what} has {len(leaves)} leaves but the updates have {len(g_leaves)}; "
                    f"pass {what} for the same params (create the state with init(params))")
            raise ValueError(f"{what} and the updates differ in structure; pass matching pytrees")
    for index, (leaf, g) in enumerate(zip(leaves, g_leaves, strict=True)):
        if shapes is None and not isinstance(leaf, Tensor):
            continue
        got = leaf.shape if isinstance(leaf, Tensor) else None
        want = g.shape if shapes is None else shapes[0](g)[shapes[1]]
        if got != want:
            raise ValueError(f"{what} leaf {_leaf_name(g_leaves, treespec, index)!r} has shape "
                             f"{_shown(got)} but its update needs {_shown(want)}; create the "
                             f"state with init(params)")
        if same_dtype and isinstance(leaf, Tensor) and leaf.dtype != g.dtype:
            raise ValueError(
                f"{what} leaf {_leaf_name(g_leaves, treespec, index)!r} is {leaf.dtype} but its "
                f"update is {g.dtype}; pass updates in the params' dtype (torch.optim's grads "
                f"are), or create the state with init(params) for params of the updates' dtype")
    return leaves


def _leaf_name(g_leaves: list[Tensor], treespec: Any, index: int) -> str:
    return tree.named_leaves(tree.unflatten(treespec, g_leaves))[index][0]


def _shown(shape: Any) -> str:
    return "none" if shape is None else str(tuple(shape))


def _plain(update_leaf, g_leaves, p_leaves, buffer_leaves, step, hyper):
    new_u = []
    new_buffers: dict[str, list[Tensor]] = {key: [] for key in buffer_leaves}
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves, strict=True)):
        u, out = update_leaf(g, {k: v[i] for k, v in buffer_leaves.items()}, p, step, **hyper)
        # 0-d leaves would promote to a traced step's float64; no no-op casts (vmap pays each)
        new_u.append(u if u.dtype == g.dtype else u.to(g.dtype))
        for key, value in out.items():
            old = buffer_leaves[key][i]
            new_buffers[key].append(() if not isinstance(old, Tensor) else value
                                    if value.dtype == old.dtype else value.to(old.dtype))
    return new_u, new_buffers


def _batched(update_leaf, g_leaves, p_leaves, buffer_leaves, step, hyper):
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(g_leaves):
        groups.setdefault((g.device, g.dtype), []).append(i)
    new_u: list[Any] = [None] * len(g_leaves)
    new_buffers: dict[str, list[Any]] = {key: [None] * len(g_leaves) for key in buffer_leaves}
    for indices in groups.values():
        p = None if p_leaves[indices[0]] is None else LeafBatch(p_leaves[i] for i in indices)
        buffers = {key: LeafBatch(leaves[i] for i in indices) if isinstance(leaves[0], Tensor)
                   else () for key, leaves in buffer_leaves.items()}
        u, out = update_leaf(LeafBatch(g_leaves[i] for i in indices), buffers, p, step, **hyper)
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


def _by_leaf(method: str) -> Callable:
    return lambda self, *args, **kwargs: _per_leaf(getattr(Tensor, method), (self, *args), kwargs)


class LeafBatch(list):
    """A list of same-device, same-dtype tensors that does arithmetic like one tensor: the ops
    with a ``torch._foreach_*`` kernel run as one call, any other leaf by leaf.

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
        """``self <op> other``: one foreach call with a batch, a number or a 0-d tensor."""
        if isinstance(other, LeafBatch) or isinstance(other, int | float) and not isinstance(
                other, bool) or isinstance(other, Tensor) and other.dim() == 0:
            return _fe(name, self, other)
        method = {"div": "__truediv__"}.get(name, f"__{name}__")
        return _per_leaf(getattr(Tensor, method), (self, other), {})

    __add__ = functools.partialmethod(_binary, name="add")
    __mul__ = functools.partialmethod(_binary, name="mul")
    __truediv__ = functools.partialmethod(_binary, name="div")
    __sub__ = functools.partialmethod(_binary, name="sub")
    __pow__ = functools.partialmethod(_binary, name="pow")

    def __rsub__(self, other):
        if isinstance(other, int | float):  # -x + c equals c - x exactly
            return _fe("add", _fe("neg", self), other)
        return _per_leaf(Tensor.__rsub__, (self, other), {})

    def __neg__(self):
        return _fe("neg", self)

    def __getattr__(self, name):  # tensor methods, leaf by leaf
        if not callable(getattr(Tensor, name)):
            raise AttributeError(name)
        return lambda *args, **kwargs: _by_leaf(name)(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        if args and args[0] == self[0].dtype and not kwargs:
            return self
        return _per_leaf(Tensor.to, (self, *args), kwargs)

    # Rules are pure: ``x += y`` rebinds x to a new batch (list's += would extend the list).
    __radd__ = __iadd__ = __add__
    __rmul__ = __imul__ = __mul__
    __isub__ = __sub__
    __itruediv__ = __truediv__
    __rtruediv__ = _by_leaf("__rtruediv__")
    __gt__, __lt__, __ge__, __le__ = (_by_leaf(f"__{op}__") for op in ("gt", "lt", "ge", "le"))
    sqrt, abs, sign = (lambda self: _fe("sqrt", self), lambda self: _fe("abs", self),
                       lambda self: _fe("sign", self))


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

    results = [func(*(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()})
               for i in range(n)]
    if results and isinstance(results[0], tuple):
        return tuple(LeafBatch(column) for column in zip(*results, strict=True))
    return LeafBatch(results)


def _batches(*values: Any) -> bool:
    return all(isinstance(v, LeafBatch) for v in values)


_FOREACH_FUNCTIONS: dict[Callable, Callable] = {
    **{getattr(torch, name): functools.partial(_fe, name)
       for name in ("sqrt", "abs", "sign", "neg", "exp")},
    torch.lerp: lambda start, end, weight: _fe("lerp", start, end, weight) if _batches(
        start, end) and (isinstance(weight, int | float) or isinstance(weight, Tensor)
                         and weight.dim() == 0) else NotImplemented,
    torch.maximum: lambda a, b: _fe("maximum", a, b) if _batches(a, b) else NotImplemented,
    torch.addcmul: lambda a, t1, t2, *, value=1: _fe("addcmul", a, t1, t2, value=value)
    if _batches(a, t1, t2) and isinstance(value, int | float) else NotImplemented,
}
