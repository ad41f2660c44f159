"""Transformations that wrap others: routing leaves, accumulating, skipping, averaging, and
hyperparameters kept in the state (optax ``_src/wrappers.py``, ``combine.py``,
``schedules/_inject.py``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import (
    check_like,
    check_state_type,
    decay_flags,
    host_tensor,
    hyperparameter,
    is_traced,
    leaf_labels,
    schedule_count,
    tensor_leaves,
    updates_done,
    zero_count,
)
from minitrain.optim.base import (
    GradientTransformation,
    check_transformation,
    forwards_extra_args,
    split_extra_args,
    tagged,
)
from minitrain.tree import Params

__all__ = [
    "masked", "MaskedState", "multi_transform", "MultiTransformState", "MultiSteps",
    "MultiStepsState", "apply_if_finite", "ApplyIfFiniteState", "ema", "EmaState",
    "inject_hyperparams", "InjectHyperparamsState",
]


class LeafGroup(dict):
    """The leaves ``multi_transform`` and ``masked`` hand to one inner transformation, keyed by
    their names in the whole params, so a group's state is named after its params
    (``inner_states.adam.mu.w``) and a checkpoint resumed with other labels fails to load.

    >>> import torch, minitrain as mt
    >>> g = LeafGroup([("w", torch.ones(2)), ("b", torch.zeros(1))])
    >>> mt.tree.named_leaves(mt.tree.map(lambda t: t * 2, g))
    [('w', tensor([2., 2.])), ('b', tensor([0.]))]
    """

    def __repr__(self) -> str:
        return f"LeafGroup({dict.__repr__(self)})"


_pytree.register_pytree_node(
    LeafGroup, lambda g: (list(g.values()), list(g.keys())),
    lambda values, keys: LeafGroup(zip(keys, values, strict=True)),
    serialized_type_name="minitrain.optim.LeafGroup",
    flatten_with_keys_fn=lambda g: ([(_pytree.MappingKey(k), v) for k, v in g.items()], list(g)))


def _route_init(params: Params, transforms: dict, pick: Callable) -> dict[Any, Any]:
    """Each transformation's state over the leaves ``pick(params, named) -> {label: indices}``
    gives it."""
    named = tree.named_leaves(params)
    return {label: transforms[label].init(LeafGroup(named[i] for i in indices))
            for label, indices in pick(params, named).items()}


def _route(updates: Any, states: dict, params: Any, transforms: dict, pick: Callable,
           extra: dict, where: str) -> tuple[Any, dict]:
    """Each transformation's update of the leaves ``pick`` gives it (a :class:`LeafGroup`, so
    its state is named after them) with the keyword arguments of ``extra`` it takes; the other
    leaves pass through."""
    extra = dict(zip(transforms, split_extra_args(where, list(transforms.values()), extra),
                     strict=True))
    named = tree.named_leaves(updates)
    named_params = named if params is None else tree.named_leaves(params)
    out, new_states = [leaf for _, leaf in named], {}
    for label, indices in pick(updates if params is None else params, named_params).items():
        new, new_states[label] = transforms[label].update(  # the params keyed as the updates
            LeafGroup(named[i] for i in indices), states[label], None if params is None else
            LeafGroup((named[i][0], named_params[i][1]) for i in indices), **extra[label])
        if isinstance(new, dict) and list(new) == [named[i][0] for i in indices]:
            new = list(new.values())
        if not isinstance(new, list | tuple) or len(new) != len(indices):
            name = where if len(transforms) == 1 else f"{where}'s {label!r}"
            raise ValueError(f"{name}'s inner transformation returned a {type(new).__name__} for "
                             f"a dict of {len(indices)} leaves; return updates shaped like the "
                             "ones it was given (tree.map over them)")
        for i, value in zip(indices, new, strict=True):
            out[i] = value
    return tree.unflatten(tree.structure(updates), out), new_states


_ZEROS = object()


def _pick(condition: Tensor, new: Any, old: Any = _ZEROS) -> Any:
    """``new`` where the 0-d bool ``condition`` holds, else ``old`` (by default zeros like
    ``new``): picked on the host, or leaf by leaf by ``torch.where`` where it is traced or holds
    no data (meta)."""
    traced = is_traced(condition) or condition.is_meta
    if not traced and bool(condition):
        return new
    old = tree.map(torch.zeros_like, new) if old is _ZEROS else old
    return tree.map(lambda n, o: torch.where(condition, n, o), new, old) if traced else old


class MaskedState(NamedTuple):
    """The inner transformation's state over the masked-in leaves (keyed by their names)."""

    inner_state: Any


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` (a pytree of bools like params, or
    ``fn(name, leaf) -> bool``) is True; pass the others through.

    >>> import torch, minitrain as mt
    >>> tx = masked(mt.optim.scale(0.0), lambda name, leaf: leaf.ndim >= 2)
    >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
    >>> tx.update(params, tx.init(params), params)[0]
    {'w': tensor([[0.]]), 'b': tensor([1.])}
    """
    check_transformation(inner, "masked's inner")

    def chosen(params: Params, named: list[tuple[str, Any]]) -> dict[str, list[int]]:
        return {"inner": [i for i, on in enumerate(decay_flags(mask, params, "mask")) if on]}

    def init(params):
        return MaskedState(_route_init(params, {"inner": inner}, chosen)["inner"])

    def update(updates, state, params=None, **extra):
        check_state_type("masked", MaskedState, state)
        out, states = _route(updates, {"inner": state.inner_state}, params, {"inner": inner},
                             chosen, extra, "masked")
        return out, MaskedState(states["inner"])

    forwards_extra_args(update, [inner])
    return tagged("masked", GradientTransformation(init, update), inner=inner, mask=mask)


class MultiTransformState(NamedTuple):
    """Per label, the state of its transformation over the leaves with that label (keyed by
    their names)."""

    inner_states: dict[str, Any]


def multi_transform(transforms: dict[str, GradientTransformation],
                    labels: Any) -> GradientTransformation:
    """Route each leaf to the transformation of its label (optax ``multi_transform``):
    ``labels`` is a pytree of labels like params or ``fn(name, leaf) -> label``. States are
    keyed by leaf names, so a checkpoint resumed with other labels is refused.

    >>> import torch, minitrain as mt
    >>> tx = multi_transform({"matrix": mt.optim.scale(-1.0), "other": mt.optim.scale(0.0)},
    ...                      lambda name, p: "matrix" if p.ndim == 2 else "other")
    >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
    >>> tx.update(params, tx.init(params), params)[0]
    {'w': tensor([[-1.]]), 'b': tensor([0.])}
    """
    if not transforms:
        raise ValueError("multi_transform needs at least one labelled transformation")
    for label, tx in transforms.items():
        check_transformation(tx, f"multi_transform's {label!r}")

    def groups(params: Params, named: list[tuple[str, Any]]) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {label: [] for label in transforms}
        for index, ((name, _), label) in enumerate(
                zip(named, leaf_labels(labels, params, "labels"), strict=True)):
            if label not in transforms:
                raise ValueError(f"leaf {name!r} has label {label!r}, which has no "
                                 f"transformation; labels are {sorted(transforms)}")
            found[label].append(index)
        return found

    def init(params):
        return MultiTransformState(_route_init(params, transforms, groups))

    def update(updates, state, params=None, **extra):
        check_state_type("multi_transform", MultiTransformState, state)
        if not isinstance(state.inner_states, dict) or set(state.inner_states) != set(transforms):
            raise ValueError(f"multi_transform with labels {sorted(transforms)} got a state for "
                             f"other labels; pass the state returned by its init(params)")
        out, states = _route(updates, state.inner_states, params, transforms, groups, extra,
                             "multi_transform")
        return out, MultiTransformState(states)

    forwards_extra_args(update, list(transforms.values()))
    return tagged("multi_transform", GradientTransformation(init, update),
                  transforms=transforms, labels=labels)


class MultiStepsState(NamedTuple):
    """``mini_step`` micro-batches accumulated so far, ``gradient_step`` inner updates made,
    the inner state, and ``acc_grads`` (the sum of this cycle's gradients)."""

    mini_step: Tensor
    gradient_step: Tensor
    inner_state: Any
    acc_grads: Params


def MultiSteps(inner: GradientTransformation, every_k: int) -> GradientTransformation:  # noqa: N802
    """Accumulate gradients over ``every_k`` micro-batches, then apply ``inner`` to their sum
    (torch's ``.grad`` accumulation); the updates in between are zeros.

    >>> import torch, minitrain as mt
    >>> tx = MultiSteps(mt.optim.scale(-1.0), every_k=2)
    >>> state = tx.init([torch.zeros(1)])
    >>> first, state = tx.update([torch.ones(1)], state)
    >>> second, state = tx.update([torch.full((1,), 2.0)], state)
    >>> first, second
    ([tensor([0.])], [tensor([-3.])])
    """
    check_transformation(inner, "MultiSteps' inner")
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"invalid every_k={every_k!r}: pass a positive int")

    def init(params):
        tensor_leaves("MultiSteps", params, "param", floating=True)  # the sum is like params
        zero = zero_count()
        return MultiStepsState(zero, zero.clone(), inner.init(params), tree.zeros_like(params))

    def update(updates, state, params=None, **extra):
        extra, = split_extra_args("MultiSteps", [inner], extra)
        check_state_type("MultiSteps", MultiStepsState, state)
        check_like(state.acc_grads, updates, ("state.acc_grads", "updates"))
        acc = tree.map(lambda a, g: a + g, state.acc_grads, updates)
        mini_step = state.mini_step + 1
        boundary = mini_step >= every_k
        if not is_traced(boundary) and not bool(boundary):  # no inner update to make
            zeros = tree.map(torch.zeros_like, updates)
            return zeros, state._replace(mini_step=mini_step, acc_grads=acc)
        new, inner_state = inner.update(acc, state.inner_state, params, **extra)
        return _pick(boundary, new), MultiStepsState(
            torch.where(boundary, 0, mini_step), state.gradient_step + boundary.long(),
            _pick(boundary, inner_state, state.inner_state), _pick(~boundary, acc))

    forwards_extra_args(update, [inner])
    return tagged("MultiSteps", GradientTransformation(init, update), inner=inner, every_k=every_k)


class ApplyIfFiniteState(NamedTuple):
    """As optax's: ``notfinite_count`` non-finite updates in a row (0 after a finite one),
    ``last_finite`` (bool: whether the last update was finite), ``total_notfinite`` non-finite
    updates in all (skipped or let through), and the inner state."""

    notfinite_count: Tensor
    last_finite: Tensor
    total_notfinite: Tensor
    inner_state: Any


def apply_if_finite(inner: GradientTransformation,
                    max_consecutive_errors: int | None = None) -> GradientTransformation:
    """Skip (zero) an update whose incoming updates or whose result from ``inner`` has a NaN or
    inf, keeping ``inner``'s old state (optax ``apply_if_finite``); one goes through once more
    than ``max_consecutive_errors`` come in a row (None: never).

    >>> import torch, minitrain as mt
    >>> tx = apply_if_finite(mt.optim.scale(-1.0), max_consecutive_errors=1)
    >>> state = tx.init([torch.zeros(1)])
    >>> updates, state = tx.update([torch.tensor([float("nan")])], state)
    >>> updates, int(state.notfinite_count), int(state.total_notfinite)
    ([tensor([0.])], 1, 1)
    >>> updates, state = tx.update([torch.tensor([float("inf")])], state)  # the 2nd goes through
    >>> updates, bool(state.last_finite), int(state.notfinite_count), int(state.total_notfinite)
    ([tensor([-inf])], False, 2, 2)
    """
    check_transformation(inner, "apply_if_finite's inner")

    def init(params):
        zero = zero_count()
        return ApplyIfFiniteState(zero, torch.tensor(True, device="cpu"), zero.clone(),
                                  inner.init(params))

    def update(updates, state, params=None, **extra):
        extra, = split_extra_args("apply_if_finite", [inner], extra)
        check_state_type("apply_if_finite", ApplyIfFiniteState, state)
        new, inner_state = inner.update(updates, state.inner_state, params, **extra)
        leaves = [*tree.leaves(updates), *tree.leaves(new)]
        finite = torch.stack([torch.isfinite(u).all() for u in leaves]).all() if leaves else (
            torch.tensor(True, device="cpu"))
        # traced, or without data (a prediction's meta tensors): no host copy
        traced = is_traced(finite) or is_traced(state.notfinite_count) or finite.is_meta
        finite = finite if traced else finite.cpu()  # the counters stay on the host
        bad = (~finite).long()
        count = (state.notfinite_count + bad) * bad
        apply = finite if max_consecutive_errors is None else (
            finite | (count > max_consecutive_errors))
        total = state.total_notfinite + bad
        return _pick(apply, new), ApplyIfFiniteState(
            count, finite, total, _pick(apply, inner_state, state.inner_state))

    forwards_extra_args(update, [inner])
    return tagged("apply_if_finite", GradientTransformation(init, update), inner=inner)


class EmaState(NamedTuple):
    """``count`` updates seen and ``ema``, the average of the params after each update."""

    count: Tensor
    ema: Params


def ema(decay: float | Tensor = 0.999) -> GradientTransformation:
    """Keep an exponential moving average of the params after each update, as torch's
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))``: the first update
    copies, later ones ``ema = lerp(ema, p, 1 - decay)``. Put it last in a chain.

    >>> import torch, minitrain as mt
    >>> tx = mt.optim.chain(mt.optim.scale(-1.0), ema(0.5))
    >>> params = [torch.zeros(1)]
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...     updates, state = tx.update([torch.ones(1)], state, params)
    ...     params = mt.optim.apply_updates(params, updates)
    >>> params, state[-1].ema  # params after each step: -1, -2; ema: -1, then -1.5
    ([tensor([-2.])], [tensor([-1.5000])])
    """
    decay = hyperparameter("decay", decay)

    def init(params):
        tensor_leaves("ema", params, "param", floating=True)  # an integer average would truncate
        return EmaState(zero_count(), tree.map(torch.clone, params))

    def update(updates, state, params=None):
        check_state_type("ema", EmaState, state)
        if params is None:
            raise ValueError("ema needs params: call update(updates, state, params)")
        check_like(params, updates, ("params", "updates"))
        check_like(params, state.ema, ("params", "state.ema"))
        new_params = tree.map(lambda p, u: (p + u).to(p.dtype), params, updates)
        if updates_done(state.count) is not None:  # eager: the average keeps no graph
            new_params = tree.map(Tensor.detach, new_params)
        average = _pick(state.count == 0, new_params, tree.map(
            lambda a, p: torch.lerp(a, p, 1 - decay), state.ema, new_params))
        return updates, EmaState(state.count + 1, average)

    return tagged("ema", GradientTransformation(init, update), decay=decay)


class InjectHyperparamsState(NamedTuple):
    """``count`` updates done, ``hyperparams`` (name -> 0-d float tensor, float64 for numbers,
    changeable between updates with ``state._replace``), and the inner state."""

    count: Tensor
    hyperparams: dict[str, Tensor]
    inner_state: Any


def _factory_name(factory: Any) -> str:
    """``factory``'s name for a message (a ``functools.partial``'s: its function's)."""
    inner = getattr(factory, "func", factory)
    return getattr(inner, "__name__", type(inner).__name__)


def inject_hyperparams(factory: Callable[..., GradientTransformation],
                       static_args: str | Iterable[str] = (),
                       ) -> Callable[..., GradientTransformation]:
    """``inject_hyperparams(factory)(**kwargs)``: ``factory(**kwargs)`` with its numeric
    arguments kept in the state as 0-d tensors (a callable is a schedule evaluated at each
    update, unless named in ``static_args``), so they can be read, changed or swept.

    >>> import torch, minitrain as mt
    >>> tx = inject_hyperparams(mt.optim.scale_by_learning_rate)(learning_rate=0.1)
    >>> state = tx.init([torch.zeros(1)])
    >>> state = state._replace(hyperparams={"learning_rate": torch.tensor(0.5)})
    >>> tx.update([torch.ones(1)], state)[0]
    [tensor([-0.5000])]
    """
    static_names = {static_args} if isinstance(static_args, str) else set(static_args)
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without one: nothing to check against
        accepted = {}
    unknown = sorted(static_names - set(accepted))
    if accepted and unknown and all(p.kind is not p.VAR_KEYWORD for p in accepted.values()):
        raise ValueError(f"inject_hyperparams: static_args names {', '.join(map(repr, unknown))}, "
                         f"which {_factory_name(factory)} does not take; "
                         f"its arguments: {', '.join(accepted)}")

    def build(**kwargs: Any) -> GradientTransformation:
        numeric = {k: v for k, v in kwargs.items() if k not in static_names and (
            isinstance(v, Tensor) or isinstance(v, int | float) and not isinstance(v, bool))}
        schedules = {k: v for k, v in kwargs.items() if k not in static_names
                     and callable(v) and not isinstance(v, Tensor)}
        static = {k: v for k, v in kwargs.items() if k not in numeric and k not in schedules}
        numbers = [k for k, v in numeric.items() if not isinstance(v, Tensor)]

        def init(params):
            hyper = {k: _hyper_tensor(k, v) for k, v in numeric.items()}
            hyper.update({k: _scheduled(k, fn, 0) for k, fn in schedules.items()})
            inner = factory(**static, **hyper)
            check_transformation(inner, f"what inject_hyperparams({_factory_name(factory)}) built")
            return InjectHyperparamsState(zero_count(), hyper, inner.init(params))

        def update(updates, state, params=None):
            check_state_type("inject_hyperparams", InjectHyperparamsState, state)
            hyper = dict(state.hyperparams)
            for k in numbers:  # a number set as ``torch.tensor(x)`` keeps init's float64
                if isinstance(hyper.get(k), Tensor) and hyper[k].is_floating_point():
                    hyper[k] = hyper[k].to(torch.float64)
            count = schedule_count(state.count)
            hyper.update({k: _scheduled(k, fn, count) for k, fn in schedules.items()})
            inner = factory(**static, **hyper)
            updates, inner_state = inner.update(updates, state.inner_state, params)
            return updates, InjectHyperparamsState(state.count + 1, hyper, inner_state)

        return tagged("inject_hyperparams", GradientTransformation(init, update),
                      factory=factory, **kwargs)

    return build


def _hyper_tensor(name: str, value: Any) -> Tensor:
    """A number as a float64 0-d host tensor: exact, so each leaf meets it in its own dtype
    (a float32 one would move float64 params off the uninjected run's)."""
    value = hyperparameter(name, value)
    if isinstance(value, Tensor) and value.is_floating_point():
        return value
    return host_tensor(value, torch.float64)


def _scheduled(name: str, schedule: Callable[[Any], Any], step: Any) -> Tensor:
    """``schedule(step)`` as a hyperparameter tensor; a ``ValueError`` hinting at
    ``static_args`` where the callable is no schedule ``step -> number``."""
    try:
        return _hyper_tensor(name, schedule(step))
    except (TypeError, ValueError) as err:
        raise ValueError(f"inject_hyperparams calls {name}={schedule!r} as a schedule step -> "
                         f"number, and that failed ({err}); if {name} is no schedule, pass "
                         f"inject_hyperparams(factory, static_args=({name!r},))") from err
