"""Pytree utilities: tiny pure functions over nested dicts, lists, tuples and NamedTuples.

Leaves are visited in a stable order (dict keys as inserted, items by index, NamedTuple fields
as declared) and named by their dotted path, as ``state_dict`` names them.

>>> import torch
>>> import minitrain as mt
>>> params = {"layers": [{"weight": torch.ones(2, 2)}], "final": {"weight": torch.ones(2)}}
>>> [name for name, _ in mt.tree.named_leaves(params)], mt.tree.size(params)
(['layers.0.weight', 'final.weight'], 6)
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

import torch

from minitrain import _torch
from minitrain._torch import pytree as _pytree

__all__ = [
    "PyTree", "Params", "Grads", "OptState", "map", "leaves", "named_leaves", "structure",
    "unflatten", "zeros_like", "size", "nbytes", "global_norm", "per_example_global_norm",
    "assert_same_structure", "stack", "unstack",
]

PyTree = Any
"""A nested dict / list / tuple / NamedTuple whose leaves are tensors (or plain numbers)."""
Params = PyTree
"""Model parameters: a pytree of tensors."""
Grads = PyTree
"""Gradients: a pytree with the structure of the params."""
OptState = PyTree
"""Optimizer state: a pytree of tensors and plain numbers."""


def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:  # noqa: A001
    """Apply ``fn`` leaf-wise over ``tree`` and any trees of the same structure.

    >>> import torch
    >>> map(lambda a, b: a + b, {"w": torch.tensor(1.)}, {"w": torch.tensor(2.)})
    {'w': tensor(3.)}
    """
    for index, other in enumerate(rest):
        assert_same_structure(tree, other, names=("tree", f"rest[{index}]"))
    return _pytree.tree_map(fn, tree, *rest)


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in the documented order.

    >>> import torch
    >>> leaves({"b": torch.zeros(1), "a": [torch.ones(1), torch.ones(2)]})
    [tensor([0.]), tensor([1.]), tensor([1., 1.])]
    """
    return _pytree.tree_leaves(tree)


def named_leaves(tree: PyTree) -> list[tuple[str, Any]]:
    """``[(dotted_name, leaf), ...]`` in the order of :func:`leaves`, like ``state_dict()``.

    >>> import torch
    >>> [n for n, _ in named_leaves({"layers": [{"weight": torch.ones(1)}]})]
    ['layers.0.weight']
    """
    flat, _ = _pytree.tree_flatten_with_path(tree)
    return [(_path_name(path), leaf) for path, leaf in flat]


def structure(tree: PyTree) -> _pytree.TreeSpec:
    """The tree's structure (a ``TreeSpec``), for :func:`unflatten`.

    >>> import torch
    >>> structure({"w": torch.zeros(2), "b": [torch.zeros(1)]}).num_leaves
    2
    """
    return _pytree.tree_structure(tree)


def unflatten(spec: _pytree.TreeSpec, leaves: list[Any]) -> PyTree:
    """Rebuild a tree from its structure and leaves (inverse of :func:`leaves`).

    >>> import torch
    >>> t = {"a": torch.ones(1), "b": (torch.zeros(1),)}
    >>> unflatten(structure(t), leaves(t))
    {'a': tensor([1.]), 'b': (tensor([0.]),)}
    """
    return _pytree.tree_unflatten(leaves, spec)


def zeros_like(tree: PyTree) -> PyTree:
    """A tree of zeros with the shapes, dtypes and devices of ``tree``'s leaves.

    >>> import torch
    >>> zeros_like({"w": torch.ones(2, dtype=torch.float64)})
    {'w': tensor([0., 0.], dtype=torch.float64)}
    """
    return _pytree.tree_map(torch.zeros_like, tree)


def size(tree: PyTree) -> int:
    """Total number of elements over all tensor leaves (``sum(t.numel())``).

    >>> import torch
    >>> size({"w": torch.zeros(3, 4), "b": torch.zeros(4)})
    16
    """
    return builtins.sum(leaf.numel() for leaf in leaves(tree) if isinstance(leaf, torch.Tensor))


