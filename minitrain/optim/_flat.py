"""Flattening an update's trees with less Python: dicts, lists and tuples of tensors are walked
by one small function; anything else (namedtuples, OrderedDicts, None, registered nodes, tensor
subclasses) goes through ``torch.utils._pytree``. Leaves come in ``_pytree``'s order and
:func:`unflatten` rebuilds the same containers (dicts in their key order), so the two are
interchangeable; the structure is a hashable nested tuple, or a ``TreeSpec`` from the fallback.

An optimizer flattens params, grads and state on every update, and the update's Python starts
with cold caches (the previous update or a backward pass has swept them), where ``_pytree``'s
many small functions cost most.

>>> leaves, structure = flatten({"w": torch.ones(2), "b": [torch.zeros(1)]})
>>> [t.shape for t in leaves], unflatten(structure, leaves)["b"][0]
([torch.Size([2]), torch.Size([1])], tensor([0.]))
"""

from __future__ import annotations

from typing import Any

import torch

from minitrain._torch import pytree as _pytree

__all__ = ["flatten", "unflatten"]

_LEAF_TYPES = (torch.Tensor, torch.nn.Parameter)
_DICT, _LIST, _TUPLE = 0, 1, 2


class _Other(Exception):
    """A node this module leaves to ``_pytree``."""


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``(leaves, structure)`` of ``tree``, as ``_pytree.tree_flatten`` gives its leaves."""
    leaves: list[Any] = []
    try:
        return leaves, _walk(tree, leaves)
    except _Other:
        return _pytree.tree_flatten(tree)


def _walk(node: Any, leaves: list[Any]) -> Any:
    kind = type(node)
    if kind in _LEAF_TYPES:
        leaves.append(node)
        return None
    if kind is dict:
        return (_DICT, tuple(node), tuple([_walk(value, leaves) for value in node.values()]))
    if kind is list:
        return (_LIST, tuple([_walk(value, leaves) for value in node]))
    if kind is tuple:
        return (_TUPLE, tuple([_walk(value, leaves) for value in node]))
    raise _Other


def unflatten(structure: Any, leaves: list[Any]) -> Any:
    """The tree of ``structure`` (from :func:`flatten`) with ``leaves`` in its leaves' places."""
    if isinstance(structure, _pytree.TreeSpec):
        return _pytree.tree_unflatten(leaves, structure)
    given = iter(leaves)
    tree = _build(structure, given)
    if next(given, given) is not given:
        raise ValueError(f"unflatten got more leaves ({len(leaves)}) than the structure holds")
    return tree


def _build(structure: Any, given: Any) -> Any:
    if structure is None:
        try:
            return next(given)
        except StopIteration:
            raise ValueError("unflatten got fewer leaves than the structure holds") from None
    if structure[0] == _DICT:
        return dict(zip(structure[1], [_build(child, given) for child in structure[2]],
                        strict=True))
    children = [_build(child, given) for child in structure[1]]
    return children if structure[0] == _LIST else tuple(children)


def plain(structure: Any) -> bool:
    """Whether :func:`unflatten` rebuilds ``structure`` without running any of the caller's
    code: dicts, lists and tuples this module walked, with ``str`` or ``int`` dict keys (whose
    hashing runs no ``__hash__`` of the caller's), not a ``_pytree`` spec (whose registered
    nodes and namedtuple classes are the caller's code).

    >>> plain(flatten({"w": torch.ones(1), "b": [torch.ones(1)]})[1])
    True
    >>> from collections import OrderedDict
    >>> plain(flatten(OrderedDict(w=torch.ones(1)))[1])  # a _pytree spec
    False
    """
    if structure is None:
        return True
    if type(structure) is not tuple:
        return False
    if structure[0] == _DICT:
        return all(type(key) is str or type(key) is int for key in structure[1]) and \
            all(map(plain, structure[2]))
    return all(map(plain, structure[1]))
