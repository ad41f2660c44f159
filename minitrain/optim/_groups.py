"""The leaves ``multi_transform`` and ``masked`` hand to their inner transformations, keyed by
their names in the whole params, so a group's state is named after its params
(``inner_states.adam.mu.w``) and a checkpoint resumed with other labels fails to load.
"""

from __future__ import annotations

from typing import Any

from minitrain import tree
from minitrain._torch import pytree as _pytree

__all__ = ["LeafGroup", "refuse_list_groups"]


class LeafGroup(dict):
    """A dict of one transformation's leaves, keyed by their names in the whole params.

    >>> import torch, minitrain as mt
    >>> g = LeafGroup([("w", torch.ones(2)), ("b", torch.zeros(1))])
    >>> mt.tree.named_leaves(mt.tree.map(lambda t: t * 2, g))
    [('w', tensor([2., 2.])), ('b', tensor([0.]))]
    """

    def __repr__(self) -> str:
        return f"LeafGroup({dict.__repr__(self)})"


_pytree.register_pytree_node(
    LeafGroup,
    lambda g: (list(g.values()), list(g.keys())),
    lambda values, keys: LeafGroup(zip(keys, values, strict=True)),
    serialized_type_name="minitrain.optim.LeafGroup",
    flatten_with_keys_fn=lambda g: ([(_pytree.MappingKey(k), v) for k, v in g.items()],
                                    list(g.keys())),
)


def refuse_list_groups(template: Any, template_names: set[str], saved_names: list[str]) -> None:
    """``ValueError`` where ``saved_names`` are those of ``template`` (whose leaves are
    ``template_names``) with each :class:`LeafGroup` a list (``inner_states.adam.mu.0``): a
    checkpoint saved when groups were lists."""
    unknown = [name for name in saved_names if name not in template_names]
    lists = _pytree.tree_map(lambda node: list(node.values()) if type(node) is LeafGroup
                             else node, template, is_leaf=lambda node: type(node) is LeafGroup)
    if unknown and set(saved_names) <= {name for name, _ in tree.named_leaves(lists)}:
        raise ValueError(f"the checkpoint predates named leaf groups (it names {unknown[0]!r}); "
                         f"multi_transform and masked states saved as lists no longer load")
