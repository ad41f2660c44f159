"""What the members of one vmapped step must share: code paths, sizes and counts."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from minitrain.errors import ExperimentError
from minitrain.train.script_errors import is_user_file

__all__ = ["MemberMismatch", "check_same_sizes", "differing_members"]


class MemberMismatch(ExperimentError):
    """The members cannot share one vmapped step (their runs differ in more than values)."""


_SIZES_FIX = (
    "the members of one vmapped step share every shape, size and count, so member 0's would be "
    "everyone's: set sizes and counts with a CONFIG key of their own (not from a swept value), "
    "or train each value with its own minitrain run --set key=value"
)
_KINDS = {
    "bool": (
        "an if or a comparison",
        "one vmapped step runs one code path for every member, so all would take member 0's "
        "branch, even a branch that only sets a name or a message: write it without an if on "
        "the swept value (torch.where(lr > 0.1, a, b) for a tensor, f\"lr={lr:g}\" for a name) "
        "or run one sweep per branch, each with values on one side of the condition",
    ),
    "int": ("int(), round() or an index: a size, a length or a count", _SIZES_FIX),
}


def differing_members(kind: str, keys: str, results: Sequence[Any],
                      labels: Sequence[str]) -> MemberMismatch | None:
    """The refusal of a Python ``kind`` ("bool" or "int") that differs between members, or None."""
    for k, result in enumerate(results):
        if result != results[0]:
            what, fix = _KINDS[kind]
            return MemberMismatch(
                f"experiment(config) turns {keys} into a Python {kind} ({what}) while it is "
                f"built that differs between members: {results[0]!r} for member 0 "
                f"({labels[0]}), {result!r} for member {k} ({labels[k]}); {fix}"
            )
    return None


def check_same_sizes(parts: Sequence[dict[str, Any]], labels: Sequence[str],
                     rebuild_first: Callable[[], dict[str, Any]] | None = None) -> None:
    """Refuse members whose ``parts`` hold a different int, bool or tensor shape.

    ``rebuild_first`` builds member 0's parts again: a value that differs between two builds of
    one member (a timestamp) comes from no swept value, and passes.

    >>> labels = ["x=2 seed=0", "x=3 seed=0"]
    >>> def schedule(n):
    ...     return lambda count: count / n
    >>> try:
    ...     check_same_sizes([{"optimizer": schedule(10)}, {"optimizer": schedule(15)}], labels)
    ... except MemberMismatch as exc:
    ...     print(str(exc)[:78])
    member 1 (x=3 seed=0) builds an optimizer whose n is 15 where member 0's is 10
    """
    first = [_sizes(part) for part in parts[0].values()]
    again: list[list[tuple[str, str, Any]]] | None = None
    for k, member_parts in enumerate(parts[1:], start=1):
        for index, (what, want, got) in enumerate(
                zip(parts[0], first, map(_sizes, member_parts.values()), strict=True)):
            for at, ((path, where, value), (_, _, expected)) in enumerate(
                    zip(got, want, strict=False)):
                if _STRUCTURE in (value[0] if isinstance(value, tuple) else None,
                                  expected[0] if isinstance(expected, tuple) else None):
                    if value != expected:  # other code (weight_decay=0 leaves a step out): the
                        break  # state layout and first-step checks tell what differs
                elif value != expected:
                    if rebuild_first is not None and again is None:
                        again = [_sizes(part) for part in rebuild_first().values()]
                    if again is not None and _unstable(again[index], want, at):
                        continue
                    raise MemberMismatch(
                        f"member {k} ({labels[k]}) builds {_article(what)} whose {path}"
                        f"{where} is {_shown(value)} where member 0's is {_shown(expected)}; "
                        f"{_SIZES_FIX}"
                    )


def _unstable(again: list[tuple[str, str, Any]], first: list[tuple[str, str, Any]],
              at: int) -> bool:
    """Whether entry ``at`` of member 0's sizes differs between two builds that walk alike."""
    if len(again) != len(first) or any(
            (path, where) != (path_0, where_0)
            for (path, where, _), (path_0, where_0, _) in zip(again, first, strict=True)):
        return False
    return again[at][2] != first[at][2]


def _article(what: str) -> str:
    return f"an {what}" if what[0] in "aeiou" else f"a {what}"


def _shown(value: Any) -> str:
    return f"of shape {value[1]}" if isinstance(value, tuple) else repr(value)


_STRUCTURE = "structure"  # the length of a container of code, not of numbers


@dataclasses.dataclass(frozen=True)
class _Length:
    value: int | tuple[str, int]

_DATA = (int, float, complex, str, bytes, type(None), torch.Tensor)


_MAX_NODES = 5000  # objects looked into, per member's loss or optimizer
_MAX_ITEMS = 256
_LEAVES = (float, complex, str, bytes, type(None), type, types.ModuleType, torch.Generator,
           torch.dtype, torch.device)


def _sizes(root: Any) -> list[tuple[str, str, Any]]:
    """``(name, where, value)`` of each int, bool, length and tensor shape reachable from ``root``.
    """
    found: list[tuple[str, str, Any]] = []
    seen: set[int] = set()
    pending: list[tuple[Any, str, str]] = [(root, "value", "")]
    while pending and len(seen) < _MAX_NODES:
        value, name, where = pending.pop()
        if isinstance(value, bool | int | _Length):
            found.append((name, where, value.value if isinstance(value, _Length) else value))
            continue
        if isinstance(value, torch.Tensor):
            found.append((name, where, ("shape", tuple(value.shape))))
            continue
        if isinstance(value, _LEAVES) or id(value) in seen:
            continue
        seen.add(id(value))
        children = _children(value, name, where)
        pending.extend(reversed(children))
    return found


def _children(value: Any, name: str, where: str) -> list[tuple[Any, str, str]]:
    if isinstance(value, types.FunctionType):
        code = value.__code__
        if is_user_file(code.co_filename):
            where = f" (held by the function at {Path(code.co_filename).name} line " \
                    f"{code.co_firstlineno})"
        cells = [(var, cell) for var, cell in zip(code.co_freevars, value.__closure__ or (),
                                                 strict=True)]
        children = [(_contents(cell), var, where) for var, cell in cells]
        defaults = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
        return children + [(default, f"{value.__name__}'s default", where)
                           for default in defaults]
    if isinstance(value, functools.partial):
        return [(value.func, name, where), *((arg, name, where) for arg in value.args),
                *((arg, key, where) for key, arg in value.keywords.items())]
    if isinstance(value, types.MethodType):
        return [(value.__func__, name, where), (value.__self__, name, where)]
    if isinstance(value, list | tuple | dict):
        items = value.values() if isinstance(value, dict) else value
        numbers = all(isinstance(item, _DATA) for item in items)
        length = (_Length(len(value) if numbers else (_STRUCTURE, len(value))),
                  f"length of {name}", where)
        if len(value) > _MAX_ITEMS:  # data, not hyperparameters
            return [length]
        if isinstance(value, dict):
            return [length, *((item, str(key), where) for key, item in value.items())]
        fields = getattr(value, "_fields", None) or [name] * len(value)
        return [length, *((item, field, where) for field, item in zip(fields, value, strict=True))]
    if isinstance(value, torch.nn.Module):
        return [(tensor, key, where) for key, tensor in value.state_dict().items()]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return [(item, key, where) for key, item in attributes.items()]
    return []


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return None
