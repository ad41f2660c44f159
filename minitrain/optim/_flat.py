"""An update's trees flattened by torch's pytree module, with the structure first:
``leaves, structure = flatten(tree)`` and ``unflatten(structure, leaves)``.

>>> import torch
>>> leaves, structure = flatten({"w": torch.ones(2), "b": [torch.zeros(1)]})
>>> [t.shape for t in leaves], unflatten(structure, leaves)["b"][0]
([torch.Size([2]), torch.Size([1])], tensor([0.]))
"""

from __future__ import annotations

from typing import Any

from minitrain._torch import pytree as _pytree

__all__ = ["flatten", "unflatten"]

flatten = _pytree.tree_flatten


def unflatten(structure: Any, leaves: list[Any]) -> Any:
    """The tree of ``structure`` (from :func:`flatten`) with ``leaves`` in its leaves' places."""
    return _pytree.tree_unflatten(leaves, structure)
