"""Flattening an update's trees with less Python than torch's pytree module (whose many small
functions cost most with the cold caches an update starts with): dicts, lists and tuples of
tensors are walked here, anything else goes through ``_pytree``. Leaves come in ``_pytree``'s
order; the structure is a hashable nested tuple, or a ``TreeSpec`` from the fallback.

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

