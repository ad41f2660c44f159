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

import functools
import inspect
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._host import next_step, zero_count
from minitrain.optim._leafbatch import LeafBatch
from minitrain.optim.base import Optimizer, check_grads, scalar, use_plain_path
from minitrain.optim.kernels.checks import (
    donatable,
    grad_leaf_error,
    naming_bad_grads,
    none_param_error,
)
from minitrain.optim.kernels.lowering import lower
from minitrain.tree import Grads, OptState, Params

__all__ = [
    "GradientTransformation", "EmptyState", "Updates", "identity", "chain", "ChainState",
    "apply_updates", "leafwise", "LeafBatch", "hyperparameter", "check_like", "check_state_type",
    "check_pair", "as_optimizer", "spec", "extra_args",
]

Updates = Grads
"""A pytree like params: what a transformation maps (gradients in, updates out)."""


class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(updates, state, params=None) -> (updates, state)``.

    >>> import torch, minitrain as mt
    >>> tx = mt.optim.scale(-0.5)
    >>> updates, state = tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))
    >>> updates["w"]
    tensor([-1.])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


def spec(tx: GradientTransformation) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` a transformation was built with, or None: what lowerings match.

    >>> import minitrain as mt
    >>> spec(mt.optim.scale(2.0))
    ('scale', {'step_size': 2.0})
    """
    return getattr(tx.update, "minitrain_spec", None)


def tagged(name: str, tx: GradientTransformation, **arguments: Any) -> GradientTransformation:
    """``tx`` with ``(name, arguments)`` attached to its update function (see :func:`spec`),
    taking tensor leaves only (:func:`tensor_leaves`); its update promotes integer updates
    (:func:`floating_updates`) and names a sparse grad (:func:`naming_bad_grads`)."""
    inner = naming_bad_grads(tx.update)

    @functools.wraps(inner)
    def update(updates, state, params=None, **extra):
        if params is not None:
            tensor_leaves(name, params, "param")
        return inner(floating_updates(name, updates, params), state, params, **extra)

    @functools.wraps(tx.init)
    def init(params):
        tensor_leaves(name, params, "param")
        return tx.init(params)

    update.minitrain_spec = (name, arguments)  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


def tensor_leaves(name: str, values: Any, what: str, floating: bool = False) -> list[Tensor]:
    """The leaves of ``values`` (``what``: "updates leaf", "grads leaf", "param"), refused in
    one line naming the first that is no tensor (``floating``: no floating or complex tensor).

    >>> tensor_leaves("scale", {"a": 2.0}, "updates leaf")
    Traceback (most recent call last):
    ...
    ValueError: scale: updates leaf 'a' is of type float, not a tensor; pass torch.tensor(2.0)
    """
    leaves = _pytree.tree_leaves(values)
    if all(isinstance(x, Tensor) and (not floating or _inexact(x)) for x in leaves):
        return leaves
    at, leaf = next((n, x) for n, x in tree.named_leaves(values)
                    if not isinstance(x, Tensor) or floating and not _inexact(x))
    if leaf is None:
        raise grad_leaf_error(values) if what != "param" else none_param_error(values)
    if isinstance(leaf, Tensor):
        raise ValueError(f"{name} keeps state like each param, and param {at!r} is {leaf.dtype};"
                         f" pass floating-point params (optimizers update those only)")
    raise ValueError(f"{name}: {what} {at!r} is of type {type(leaf).__name__}, not a "
                     f"tensor; pass {_tensor_hint(leaf)}")


def _tensor_hint(leaf: Any) -> str:
    """How to pass ``leaf`` as a tensor: ``torch.tensor(2.0)`` for a number (numpy's too).

    >>> _tensor_hint(2), _tensor_hint(1j), _tensor_hint("x")
    ('torch.tensor(2.0)', 'torch.tensor(1j)', 'a tensor (torch.as_tensor)')
    """
    try:
        value = complex(leaf) if isinstance(leaf, numbers.Number) else None
    except (OverflowError, TypeError, ValueError):  # an int beyond float, say
        value = None
    if value is None:
        return "a tensor (torch.as_tensor)"
    return f"torch.tensor({value if value.imag else value.real!r})"


def _inexact(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def floating_updates(name: str, updates: Any, params: Any = None) -> Any:
    """``updates`` (checked by :func:`tensor_leaves`) with each integer or bool leaf promoted
    to its param's floating dtype, else (no params, an integer param) the default float dtype:
    torch's promotion of ``int_tensor + param`` and of ``int_tensor * 0.5``."""
    leaves = tensor_leaves(name, updates, "updates leaf")
    if all(_inexact(u) for u in leaves):
        return updates
    p_leaves = [] if params is None else _pytree.tree_leaves(params)  # a mismatch: named later
    p_leaves = p_leaves if len(p_leaves) == len(leaves) else [None] * len(leaves)
    return _pytree.tree_unflatten([u if _inexact(u) else u.to(
        p.dtype if isinstance(p, Tensor) and _inexact(p) else torch.get_default_dtype())
        for u, p in zip(leaves, p_leaves, strict=True)], _pytree.tree_structure(updates))


def check_state_type(name: str, state_type: type, state: Any) -> None:
    """``ValueError`` unless ``state`` is the ``state_type`` that ``name``'s init returns."""
    if not isinstance(state, state_type):
        raise ValueError(
            f"{name} expected a {state_type.__name__}, got {type(state).__name__}; "
            f"pass the state returned by its init(params)"
        )


def check_like(a: Any, b: Any, names: tuple[str, str]) -> None:
    """``ValueError`` naming the first leaf where ``a`` and ``b`` differ in structure or where
    two tensors differ in shape (a cheap pass over the leaves first; the named check only on a
    mismatch). Other leaves (a None grad, say) are left to the update, whose error names them.

    >>> check_like({"w": torch.ones(3)}, {"w": torch.ones(4)}, ("params", "updates"))
    Traceback (most recent call last):
    ...
    ValueError: params and updates differ at leaf 'w': shape (3,) vs (4,); pass trees ...
    """
    leaves_a, leaves_b = tree.leaves(a), tree.leaves(b)
    if len(leaves_a) != len(leaves_b) or any(
        isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape != y.shape
        for x, y in zip(leaves_a, leaves_b, strict=True)
    ) or tree.structure(a) != tree.structure(b):
        tree.assert_same_structure(a, b, names=names, check_shapes=True)


def identity() -> GradientTransformation:
    """Pass updates through unchanged.

    >>> import torch
    >>> identity().update({"w": torch.ones(1)}, EmptyState())[0]
    {'w': tensor([1.])}
    """

    def update(updates, state, params=None):
        return updates, state

    return tagged("identity", GradientTransformation(lambda params: EmptyState(), update))


def extra_args(tx: GradientTransformation) -> frozenset[str] | None:
    """The keyword arguments beyond ``(updates, state, params)`` that ``tx.update`` takes
    (optax's ``with_extra_args_support``), e.g. ``{"value"}`` for ``reduce_on_plateau``; None
    when it takes any (``**kwargs``). Wrappers declare theirs as ``update.extra_args``.

    >>> import minitrain as mt
    >>> extra_args(mt.optim.reduce_on_plateau()), extra_args(mt.optim.scale(2.0))
    (frozenset({'value'}), frozenset())
    >>> sorted(extra_args(chain(mt.optim.scale_by_adam(), mt.optim.reduce_on_plateau())))
    ['value']
    """
    inners = getattr(tx.update, "extra_inners", None)
    if inners is not None:  # a wrapper: what any of its transformations takes
        takes = [extra_args(inner) for inner in inners]
        return None if any(t is None for t in takes) else frozenset().union(*takes)
    declared = getattr(tx.update, "extra_args", False)
    if declared is not False:
        return declared
    try:
        parameters = list(inspect.signature(tx.update).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: no extra arguments
        return frozenset()
    names = set()
    for index, p in enumerate(parameters):
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and index >= 3):
            names.add(p.name)
    return frozenset(names)


def forwards_extra_args(update: Callable, inners: Sequence[GradientTransformation]) -> Callable:
    """Mark a wrapper's ``update(..., **extra)`` as taking what any of ``inners`` takes (read
    when a call passes extra arguments: building a chain inspects no signature)."""
    update.extra_inners = tuple(inners)  # type: ignore[attr-defined]
    return update


def check_extra_args(where: str, accepted: Any, extra: dict[str, Any]) -> None:
    """``ValueError`` for keyword arguments outside ``accepted`` (see :func:`extra_args`): a
    set of names, None for any, or a wrapper's update function."""
    if not extra:
        return
    if callable(accepted):
        accepted = extra_args(GradientTransformation(None, accepted))  # type: ignore[arg-type]
    unknown = sorted(set(extra) - accepted) if accepted is not None else []
    if unknown:
        raise ValueError(
            f"{where} got keyword argument(s) {unknown} that none of its transformations take "
            f"(they take {sorted(accepted)}); pass only those, e.g. value= for reduce_on_plateau"
        )


def select_extra_args(tx: GradientTransformation, extra: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``extra`` that ``tx.update`` takes."""
    if not extra:
        return extra
    takes = extra_args(tx)
    return dict(extra) if takes is None else {k: v for k, v in extra.items() if k in takes}


class ChainState(tuple):
    """The state of :func:`chain`: a tuple of the inner transformations' states."""


def check_transformation(tx: Any, what: str) -> None:
    """A one-line ``ValueError`` where ``tx`` is no :class:`GradientTransformation` (an
    Optimizer, whose update returns new params, would be added to the params as updates).

    >>> import minitrain as mt
    >>> check_transformation(mt.optim.sgd(), "MultiSteps' inner")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: MultiSteps' inner is an Optimizer; pass a GradientTransformation (...)
    """
    if not isinstance(tx, GradientTransformation):
        raise ValueError(
            f"{what} is {'an' if type(tx).__name__[0] in 'AEIOU' else 'a'} "
            f"{type(tx).__name__}; pass a GradientTransformation (an Optimizer returns new "
            f"params, not updates: use a transformation, e.g. mt.optim.scale_by_adam)"
        )


def chain(*transforms: Any) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states.

    >>> import torch, minitrain as mt
    >>> tx = chain(mt.optim.clip(1.0), mt.optim.scale(-0.1))
    >>> params = {"w": torch.zeros(2)}
    >>> updates, state = tx.update({"w": torch.tensor([5.0, -0.5])}, tx.init(params), params)
    >>> updates["w"]
    tensor([-0.1000,  0.0500])
    """
    for index, tx in enumerate(transforms):
        check_transformation(tx, f"chain argument {index}")

    def init(params):
        return tuple(tx.init(params) for tx in transforms)

    def update(updates, state, params=None, **extra):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state of "
                f"{type(state).__name__}; pass the state returned by its init(params)"
            )
        check_extra_args("chain", update, extra)
        new_state = []
        for tx, inner in zip(transforms, state, strict=True):
            updates, inner = tx.update(updates, inner, params, **select_extra_args(tx, extra))
            new_state.append(inner)
        return updates, tuple(new_state)

    update = naming_bad_grads(update)
    forwards_extra_args(update, transforms)
    return tagged("chain", GradientTransformation(init, update), transforms=transforms)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates`` leaf by leaf, each result in its param's dtype (pure).

    >>> import torch
    >>> apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), 0.5)})
    {'w': tensor([1.5000, 1.5000], dtype=torch.bfloat16)}
    """
    tensor_leaves("apply_updates", params, "param")
    tensor_leaves("apply_updates", updates, "updates leaf")
    tree.assert_same_structure(params, updates, names=("params", "updates"), check_shapes=True)
    return tree.map(lambda p, u: (p + u).to(p.dtype), params, updates)


# --------------------------------------------------------------------------------------------
# Hyperparameters


def hyperparameter(name: str, value: Any) -> Any:
    """A hyperparameter as torch.optim takes it: a number unchanged, a one-element tensor
    squeezed to 0-d (``torch.optim.optimizer._to_scalar``); a longer tensor is refused.

    >>> hyperparameter("betas[0]", torch.tensor([[0.9]])).shape
    torch.Size([])
    >>> hyperparameter("lr", torch.tensor([0.1, 0.2]))
    Traceback (most recent call last):
    ...
    ValueError: invalid lr: a tensor lr must have one element, got shape (2,); pass a 0-d tensor
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"invalid {name}: a tensor {name} must have one element, got shape "
                f"{tuple(value.shape)}; pass a 0-d tensor"
            )
        return value.reshape(()) if value.dim() else value
    if isinstance(value, bool | int | float):
        return value
    raise ValueError(
        f"invalid {name}={value!r}: pass a number or a one-element tensor"
    )


def check_pair(name: str, values: Any) -> tuple[Any, Any]:
    """A pair like ``betas``: both numbers or both tensors (torch.optim refuses a mix).

    >>> check_pair("betas", (0.9, torch.tensor(0.999)))
    Traceback (most recent call last):
    ...
    ValueError: invalid betas: mixes a float and a tensor; pass both as floats or both as tensors
    """
    if not isinstance(values, tuple | list) or len(values) != 2:
        raise ValueError(f"invalid {name}={values!r}: pass a pair ({name}[0], {name}[1])")
    kinds = {isinstance(v, Tensor) for v in values}
    if len(kinds) != 1:
        raise ValueError(
            f"invalid {name}: mixes a float and a tensor; pass both as floats or both as tensors"
        )
    return hyperparameter(f"{name}[0]", values[0]), hyperparameter(f"{name}[1]", values[1])


# --------------------------------------------------------------------------------------------
# leafwise: a rule written once per leaf, batched with foreach kernels


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\W]+", name) if part)


def _state_type(name: str, buffers: Sequence[str]) -> type:
    fields = [("count", Tensor), *((b, Any) for b in buffers)]
    state_type = NamedTuple(f"{_camel(name)}State", fields)  # type: ignore[misc]
    state_type.__doc__ = f"``count`` updates done and {name}'s per-leaf buffers."
    return state_type


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
    if state_type is None:
        buffers = tuple(init_leaf(torch.zeros(1, device="cpu")))
        state_type = _state_type(name, buffers)
    else:
        fields = tuple(state_type._fields)
        if fields[:1] != ("count",):
            raise ValueError(f"{name}: state_type {state_type.__name__} must start with 'count'")
        buffers = fields[1:]

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


# --------------------------------------------------------------------------------------------
# Optimizers from transformations

def _writable(tensors: list) -> bool:
    """Whether params may be updated in place: plain or fake tensors (a prediction), outside
    vmap, grad and torch.compile, and none requiring grad while grad mode is on."""
    if torch.compiler.is_compiling() or not all(isinstance(t, Tensor) for t in tensors):
        return False
    wrapped = _torch.is_functorch_wrapped_tensor
    return not any(wrapped(t) or (t.requires_grad and torch.is_grad_enabled()) for t in tensors)


def as_optimizer(tx: GradientTransformation) -> Optimizer:
    """An :class:`~minitrain.optim.Optimizer` that applies the updates of ``tx`` to the params.

    ``update(grads, state, params, donate=False)`` returns ``(params, state)``; when ``tx``
    matches a known pattern (e.g. ``chain(scale_by_adam(), add_decayed_weights(wd),
    scale_by_learning_rate(lr))``) it runs the fused or streaming kernels of the named
    optimizer. With ``donate=True`` the params may be updated in place.

    >>> import torch, minitrain as mt
    >>> opt = as_optimizer(chain(mt.optim.scale_by_sign(), mt.optim.scale_by_learning_rate(0.5)))
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> params, state = opt.update({"w": torch.tensor([3.0, -2.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.5000, 1.5000])
    """
    check_transformation(tx, "as_optimizer's argument")
    lowered = lower(tx)

    def update(grads: Grads, state: OptState, params: Params, *, donate: bool = False,
               **extra: Any):
        # In place only where no grad is another leaf's param (a lowered update checks its
        # state too).
        donate = donate and donatable(tree.leaves(params), tree.leaves(grads), [])
        if extra:  # e.g. value= for reduce_on_plateau: the transformation's own update
            check_extra_args("as_optimizer", extra_args(tx), extra)
        elif lowered is not None:
            result = lowered(grads, state, params, donate)
            if result is not None:
                return result
        try:
            updates, state = tx.update(grads, state, params, **extra)
        except ValueError:
            check_grads(grads, params)  # names the first grad unlike its param, where one is
            raise
        leaves = tree.leaves(params)
        u_leaves = tree.leaves(updates)
        if donate and _writable([*leaves, *u_leaves]) and all(
            isinstance(p, Tensor) for p in (*leaves, *u_leaves)
        ) and donatable(leaves, [*u_leaves, *tree.leaves(state)], []):
            if len(u_leaves) == len(leaves) and all(
                u.shape == p.shape for u, p in zip(u_leaves, leaves, strict=True)
            ):
                with torch.no_grad():
                    _torch.foreach["add_"](leaves, [u.to(p.dtype) for u, p in zip(
                        u_leaves, leaves, strict=True)])
                return params, state
        return apply_updates(params, updates), state

    update = naming_bad_grads(update)
    optimizer = Optimizer(tx.init, update)
    update.transformation = tx  # type: ignore[attr-defined]
    return optimizer
