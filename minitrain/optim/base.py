"""The optimizer interface (optax ``_src/base.py``): a :class:`GradientTransformation` is a pair
of pure functions ``state = tx.init(params)`` and ``updates, state = tx.update(updates, state,
params=None)``; :func:`chain` runs several in order and :func:`as_optimizer` turns one into an
:class:`Optimizer` whose ``update(grads, state, params)`` returns ``(params, state)``. Every
optimizer in :mod:`minitrain.optim` is ``as_optimizer(chain(...))``; ``kernels`` runs the chains
it recognises as fused kernels.

Donation: ``opt.update(..., donate=True)`` lets the update write the new params and state into
the buffers of ``params`` and ``state`` (JAX's ``donate_argnums``): a permission, never an
obligation; the caller must not read the donated inputs afterwards."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import (
    WeightDecayMask,
    check_grads,
    check_params,
    check_storages,
    floating_updates,
    naming_bad_grads,
    storage_holds,
    tensor_leaves,
)
from minitrain.optim.kernels import members
from minitrain.optim.kernels.checks import donatable
from minitrain.optim.kernels.lowering import lower
from minitrain.tree import Grads, OptState, Params

__all__ = [
    "Optimizer", "Schedule", "ScalarOrSchedule", "WeightDecayMask", "learning_rate",
    "GradientTransformation", "EmptyState", "Updates", "identity", "chain", "ChainState",
    "apply_updates", "as_optimizer", "spec", "extra_args",
]

Schedule = Callable[[Any], Any]
"""A learning-rate schedule: ``step -> lr``, for a Python int or a 0-d integer tensor step."""

ScalarOrSchedule = float | Tensor | Schedule

Updates = Grads
"""A pytree like params: what a transformation maps (gradients in, updates out)."""


class Optimizer(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params, donate=False) -> (params,
    state)``, pure functions.

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


class ChainState(tuple):
    """The state of :func:`chain`: a tuple of the inner transformations' states."""


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
    if found is None or isinstance(found, Tensor) and found.numel() != 1:  # one per member
        raise ValueError(f"learning_rate() expects the state of an mt.optim optimizer with one "
                         f"learning rate, got {type(state)!r}")
    return float(found)


def _find_lr(state: Any) -> Any:
    """The first ``lr`` field (or injected ``lr`` / ``learning_rate``) in a state, chains'
    tuples and ``multi_transform``'s dicts included."""
    if isinstance(getattr(state, "lr", None), Tensor):
        return state.lr
    hyper = getattr(state, "hyperparams", None)
    if isinstance(hyper, dict) and ("lr" in hyper or "learning_rate" in hyper):
        return hyper.get("lr", hyper.get("learning_rate"))
    inners = state.values() if isinstance(state, dict) else state
    found = map(_find_lr, inners if isinstance(state, tuple | list | dict) else ())
    return next((lr for lr in found if lr is not None), None)


