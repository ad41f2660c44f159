"""Swept values: one hyperparameter's per-member values behind a single 0-d tensor.

The template experiment of a sweep is built with each swept key as a :class:`SweptValue`:
member 0's value outside the step, each member's own inside it (under
:meth:`SweepBinding.bind`); a tensor derived from it while the experiment is built redoes its
op on the bound values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from minitrain._torch import make_subclass
from minitrain.errors import ExperimentError

__all__ = ["MemberMismatch", "SweepBinding", "SweptValue"]


class MemberMismatch(ExperimentError):
    """The members cannot share one vmapped step (their runs differ in more than values)."""


SIZES_FIX = (
    "the members of one vmapped step share every shape, size and count, so member 0's would be "
    "everyone's: set sizes and counts with a CONFIG key of their own (not from a swept value), "
    "or train each value with its own minitrain run --set key=value"
)


class SweepBinding:
    """Where one ensemble's per-member hyperparameter values live while its step runs."""

    def __init__(self) -> None:
        self.values: Mapping[str, torch.Tensor] | None = None
        self.reads = 0  # how many times a SweptValue of this binding was used, ever
        # each member's label and values while the template experiment is built (building)
        self.members: list[tuple[str, dict[str, torch.Tensor]]] | None = None

    @contextlib.contextmanager
    def bind(self, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Make every :class:`SweptValue` of this binding stand for ``values[name]``."""
        previous, self.values = self.values, values
        try:
            yield
        finally:
            self.values = previous

    @contextlib.contextmanager
    def building(self, members: Sequence[tuple[str, Mapping[str, float]]]) -> Iterator[None]:
        """While the template is built, refuse in-place writes, random draws, differing ints."""
        self.members = [
            (label, {key: torch.tensor(float(v), dtype=torch.float64) for key, v in values.items()})
            for label, values in members
        ]
        try:
            yield
        finally:
            self.members = None


class SweptValue(torch.Tensor):
    """A 0-d float64 tensor standing for the per-member values of one swept hyperparameter.

    A tensor computed from it outside the binding remembers the op and redoes it on the bound
    values, so a value derived at build time is still each member's own in the step.

    >>> binding = SweptValue.binding_type()
    >>> lr = SweptValue(0.1, "lr", binding)
    >>> half = lr / 2    # built outside the step
    >>> float(half)
    0.05
    >>> def doubled(values):
    ...     with binding.bind({"lr": values}):
    ...         return lr * 2 + half
    >>> torch.func.vmap(doubled)(torch.tensor([0.1, 0.3], dtype=torch.float64))
    tensor([0.2500, 0.7500], dtype=torch.float64)
    """

    binding_type = SweepBinding

    @staticmethod
    def __new__(cls, value: float, name: str, binding: SweepBinding) -> SweptValue:
        return cls._wrap(torch.tensor(float(value), dtype=torch.float64), binding, name=name,
                         number=True)

    @classmethod
    def _wrap(cls, plain: torch.Tensor, binding: SweepBinding, name: str | None = None,
              recipe: tuple | None = None, number: bool = False) -> SweptValue:
        swept = make_subclass(cls, plain)
        swept.swept_name = name  # a swept key, or None for a value derived from one
        swept.swept_recipe = recipe  # (func, args, kwargs) that derived it
        swept.swept_binding = binding
        swept.swept_plain = plain
        swept.swept_number = number  # a Python float in a single run (not a tensor)
        return swept

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        func = _redoable(func, args)
        binding = _unbound_binding((*args, *kwargs.values()))
        if binding is not None and binding.members is not None:
            _check_while_building(func, args, kwargs, binding)
        result = _call(func, args, kwargs)
        if binding is None or _in_place(func) or _name(func) in _RANDOM:
            return result
        return _derived(result, binding, (func, args, kwargs), _number_op(func, args, kwargs))

    def __deepcopy__(self, memo: dict) -> SweptValue:
        # copy.deepcopy(config) keeps the value swept (a copy of its tensor would be member 0's)
        return self

    def __copy__(self) -> SweptValue:
        return self

    def __round__(self, ndigits: int | None = None) -> Any:
        """``round(lr, 3)`` as on a float; ``round(lr)`` is an int, checked per member."""
        if ndigits is None:
            return int(torch.round(self))
        return round(float(self), ndigits)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "")


_IN_PLACE_DUNDERS = {f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
    "lshift", "rshift")} | {"__setitem__"}
# What ``+ - * / // % **``, unary ``- + abs()`` and comparisons on a tensor run: on Python
# numbers only (swept keys among them), they give what is a float in a single run; and what
# ``+= -= *= /= //= %= **=`` run, which rebind a float.
_NUMBER_OPS = {"add", "sub", "__rsub__", "mul", "div", "__rdiv__", "__floordiv__",
               "__rfloordiv__", "remainder", "__rmod__", "pow", "__rpow__", "neg", "positive",
               "abs", "lt", "le", "gt", "ge", "__eq__", "ne"}
_AUGMENTED = {"add_", "sub_", "mul_", "div_", "floor_divide_", "remainder_", "pow_"}
_DATA = torch.Tensor.data.__get__  # what reading ``lr.data`` runs
_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
           "normal", "bernoulli", "multinomial", "poisson", "binomial", "dropout", "dropout1d",
           "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "feature_dropout",
           "native_dropout", "rrelu", "gumbel_softmax", "_standard_gamma", "_sample_dirichlet"}
# Python numbers that pick a code path, a count or a shape (float() and .item() make values,
# which the first-step check compares): what they are, and what to write instead
_DECISIONS = {
    "__bool__": ("bool", "an if or a comparison",
                 "one vmapped step runs one code path for every member, so all would take "
                 "member 0's branch, even a branch that only sets a name or a message: write it "
                 "without an if on the swept value (torch.where(lr > 0.1, a, b) for a tensor, "
                 "f\"lr={lr:g}\" for a name) or run one sweep per branch, each with values on "
                 "one side of the condition"),
    "__int__": ("int", "int(), round() or an index: a size, a length or a count", SIZES_FIX),
}
_DECISIONS["__index__"] = _DECISIONS["__int__"]

def _in_place(func: Callable[..., Any]) -> bool:
    """``add_``, ``copy_``, ``__iadd__``, ``__setitem__``: ops that write into an input."""
    name = _name(func)
    return name in _IN_PLACE_DUNDERS or name.endswith("_") and not name.endswith("__")


def _number_op(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` on ``args`` gives a float in a single run: arithmetic on numbers."""
    return _name(func) in _NUMBER_OPS and not kwargs and all(
        isinstance(arg, int | float) or getattr(arg, "swept_number", False) for arg in args)


def _redoable(func: Callable[..., Any], args: tuple) -> Callable[..., Any]:
    """The op to run and redo: ``lr *= 2`` on a number is ``lr * 2``; ``lr.data`` is ``detach``."""
    if _name(func) in _AUGMENTED and args and getattr(args[0], "swept_number", False):
        return getattr(torch.Tensor, _name(func)[:-1])
    if func == _DATA:
        return torch.Tensor.detach
    return func


def _unbound_binding(values: tuple) -> SweepBinding | None:
    """The binding of the first swept value among ``values``, when no step has bound it."""
    first = next(_swept_in(values), None)
    if first is None or first.swept_binding.values is not None:
        return None
    return first.swept_binding


def _derived(result: Any, binding: SweepBinding, recipe: tuple, number: bool) -> Any:
    """``result`` of ``recipe`` as swept values that redo it (each tuple element its own)."""
    if isinstance(result, torch.Tensor):
        return SweptValue._wrap(result, binding, recipe=recipe, number=number)
    if (isinstance(result, tuple) and result
            and all(isinstance(part, torch.Tensor) for part in result)):
        func, args, kwargs = recipe
        return type(result)([
            SweptValue._wrap(part, binding, recipe=(functools.partial(_element, func, i), args,
                                                    kwargs))
            for i, part in enumerate(result)
        ])
    return result


def _element(func: Callable[..., Any], index: int, *args: Any, **kwargs: Any) -> Any:
    return func(*args, **kwargs)[index]


def _check_while_building(func: Callable[..., Any], args: tuple, kwargs: dict,
                          binding: SweepBinding) -> None:
    """Refuse an op on swept values while the template is built that the step would not redo."""
    name = _name(func)
    keys = ", ".join(_swept_keys((*args, *kwargs.values()))) if (
        _in_place(func) or name in _RANDOM or name in _DECISIONS) else ""
    if _in_place(func):
        raise MemberMismatch(
            f"experiment(config) writes {keys} into a tensor in place ({name.strip('_')}) while "
            "it is built, which the vmapped step cannot redo per member; compute a new tensor "
            "instead (x = x * lr, not x.mul_(lr))"
        )
    if name in _RANDOM and not name.endswith("_like"):
        raise MemberMismatch(
            f"experiment(config) draws random numbers from {keys} ({name}) while it is built, "
            "which the vmapped step would draw again; draw them from plain tensors and combine "
            "(lr * (1 + 0.1 * torch.randn(())))"
        )
    if name in _DECISIONS:
        _same_for_every_member(func, args, kwargs, binding, keys)


def _same_for_every_member(func: Callable[..., Any], args: tuple, kwargs: dict,
                           binding: SweepBinding, keys: str) -> None:
    """Refuse a bool or int of swept values (an ``if``, ``int()``) that differs between members."""
    results = []
    for _, values in binding.members or ():
        with binding.bind(values):
            results.append(_call(func, args, kwargs))
    labels = [label for label, _ in binding.members or ()]
    kind, what, fix = _DECISIONS[_name(func)]
    for k, result in enumerate(results):
        if result != results[0]:
            raise MemberMismatch(
                f"experiment(config) turns {keys} into a Python {kind} ({what}) while it is "
                f"built that differs between members: {results[0]!r} for member 0 "
                f"({labels[0]}), {result!r} for member {k} ({labels[k]}); {fix}"
            )


def _swept_keys(values: tuple) -> list[str]:
    """The swept keys ``values`` were computed from, sorted."""
    keys: dict[str, None] = {}
    pending, seen = list(_swept_in(values)), set()
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.swept_recipe is None:
            keys[value.swept_name] = None
        else:
            _, args, kwargs = value.swept_recipe
            pending.extend(_swept_in((*args, *kwargs.values())))
    return sorted(keys)


def _swept_in(values: tuple | list) -> Iterator[SweptValue]:
    for value in values:
        if isinstance(value, SweptValue):
            yield value
        elif isinstance(value, list | tuple):
            yield from _swept_in(value)


def _call(func: Callable[..., Any], args: tuple, kwargs: dict,
          memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``func`` run on the current tensors of the swept values among its arguments."""
    memo = {} if memo is None else memo
    return func(*_resolve(args, memo), **{key: _resolve(v, memo) for key, v in kwargs.items()})


def _resolve(value: Any, memo: dict[int, torch.Tensor]) -> Any:
    """A swept value's current tensor; lists and tuples are searched."""
    if isinstance(value, SweptValue):
        return _current(value, memo)
    if isinstance(value, list | tuple) and next(_swept_in(value), None) is not None:
        return type(value)(_resolve(v, memo) for v in value)
    return value


def _current(root: SweptValue, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """``root``'s tensor now, inputs first, without recursion (chains can be deep)."""
    pending = [root]
    while pending:
        value = pending[-1]
        if id(value) in memo:
            pending.pop()
            continue
        waiting = [v for v in _inputs(value) if id(v) not in memo]
        if waiting:
            pending.extend(waiting)
            continue
        pending.pop()
        memo[id(value)] = _computed(value, memo)
    return memo[id(root)]


def _inputs(value: SweptValue) -> list[SweptValue]:
    """The swept values ``value``'s op is redone on (none outside a step: it is built)."""
    if value.swept_recipe is None or value.swept_binding.values is None:
        return []
    _, args, kwargs = value.swept_recipe
    return list(_swept_in((*args, *kwargs.values())))


def _computed(value: SweptValue, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """``value``'s tensor now, from its inputs' in ``memo``; each use counts as a read."""
    binding = value.swept_binding
    binding.reads += 1
    bound = binding.values
    if value.swept_recipe is not None and bound is not None:
        return _call(*value.swept_recipe, memo)
    if value.swept_recipe is not None:  # outside a step: the value it was built with
        return value.swept_plain
    # A key: a fresh tensor per use, as torch.as_tensor(float) is in a single run, so that
    # writing into it (torch.as_tensor(config["lr"]).mul_(2)) changes no other use
    own = bound.get(value.swept_name) if bound is not None else None
    return (value.swept_plain if own is None else own).clone()