def nbytes(tree: PyTree) -> int:
    """Total bytes of all tensor leaves: ``numel * element_size`` summed.

    >>> import torch
    >>> nbytes({"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)})
    56
    """
    return builtins.sum(leaf.numel() * leaf.element_size() for leaf in leaves(tree)
                        if isinstance(leaf, torch.Tensor))


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all leaves together, in ``clip_grad_norm_``'s form (fp32 at least).

    >>> import torch
    >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
    tensor(5.)
    """
    tensors = [leaf for leaf in leaves(tree) if isinstance(leaf, torch.Tensor)]
    if not tensors:  # float32 on the CPU whatever torch's default dtype and device
        return torch.zeros((), dtype=torch.float32, device="cpu")
    if torch.compiler.is_compiling() or any(_torch.is_functorch_wrapped_tensor(t)
                                            for t in tensors):
        # Under vmap/grad _foreach_norm has no batching rule, and compiled, inductor fuses the
        # per-leaf norms: one norm per leaf.
        norms = [torch.linalg.vector_norm(_at_least_fp32(t), 2) for t in tensors]
    else:
        norms = _torch.foreach_norm([_at_least_fp32(t) for t in tensors], 2)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2)


def per_example_global_norm(tree: PyTree) -> torch.Tensor:
    """Each example's :func:`global_norm` over leaves with a leading batch dim: ``(B,)`` norms.

    What ``vmap(global_norm)`` computes, as one norm over each leaf reshaped ``(B, -1)`` and one
    over the stacked per-leaf norms (optax ``per_example_global_norm_clip``'s norm); fp32 at least.

    >>> import torch
    >>> per_example_global_norm({"a": torch.tensor([[3.0], [0.0]]), "b": torch.tensor([4.0, 1.0])})
    tensor([5., 1.])
    """
    tensors = [t for t in leaves(tree) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError("per_example_global_norm() needs tensor leaves with a leading batch dim")
    batch = tensors[0].shape[0] if tensors[0].dim() else None
    if any(t.dim() == 0 or t.shape[0] != batch for t in tensors):  # name the first such leaf
        named = [(name, t) for name, t in named_leaves(tree) if isinstance(t, torch.Tensor)]
        name, t = next((name, t) for name, t in named if t.dim() == 0 or t.shape[0] != batch)
        raise ValueError(
            f"leaf {name!r} has shape {tuple(t.shape)} but leaf {named[0][0]!r} has "
            f"{tuple(named[0][1].shape)}; every leaf needs the same leading batch dim"
        )
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = [torch.linalg.vector_norm(t.flatten(1) if t.dim() > 1 else t.unsqueeze(1), 2, dim=1,
                                      dtype=dtype) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms), 2, dim=0)


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def assert_same_structure(
    a: PyTree, b: PyTree, names: tuple[str, str] = ("a", "b"), check_shapes: bool = False
) -> None:
    """Raise ``ValueError`` naming the first leaf where ``a`` and ``b`` differ.

    >>> import torch
    >>> assert_same_structure({"w": torch.ones(1)}, {"v": torch.ones(1)}, ("params", "grads"))
    Traceback (most recent call last):
    ...
    ValueError: params and grads differ at leaf 'w': params has 'w' where grads has 'v'; ...
    """
    leaves_a, spec_a = _pytree.tree_flatten(a)
    leaves_b, spec_b = _pytree.tree_flatten(b)
    name_a, name_b = names
    if spec_a == spec_b:  # the common case, without building every leaf's path
        pairs = enumerate(zip(leaves_a, leaves_b, strict=True)) if check_shapes else ()
        for index, (leaf_a, leaf_b) in pairs:
            if _shape(leaf_a) != _shape(leaf_b):
                path = _path_name(_pytree.tree_flatten_with_path(a)[0][index][0])
                raise ValueError(
                    f"{name_a} and {name_b} differ at leaf {path!r}: shape {_shape(leaf_a)} "
                    f"vs {_shape(leaf_b)}; pass trees whose leaves have the same shapes"
                )
        return
    flat_a, flat_b = _pytree.tree_flatten_with_path(a)[0], _pytree.tree_flatten_with_path(b)[0]
    for (path_a, _), (path_b, _) in zip(flat_a, flat_b, strict=False):
        kinds_a, kinds_b = [type(e) for e in path_a], [type(e) for e in path_b]
        if (_path_name(path_a), kinds_a) != (_path_name(path_b), kinds_b):
            raise ValueError(
                f"{name_a} and {name_b} differ at leaf {_path_name(path_a)!r}: "
                f"{name_a} has {_path_name(path_a)!r} where {name_b} has "
                f"{_path_name(path_b)!r}; pass trees with the same structure"
            )
    if len(flat_a) == len(flat_b):  # (a list and a tuple name their leaves alike)
        raise ValueError(
            f"{name_a} and {name_b} have different container types: "
            f"{spec_a} vs {spec_b}; pass trees with the same structure"
        )
    shorter, longer = (name_a, name_b) if len(flat_a) < len(flat_b) else (name_b, name_a)
    extra = flat_b[len(flat_a)] if len(flat_a) < len(flat_b) else flat_a[len(flat_b)]
    raise ValueError(
        f"{name_a} and {name_b} differ at leaf {_path_name(extra[0])!r}: {longer} has it and "
        f"{shorter} does not; pass trees with the same structure"
    )


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else ()


def _path_name(path: tuple[Any, ...]) -> str:
    return ".".join(
        str(e.key if isinstance(e, _pytree.MappingKey) else e.idx
            if isinstance(e, _pytree.SequenceKey) else e.name
            if isinstance(e, _pytree.GetAttrKey) else e)
        for e in path
    )


def stack(trees: list[PyTree] | tuple[PyTree, ...]) -> PyTree:
    """One tree whose tensor leaves stack those of ``trees`` along a new leading axis.

    Non-tensor leaves must be equal in every tree (as ``torch.func.stack_module_state``).

    >>> import torch
    >>> stack([{"w": torch.zeros(2)}, {"w": torch.ones(2)}])["w"]
    tensor([[0., 0.],
            [1., 1.]])
    """
    trees = list(trees)
    if not trees:
        raise ValueError("stack() needs at least one tree; pass a non-empty list of pytrees")
    first = trees[0]
    for index, other in enumerate(trees[1:], start=1):
        assert_same_structure(first, other, ("trees[0]", f"trees[{index}]"), check_shapes=True)
        for (name, a), b in zip(named_leaves(first), leaves(other), strict=True):
            _check_stackable(name, a, b, index)
    columns = zip(*(leaves(tree) for tree in trees), strict=True)
    stacked = [torch.stack(c) if isinstance(c[0], torch.Tensor) else c[0] for c in columns]
    return unflatten(structure(first), stacked)


def unstack(tree: PyTree) -> list[PyTree]:
    """The K trees of a stacked tree (inverse of :func:`stack`); tensor leaves are views.

    >>> import torch
    >>> unstack({"w": torch.tensor([[0.0, 0.0], [1.0, 1.0]]), "name": "a"})[1]
    {'w': tensor([1., 1.]), 'name': 'a'}
    """
    named = named_leaves(tree)
    tensors = [(name, leaf) for name, leaf in named if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise ValueError("unstack() needs a tree with tensor leaves; pass a stacked pytree")
    for name, leaf in tensors:
        if leaf.dim() == 0 or leaf.shape[0] != tensors[0][1].shape[0]:
            raise ValueError(
                f"leaf {name!r} has shape {tuple(leaf.shape)} but leaf {tensors[0][0]!r} "
                f"stacks {tensors[0][1].shape[0]} trees; every tensor leaf needs that leading axis"
            )
    spec, flat = structure(tree), [leaf for _, leaf in named]
    return [unflatten(spec, [leaf[k] if isinstance(leaf, torch.Tensor) else leaf for leaf in flat])
            for k in range(tensors[0][1].shape[0])]


def _check_stackable(name: str, a: Any, b: Any, index: int) -> None:
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        raise ValueError(
            f"trees[0] and trees[{index}] differ at leaf {name!r}: a tensor in one, a "
            f"{type(b if isinstance(a, torch.Tensor) else a).__name__} in the other"
        )
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.device != b.device:
            raise ValueError(
                f"trees[0] and trees[{index}] differ at leaf {name!r}: {a.dtype} on {a.device} "
                f"vs {b.dtype} on {b.device}; pass trees with the same dtypes and devices"
            )
    elif a != b:
        raise ValueError(
            f"trees[0] and trees[{index}] differ at non-tensor leaf {name!r}: {a!r} vs {b!r}; "
            "non-tensor leaves must be equal to be stacked"
        )
