"""Checks of an optimizer's inputs: params and grads leaf by leaf, hyperparameters, states,
and which path (batched foreach kernels or per-leaf ops) an update may take."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._host import _PLAIN_TENSOR_TYPES, is_traced
from minitrain.optim.kernels.checks import grad_leaf_error, none_param_error
from minitrain.tree import Grads, Params

__all__ = ["WeightDecayMask", "check_grads", "check_params", "decay_flags", "tensor_leaves",
           "floating_updates", "check_state_type", "check_like", "hyperparameter", "check_pair",
           "check_hyperparameter", "check_lr", "use_plain_path", "scalar"]


WeightDecayMask = Params | Callable[[str, Tensor], bool] | None
"""Which leaves get weight decay: a pytree of bools like params, or ``fn(name, leaf) -> bool``."""


def check_params(params: Params) -> list[Tensor]:
    """The leaves of ``params``, checked to be floating-point tensors."""
    leaves = tree.named_leaves(params)
    if not leaves:
        raise ValueError("params has no tensor leaves; pass a pytree of floating-point tensors")
    for name, leaf in leaves:
        if not isinstance(leaf, Tensor) or not (leaf.is_floating_point()):
            kind = leaf.dtype if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(
                f"param {name!r} is {kind}; optimizers update floating-point tensors only"
            )
    return [leaf for _, leaf in leaves]


def check_grads(grads: Grads, params: Params) -> list[Tensor]:
    """The leaves of ``grads``, checked to match ``params`` leaf by leaf (structure, shape,
    dtype) and to be dense."""
    if (error := grad_leaf_error(grads)) is not None:
        raise error
    tree.assert_same_structure(params, grads, names=("params", "grads"), check_shapes=True)
    grad_leaves = tree.leaves(grads)
    for (name, param), grad in zip(tree.named_leaves(params), grad_leaves, strict=True):
        if not isinstance(grad, Tensor) or grad.dtype != param.dtype:
            kind = grad.dtype if isinstance(grad, Tensor) else type(grad).__name__
            raise ValueError(
                f"grads differ from params at leaf {name!r}: {kind} vs {param.dtype}; "
                f"pass grads with the params' dtypes"
            )
    return grad_leaves


def decay_flags(mask: WeightDecayMask, params: Params) -> list[bool]:
    """Per leaf: whether weight decay applies (all leaves when ``mask`` is None)."""
    named = tree.named_leaves(params)
    if mask is None:
        return [True] * len(named)
    if callable(mask):
        return [bool(mask(name, leaf)) for name, leaf in named]
    tree.assert_same_structure(params, mask, names=("params", "weight-decay mask"))
    flags = tree.leaves(mask)
    for (name, _), flag in zip(named, flags, strict=True):
        if not isinstance(flag, bool):
            raise ValueError(
                f"weight-decay mask leaf {name!r} is {type(flag).__name__}; use True or False"
            )
    return flags


def tensor_leaves(name: str, values: Any, what: str, floating: bool = False) -> list[Tensor]:
    """The leaves of ``values`` (``what``: "updates leaf", "grads leaf", "param"), refused in
    one line naming the first that is no tensor (``floating``: no floating or complex tensor).

    >>> tensor_leaves("scale", {"a": 2.0}, "updates leaf")
    Traceback (most recent call last):
    ...
    ValueError: scale: updates leaf 'a' is of type float, not a tensor; pass torch.tensor(2.0)
    """
    leaves = _pytree.tree_leaves(values)
    if all(isinstance(x, Tensor) and (not floating or _inexact(x)) for x in leaves):
        return leaves
    at, leaf = next((n, x) for n, x in tree.named_leaves(values)
                    if not isinstance(x, Tensor) or floating and not _inexact(x))
    if leaf is None:
        raise grad_leaf_error(values) if what != "param" else none_param_error(values)
    if isinstance(leaf, Tensor):
        raise ValueError(f"{name} keeps state like each param, and param {at!r} is {leaf.dtype};"
                         f" pass floating-point params (optimizers update those only)")
    raise ValueError(f"{name}: {what} {at!r} is of type {type(leaf).__name__}, not a "
                     f"tensor; pass {_tensor_hint(leaf)}")


def _tensor_hint(leaf: Any) -> str:
    """How to pass ``leaf`` as a tensor: ``torch.tensor(2.0)`` for a number (numpy's too).

    >>> _tensor_hint(2), _tensor_hint(1j), _tensor_hint("x")
    ('torch.tensor(2.0)', 'torch.tensor(1j)', 'a tensor (torch.as_tensor)')
    """
    try:
        value = complex(leaf) if isinstance(leaf, numbers.Number) else None
    except (OverflowError, TypeError, ValueError):  # an int beyond float, say
        value = None
    if value is None:
        return "a tensor (torch.as_tensor)"
    return f"torch.tensor({value if value.imag else value.real!r})"


def _inexact(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def floating_updates(name: str, updates: Any, params: Any = None) -> Any:
    """``updates`` (checked by :func:`tensor_leaves`) with each integer or bool leaf promoted
    to its param's floating dtype, else (no params, an integer param) the default float dtype:
    torch's promotion of ``int_tensor + param`` and of ``int_tensor * 0.5``."""
    leaves = tensor_leaves(name, updates, "updates leaf")
    if all(_inexact(u) for u in leaves):
        return updates
    p_leaves = [] if params is None else _pytree.tree_leaves(params)  # a mismatch: named later
    p_leaves = p_leaves if len(p_leaves) == len(leaves) else [None] * len(leaves)
    return _pytree.tree_unflatten([u if _inexact(u) else u.to(
        p.dtype if isinstance(p, Tensor) and _inexact(p) else torch.get_default_dtype())
        for u, p in zip(leaves, p_leaves, strict=True)], _pytree.tree_structure(updates))


def check_state_type(name: str, state_type: type, state: Any) -> None:
    """``ValueError`` unless ``state`` is the ``state_type`` that ``name``'s init returns."""
    if not isinstance(state, state_type):
        raise ValueError(
            f"{name} expected a {state_type.__name__}, got {type(state).__name__}; "
            f"pass the state returned by its init(params)"
        )


def check_like(a: Any, b: Any, names: tuple[str, str]) -> None:
    """``ValueError`` naming the first leaf where ``a`` and ``b`` differ in structure or where
    two tensors differ in shape (a cheap pass over the leaves first; the named check only on a
    mismatch). Other leaves (a None grad, say) are left to the update, whose error names them.

    >>> check_like({"w": torch.ones(3)}, {"w": torch.ones(4)}, ("params", "updates"))
    Traceback (most recent call last):
    ...
    ValueError: params and updates differ at leaf 'w': shape (3,) vs (4,); pass trees ...
    """
    leaves_a, leaves_b = tree.leaves(a), tree.leaves(b)
    if len(leaves_a) != len(leaves_b) or any(
        isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape != y.shape
        for x, y in zip(leaves_a, leaves_b, strict=True)
    ) or tree.structure(a) != tree.structure(b):
        tree.assert_same_structure(a, b, names=names, check_shapes=True)


def hyperparameter(name: str, value: Any) -> Any:
    """A hyperparameter as torch.optim takes it: a number unchanged, a one-element tensor
    squeezed to 0-d (``torch.optim.optimizer._to_scalar``); a longer tensor is refused.

    >>> hyperparameter("betas[0]", torch.tensor([[0.9]])).shape
    torch.Size([])
    >>> hyperparameter("lr", torch.tensor([0.1, 0.2]))
    Traceback (most recent call last):
    ...
    ValueError: invalid lr: a tensor lr must have one element, got shape (2,); pass a 0-d tensor
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"invalid {name}: a tensor {name} must have one element, got shape "
                f"{tuple(value.shape)}; pass a 0-d tensor"
            )
        return value.reshape(()) if value.dim() else value
    if isinstance(value, bool | int | float):
        return value
    raise ValueError(
        f"invalid {name}={value!r}: pass a number or a one-element tensor"
    )


def check_pair(name: str, values: Any) -> tuple[Any, Any]:
    """A pair like ``betas``: both numbers or both tensors (torch.optim refuses a mix).

    >>> check_pair("betas", (0.9, torch.tensor(0.999)))
    Traceback (most recent call last):
    ...
    ValueError: invalid betas: mixes a float and a tensor; pass both as floats or both as tensors
    """
    if not isinstance(values, tuple | list) or len(values) != 2:
        raise ValueError(f"invalid {name}={values!r}: pass a pair ({name}[0], {name}[1])")
    kinds = {isinstance(v, Tensor) for v in values}
    if len(kinds) != 1:
        raise ValueError(
            f"invalid {name}: mixes a float and a tensor; pass both as floats or both as tensors"
        )
    return hyperparameter(f"{name}[0]", values[0]), hyperparameter(f"{name}[1]", values[1])


def check_hyperparameter(name: str, value: Any, low: float, high: float = math.inf,
                         *, low_open: bool = False, high_open: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` when a concrete ``value`` is outside its range.

    Values that cannot be read without tracing (vmapped or compiled tensors) are not checked.
    """
    number = _concrete_number(name, value)
    if number is None:
        return
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if math.isnan(number) or too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(
            f"invalid {name}={number!r}: it must lie in {left}{low}, {high}{right}; "
            f"pass a value in that range"
        )


def _concrete_number(name: str, value: Any) -> float | None:
    """``value`` as a float; None where it cannot be read without tracing (and for a tensor
    subclass of several elements, such as a sweep's per-member values)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Tensor):
        if is_traced(value) or value.numel() != 1 and type(value) is not Tensor:
            return None
        if value.numel() != 1:
            raise ValueError(f"invalid {name}: a tensor of shape {tuple(value.shape)}; pass a "
                             f"number or a one-element tensor")
        if value.is_complex() or value.is_meta:  # no real value to read
            raise ValueError(f"invalid {name}: a {value.dtype} tensor on {value.device.type}; "
                             f"pass a real number or a one-element real tensor holding data")
        return float(value.detach().reshape(()).item())
    raise ValueError(f"invalid {name}={value!r}: pass a number or a one-element tensor")


def check_lr(lr: Any) -> None:
    """Check a learning rate given as a number or tensor (a schedule is checked per step)."""
    if callable(lr) and not isinstance(lr, Tensor):
        return
    check_hyperparameter("lr", lr, 0.0)


def use_plain_path(tensors: Sequence[Tensor], hyperparameters: Sequence[Any]) -> bool:
    """Whether an update must take per-leaf tensor ops rather than batched foreach kernels:
    under a compiler or functorch transform, or with grad mode on and a leaf or tensor
    hyperparameter that requires grad (a differentiable lr: foreach kernels would detach it)."""
    if torch.compiler.is_compiling():
        return True
    if any(is_traced(value) for value in hyperparameters):
        return True
    wrapped = _torch.is_functorch_wrapped_tensor
    for t in tensors:  # is_traced, inlined: an update checks every leaf
        if type(t) in _PLAIN_TENSOR_TYPES:
            if wrapped(t):
                return True
        elif is_traced(t):
            return True
    return torch.is_grad_enabled() and (
        any(t.requires_grad for t in tensors)
        or any(isinstance(v, Tensor) and v.requires_grad for v in hyperparameters)
    )


def scalar(value: Any) -> Any:
    """A concrete 0-d tensor hyperparameter as a Python float; anything else unchanged."""
    if isinstance(value, Tensor) and value.numel() == 1 and not is_traced(value):
        return float(value.detach().reshape(()).item())
    return value
