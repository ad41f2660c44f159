"""The leaves ``multi_transform`` and ``masked`` hand to their inner transformations, keyed by
their names in the whole params, so a group's state is named after its params
(``inner_states.adam.mu.w``) and a checkpoint resumed with other labels fails to load.
"""

from __future__ import annotations

from minitrain._torch import pytree as _pytree

__all__ = ["LeafGroup"]


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
