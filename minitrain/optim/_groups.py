"""The leaves ``multi_transform`` and ``masked`` hand to their inner transformations, keyed by
their names in the whole params, so a group's state is named after its params
(``inner_states.adam.mu.w``) and a checkpoint resumed with other labels fails to load. Those
saved when groups were lists (``inner_states.adam.mu.0``) still load (:func:`legacy_template`).
"""

from __future__ import annotations

from typing import Any

from minitrain import tree
from minitrain._torch import pytree as _pytree

__all__ = ["LeafGroup", "group", "as_lists", "like", "legacy_template"]


class LeafGroup(dict):
    """A dict of one transformation's leaves, keyed by their names in the whole params.

    >>> import torch, minitrain as mt
    >>> g = group([("w", torch.ones(2)), ("b", torch.zeros(1))])
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


def group(named: list[tuple[str, Any]]) -> LeafGroup:
    """A :class:`LeafGroup` of ``(name, leaf)`` pairs, in their order."""
    return LeafGroup(named)


def _is_group(node: Any) -> bool:
    return type(node) is LeafGroup


def as_lists(pytree: Any) -> Any:
    """``pytree`` with every :class:`LeafGroup` a list of its values: the old layout.

    >>> as_lists({"a": group([("w", 1), ("b", 2)])})
    {'a': [1, 2]}
    """
    return _pytree.tree_map(lambda node: list(node.values()) if _is_group(node) else node,
                            pytree, is_leaf=_is_group)


def like(template: Any, loaded: Any) -> Any:
    """``loaded`` (shaped like ``as_lists(template)``) with ``template``'s structure."""
    return tree.unflatten(tree.structure(template), tree.leaves(loaded))


def legacy_template(template: Any, template_names: set[str], saved_names: list[str]) -> Any:
    """``template`` (whose leaves are ``template_names``) in the layout of a checkpoint saved
    when groups were lists, when ``saved_names`` are that layout's and not the template's; else
    None."""
    has_groups = any(map(_is_group, _pytree.tree_leaves(template, is_leaf=_is_group)))
    if all(name in template_names for name in saved_names) or not has_groups:
        return None
    legacy = as_lists(template)
    legacy_names = {name for name, _ in tree.named_leaves(legacy)}
    return legacy if all(name in legacy_names for name in saved_names) else None