def spec(tx: GradientTransformation) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` a transformation was built with, or None: what lowerings match.

    >>> import minitrain as mt
    >>> spec(mt.optim.scale(2.0))
    ('scale', {'step_size': 2.0})
    """
    return getattr(tx.update, "minitrain_spec", None)


def tagged(name: str, tx: GradientTransformation, **arguments: Any) -> GradientTransformation:
    """``tx`` with ``(name, arguments)`` attached to its update (see :func:`spec`), refusing
    leaves that are no tensors, promoting integer updates and naming a sparse grad."""

    @naming_bad_grads
    def params_checked(updates, state, params=None, **extra):
        """The update, where ``params`` were checked (by a chain)."""
        return tx.update(floating_updates(name, updates, params), state, params, **extra)

    @functools.wraps(tx.update)
    def update(updates, state, params=None, **extra):
        if params is not None:
            tensor_leaves(name, params, "param")
        return params_checked(updates, state, params, **extra)

    def init(params):
        tensor_leaves(name, params, "param")
        return tx.init(params)

    init.params_checked = tx.init  # type: ignore[attr-defined]
    update.minitrain_spec = (name, arguments)  # type: ignore[attr-defined]
    update.params_checked = params_checked  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


def identity() -> GradientTransformation:
    """Pass updates through unchanged.

    >>> import torch
    >>> identity().update({"w": torch.ones(1)}, EmptyState())[0]
    {'w': tensor([1.])}
    """
    return tagged("identity", GradientTransformation(
        lambda params: EmptyState(), lambda updates, state, params=None: (updates, state)))


def extra_args(tx: GradientTransformation) -> frozenset[str] | None:
    """The keyword arguments beyond ``(updates, state, params)`` that ``tx.update`` takes
    (optax's ``with_extra_args_support``); None when it takes any (``**kwargs``).

    >>> import minitrain as mt
    >>> extra_args(mt.optim.reduce_on_plateau()), extra_args(mt.optim.scale(2.0))
    (frozenset({'value'}), frozenset())
    """
    inners = getattr(tx.update, "extra_inners", None)
    if inners is not None:  # a wrapper: what any of its transformations takes
        takes = [extra_args(inner) for inner in inners]
        return None if None in takes else frozenset().union(*takes)
    try:
        parameters = list(inspect.signature(tx.update).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: no extra arguments
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for index, p in enumerate(parameters) if p.kind is p.KEYWORD_ONLY
                     or (p.kind is p.POSITIONAL_OR_KEYWORD and index >= 3))


def forwards_extra_args(update: Callable, inners: Sequence[GradientTransformation]) -> Callable:
    """Mark a wrapper's ``update(..., **extra)`` as taking what any of ``inners`` takes."""
    update.extra_inners = tuple(inners)  # type: ignore[attr-defined]
    return update


def split_extra_args(where: str, inners: Sequence[GradientTransformation],
                     extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Per transformation of ``inners``, the keyword arguments of ``extra`` it takes; a
    ``ValueError`` naming ``where`` for one that none of them takes."""
    if not extra:
        return [extra] * len(inners)
    takes = [extra_args(tx) for tx in inners]
    unknown = [] if None in takes else sorted(set(extra).difference(*takes))
    if unknown:
        raise ValueError(f"{where} got keyword argument(s) {unknown} that none of its "
                         f"transformations take (they take {sorted(frozenset().union(*takes))}); "
                         f"pass only those, e.g. value= for reduce_on_plateau")
    return [dict(extra) if t is None else {k: v for k, v in extra.items() if k in t} for t in takes]


def check_transformation(tx: Any, what: str) -> None:
    """A one-line ``ValueError`` where ``tx`` is no :class:`GradientTransformation` (an
    Optimizer returns new params, which would be added to the params as updates)."""
    if not isinstance(tx, GradientTransformation):
        raise ValueError(f"{what} is {'an' if type(tx).__name__[0] in 'AEIOU' else 'a'} "
                         f"{type(tx).__name__}; pass a GradientTransformation (an Optimizer "
                         f"returns new params, not updates: use a transformation, e.g. "
                         f"mt.optim.scale_by_adam)")


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
    # The chain's own check of params holds for each transformation it runs.
    steps = [getattr(tx.update, "params_checked", tx.update) for tx in transforms]
    inits = [getattr(tx.init, "params_checked", tx.init) for tx in transforms]

    def init(params):
        return tuple(init(params) for init in inits)

    def update(updates, state, params=None, **extra):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transformations got a state of "
                             f"{type(state).__name__}; pass the state returned by its "
                             f"init(params)")
        new_state = []
        for inner, step, kwargs in zip(state, steps, split_extra_args("chain", transforms, extra),
                                       strict=True):
            updates, inner = step(updates, inner, params, **kwargs)
            new_state.append(inner)
        return updates, tuple(new_state)

    forwards_extra_args(update, transforms)
    return tagged("chain", GradientTransformation(init, update), transforms=transforms)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates`` leaf by leaf, each result in its param's dtype (pure).

    >>> import torch
    >>> apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), 0.5)})
    {'w': tensor([1.5000, 1.5000], dtype=torch.bfloat16)}
    """
    leaves, treespec = _pytree.tree_flatten(params)
    u_leaves, u_treespec = _pytree.tree_flatten(updates)
    if u_treespec != treespec or not all(
            isinstance(p, Tensor) and isinstance(u, Tensor) and p.shape == u.shape
            for p, u in zip(leaves, u_leaves, strict=True)):  # the first mismatch, named
        tensor_leaves("apply_updates", params, "param")
        tensor_leaves("apply_updates", updates, "updates leaf")
        tree.assert_same_structure(params, updates, names=("params", "updates"), check_shapes=True)
    return tree.unflatten(treespec, [p + u if p.dtype == u.dtype else (p + u).to(p.dtype)
                                      for p, u in zip(leaves, u_leaves, strict=True)])


_PLAIN = (float, Tensor, torch.nn.Parameter)


def _writable(tensors: list) -> bool:
    """Whether params may be updated in place: tensors outside vmap, grad and torch.compile,
    none requiring grad while grad mode is on."""
    if torch.compiler.is_compiling() or _torch.forward_ad_active() or not all(
            isinstance(t, Tensor) for t in tensors):
        return False
    wrapped = _torch.is_functorch_wrapped_tensor
    return not any(wrapped(t) or (t.requires_grad and torch.is_grad_enabled()) for t in tensors)


def _hostile(found: Any) -> list[Any]:
    """The hyperparameters of a spec whose reading runs the caller's code (a ``float``
    subclass's ``__float__``, a tensor subclass's torch function)."""
    if isinstance(found, GradientTransformation):
        found = spec(found)
    if isinstance(found, dict):
        found = list(found.values())
    if isinstance(found, tuple | list):
        return [value for inner in found for value in _hostile(inner)]
    return [found] if _runs_code(found) else []


def _runs_code(value: Any) -> bool:
    return type(value) not in _PLAIN and isinstance(value, float | Tensor)


def _check_strict(hostile: list[Any], grads: Grads, params: Params, state: OptState) -> None:
    """The aliases' checks before an update: grads like params, then (after reading the
    ``hostile`` hyperparameters and the state's, which run the caller's code) every plain
    tensor's storage holding it; one pass over the leaves, the paths only to name a fault."""
    grad_leaves = check_grads(grads, params)
    state_leaves = _pytree.tree_leaves(state)
    for value in [*hostile, *(leaf for leaf in state_leaves if _runs_code(leaf))]:
        float(value) if isinstance(value, float) else value.detach()
    wrapped = _torch.is_functorch_wrapped_tensor
    if not all(type(t) not in (Tensor, torch.nn.Parameter) or wrapped(t) or storage_holds(t)
               for t in (*_pytree.tree_leaves(params), *grad_leaves, *state_leaves)):
        check_storages((("param", params), ("grad", grads), ("state", state)))


def as_optimizer(tx: GradientTransformation, *, strict: bool = False) -> Optimizer:
    """An :class:`Optimizer` that applies the updates of ``tx`` to the params, by a fused kernel
    where ``kernels`` recognises ``tx``. ``strict=True`` (the aliases): params must be real
    floating-point tensors, and grads dense and like their params, as torch.optim's are.

    >>> import torch, minitrain as mt
    >>> opt = as_optimizer(chain(mt.optim.scale_by_sign(), mt.optim.scale_by_learning_rate(0.5)))
    >>> params = {"w": torch.tensor([1.0, 1.0])}
    >>> params, state = opt.update({"w": torch.tensor([3.0, -2.0])}, opt.init(params), params)
    >>> params["w"]
    tensor([0.5000, 1.5000])
    """
    check_transformation(tx, "as_optimizer's argument")
    lowered = lower(tx)
    hostile = _hostile(tx)

    def update(grads: Grads, state: OptState, params: Params, *, donate: bool = False,
               **extra: Any):
        if extra:  # e.g. value= for reduce_on_plateau: the transformation's own update
            split_extra_args("as_optimizer", [tx], extra)
        elif lowered is not None:  # traced plain SGD, one kernel call, or one over vmap members
            result = members.traced_sgd(lowered.shape, grads, state, params) or lowered(
                grads, state, params, donate) or members.run(lowered.shape, grads, state, params,
                                                             donate)
            if result is not None:
                return result
        if strict and not torch.compiler.is_compiling():  # traced: checked when it was eager
            _check_strict(hostile, grads, params, state)
        try:
            updates, state = tx.update(grads, state, params, **extra)
        except ValueError:
            check_grads(grads, params)  # names the first grad unlike its param, where one is
            raise
        if donate:  # in place where no grad, update or state leaf meets a param
            leaves, u_leaves = _pytree.tree_leaves(params), _pytree.tree_leaves(updates)
            if _writable([*leaves, *u_leaves]) and len(u_leaves) == len(leaves) and all(
                    u.shape == p.shape for u, p in zip(u_leaves, leaves, strict=True)) and \
                    donatable(leaves, [*_pytree.tree_leaves(grads), *u_leaves,
                                       *_pytree.tree_leaves(state)]):
                with torch.no_grad():
                    _torch.foreach["add_"](leaves, [u.to(p.dtype) for u, p in zip(
                        u_leaves, leaves, strict=True)])
                return params, state
        return apply_updates(params, updates), state

    def init(params: Params) -> OptState:
        if strict:  # checks what the transformations' own checks would
            check_params(params)
            return getattr(tx.init, "params_checked", tx.init)(params)
        return tx.init(params)

    update.transformation, update.lowered = tx, lowered  # type: ignore[attr-defined]
    return Optimizer(init, update)
