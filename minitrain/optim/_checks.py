"""Checks of an optimizer's inputs (params, grads, hyperparameters, states), the path an update
takes (batched foreach kernels or per-leaf ops), and a state's host scalars: counts, lrs and
flags stay 0-d on the CPU whatever ``torch.set_default_device`` says."""

from __future__ import annotations

import array
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.tree import Grads, Params

Scalar = int | float | Tensor
"""A hyperparameter: a number or a one-element tensor (squeezed to 0-d like torch.optim)."""

WeightDecayMask = Params | Callable[[str, Tensor], bool] | None
"""Which leaves get weight decay: a pytree of bools like params, or ``fn(name, leaf) -> bool``."""

_PLAIN = (Tensor, torch.nn.Parameter)


# -- params and grads -------------------------------------------------------------------------


def grad_leaf_error(grads: Any) -> ValueError | None:
    """The error naming the first grad that is None (the ``.grad`` of a param the loss does
    not use) or not dense (a sparse embedding grad); None when all are dense tensors.

    >>> str(grad_leaf_error({"w": None})).split(";")[0]
    "the grad of 'w' is None (a param the loss does not use?)"
    """
    for name, g in tree.named_leaves(grads):
        if g is None:
            return ValueError(f"the grad of {name!r} is None (a param the loss does not use?); "
                              f"pass torch.zeros_like(param) for it, or leave the param out")
        if isinstance(g, Tensor) and g.layout is not torch.strided:
            return ValueError(
                f"the grad of {name!r} is a {g.layout} tensor, but the optimizers take dense "
                f"grads; pass grad.to_dense() (or build the embedding with sparse=False)")
    return None


def naming_bad_grads(update: Callable[..., Any]) -> Callable[..., Any]:
    """``update(grads, ...)`` whose error over a None or sparse grad is re-raised as
    :func:`grad_leaf_error`'s one line. Costs nothing until something raises."""

    @functools.wraps(update)
    def checked(grads: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return update(grads, *args, **kwargs)
        except (NotImplementedError, RuntimeError, AttributeError, TypeError):
            if (named := grad_leaf_error(grads)) is not None:
                raise named from None
            raise

    return checked


def check_params(params: Params) -> list[Tensor]:
    """The leaves of ``params``, checked to be floating-point tensors."""
    fast = _pytree.tree_leaves(params)
    if fast and all(isinstance(leaf, Tensor) and leaf.is_floating_point() for leaf in fast):
        return fast
    leaves = tree.named_leaves(params)
    if not leaves:
        raise ValueError("params has no tensor leaves; pass a pytree of floating-point tensors")
    for name, leaf in leaves:
        if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
            kind = leaf.dtype if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(
                f"param {name!r} is {kind}; optimizers update floating-point tensors only")
    return [leaf for _, leaf in leaves]


def check_grads(grads: Grads, params: Params) -> list[Tensor]:
    """The leaves of ``grads``, checked to be dense and like ``params`` (structure, shape,
    dtype) leaf by leaf (one pass over the leaves; the paths only to name a mismatch)."""
    grad_leaves, grad_spec = _pytree.tree_flatten(grads)
    param_leaves, param_spec = _pytree.tree_flatten(params)
    if grad_spec == param_spec and all(type(g) in _PLAIN and type(p) in _PLAIN
            and g.layout is torch.strided and g.shape == p.shape and g.dtype == p.dtype
            for g, p in zip(grad_leaves, param_leaves, strict=True)):
        return grad_leaves
    if (error := grad_leaf_error(grads)) is not None:
        raise error
    tree.assert_same_structure(params, grads, names=("params", "grads"), check_shapes=True)
    grad_leaves = tree.leaves(grads)
    for (name, param), grad in zip(tree.named_leaves(params), grad_leaves, strict=True):
        if not isinstance(grad, Tensor) or grad.dtype != param.dtype:
            kind = grad.dtype if isinstance(grad, Tensor) else type(grad).__name__
            raise ValueError(f"grads differ from params at leaf {name!r}: {kind} vs "
                             f"{param.dtype}; pass grads with the params' dtypes")
    return grad_leaves


def check_storages(trees: Sequence[tuple[str, Any]]) -> None:
    """``ValueError`` naming the first plain tensor leaf of ``trees`` (``(what, tree)`` pairs)
    whose storage holds fewer bytes than the tensor addresses (one resized by hand).

    >>> t = torch.ones(4); _ = t.untyped_storage().resize_(0)
    >>> check_storages([("param", {"w": t})])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: param 'w': its storage holds 0 bytes, fewer than the tensor addresses (was it...
    """
    for what, values in trees:
        for name, t in tree.named_leaves(values):
            if type(t) in _PLAIN and not _torch.is_functorch_wrapped_tensor(t) \
                    and not storage_holds(t):
                where, _, leaf = name.rpartition(".")
                # a state buffer is named by the param it is for
                name = f"{where} leaf {leaf!r}" if what == "state" and where else repr(name)
                raise ValueError(
                    f"{what} {name}: its storage holds {t.untyped_storage().nbytes()} bytes, "
                    f"fewer than the tensor addresses (was it resized?); pass tensors whose "
                    f"storage holds them")


def storage_holds(t: Tensor) -> bool:
    """Whether ``t``'s storage holds every element ``t`` addresses."""
    n = t.numel()
    if n == 0:
        return True
    extent = n if t.is_contiguous() else 1 + sum(
        (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + extent) * t.element_size() <= t.untyped_storage().nbytes()


def leaf_labels(labels: Any, params: Params, what: str) -> list[Any]:
    """Per leaf of ``params``: its label from ``labels``, a pytree like params or
    ``fn(name, leaf) -> label``."""
    if callable(labels):
        return [labels(name, leaf) for name, leaf in tree.named_leaves(params)]
    tree.assert_same_structure(params, labels, names=("params", what))
    return tree.leaves(labels)


def decay_flags(mask: WeightDecayMask, params: Params,
                what: str = "weight-decay mask") -> list[bool]:
    """Per leaf: whether ``mask`` (:func:`leaf_labels` of bools; None: every leaf) selects it."""
    flags = leaf_labels(mask if mask is not None else lambda name, leaf: True, params, what)
    if not callable(mask):
        for (name, _), flag in zip(tree.named_leaves(params), flags, strict=True):
            if not isinstance(flag, bool):
                raise ValueError(
                    f"{what} leaf {name!r} is {type(flag).__name__}; use True or False")
    return [bool(flag) for flag in flags]


def tensor_leaves(name: str, values: Any, what: str, floating: bool = False) -> list[Tensor]:
    """The leaves of ``values``, refused in one line naming the first that is no tensor (with
    ``floating``: no floating or complex tensor).

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
    if leaf is None and what == "param":
        raise ValueError(f"param {at!r} is None; pass a tensor for every param, or leave it out")
    if leaf is None:
        raise grad_leaf_error(values)
    if isinstance(leaf, Tensor):
        raise ValueError(f"{name} keeps state like each param, and param {at!r} is {leaf.dtype};"
                         f" pass floating-point params (optimizers update those only)")
    try:
        value = complex(leaf) if isinstance(leaf, numbers.Number) else None
    except (OverflowError, TypeError, ValueError):  # an int beyond float, say
        value = None
    hint = "a tensor (torch.as_tensor)" if value is None else \
        f"torch.tensor({value if value.imag else value.real!r})"
    raise ValueError(f"{name}: {what} {at!r} is of type {type(leaf).__name__}, not a tensor; "
                     f"pass {hint}")


def _inexact(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def floating_updates(name: str, updates: Any, params: Any = None) -> Any:
    """``updates`` with each integer or bool leaf promoted to its param's floating dtype, else
    the default float dtype (torch's promotion of ``int_tensor + param``, ``int_tensor * 0.5``)."""
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
        raise ValueError(f"{name} expected a {state_type.__name__}, got {type(state).__name__}; "
                         f"pass the state returned by its init(params)")


def check_like(a: Any, b: Any, names: tuple[str, str]) -> None:
    """``ValueError`` naming the first leaf where ``a`` and ``b`` differ in structure or shape."""
    tree.assert_same_structure(a, b, names=names, check_shapes=True)


# -- hyperparameters --------------------------------------------------------------------------


def hyperparameter(name: str, value: Any) -> Any:
    """A hyperparameter as torch.optim takes it: a number, or a one-element tensor as 0-d
    (``torch.optim.optimizer._to_scalar``).

    >>> hyperparameter("lr", torch.tensor([0.1, 0.2]))
    Traceback (most recent call last):
    ...
    ValueError: invalid lr: a tensor lr must have one element, got shape (2,); pass a 0-d tensor
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"invalid {name}: a tensor {name} must have one element, got shape "
                             f"{tuple(value.shape)}; pass a 0-d tensor")
        return value.reshape(()) if value.dim() else value
    if isinstance(value, bool | int | float):
        return value
    raise ValueError(f"invalid {name}={value!r}: pass a number or a one-element tensor")


def one_lr(lr: Any, name: str = "lr") -> Any:
    """An optimizer's ``lr``: a schedule, or one :func:`hyperparameter` (as torch.optim takes it;
    a 1-D lr per member is :func:`~minitrain.optim.scale_by_learning_rate`'s alone)."""
    if isinstance(lr, Tensor) and lr.dim() == 1 and len(lr) > 1:
        raise ValueError(f"invalid {name}: a tensor {name} must have one element, got shape "
                         f"{tuple(lr.shape)}; for a learning rate per member of stacked params, "
                         f"chain the rule with scale_by_learning_rate({name})")
    return lr if callable(lr) and not isinstance(lr, Tensor) else hyperparameter(name, lr)


def checked(name: str, value: Any, low: float, high: float = math.inf, **open_ends: bool) -> Any:
    """:func:`hyperparameter` of ``value``, checked by :func:`check_hyperparameter`."""
    value = hyperparameter(name, value)
    check_hyperparameter(name, value, low, high, **open_ends)
    return value


def check_pair(name: str, values: Any) -> tuple[Any, Any]:
    """A pair like ``betas``: both numbers or both tensors (torch.optim refuses a mix)."""
    if not isinstance(values, tuple | list) or len(values) != 2:
        raise ValueError(f"invalid {name}={values!r}: pass a pair ({name}[0], {name}[1])")
    if len({isinstance(v, Tensor) for v in values}) != 1:
        raise ValueError(f"invalid {name}: mixes a float and a tensor; pass both as floats or "
                         f"both as tensors")
    return hyperparameter(f"{name}[0]", values[0]), hyperparameter(f"{name}[1]", values[1])


def check_betas(betas: Any, high_open: bool = True) -> tuple[Any, Any]:
    """torch.optim's ``betas``, each in ``[0, 1)`` (``[0, 1]`` without ``high_open``)."""
    beta1, beta2 = check_pair("betas", betas)
    check_hyperparameter("betas[0]", beta1, 0.0, 1.0, high_open=high_open)
    check_hyperparameter("betas[1]", beta2, 0.0, 1.0, high_open=high_open)
    return beta1, beta2


def check_hyperparameter(name: str, value: Any, low: float, high: float = math.inf,
                         *, low_open: bool = False, high_open: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a :func:`hyperparameter` in its range
    (a traced tensor, or a subclass of several elements such as a sweep's per-member values, is
    not read)."""
    if is_traced(value) or isinstance(value, Tensor) and value.numel() != 1 and \
            type(value) is not Tensor:
        return
    value = hyperparameter(name, value)
    if isinstance(value, Tensor) and (value.is_complex() or value.is_meta):  # no real value
        raise ValueError(f"invalid {name}: a {value.dtype} tensor on {value.device.type}; "
                         f"pass a real number or a one-element real tensor holding data")
    number = float(value.detach() if isinstance(value, Tensor) else value)
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if math.isnan(number) or too_low or too_high:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"invalid {name}={number!r}: it must lie in {left}{low}, {high}{right}; "
                         f"pass a value in that range")


def is_zero(value: Any) -> bool:
    """Whether ``value`` is the number 0 (a tensor may hold another value later or per member)."""
    return isinstance(value, int | float) and value == 0


def scalar(value: Any) -> Any:
    """A concrete 0-d tensor hyperparameter as a Python float; anything else unchanged."""
    if isinstance(value, Tensor) and value.numel() == 1 and not is_traced(value):
        return float(value.detach().reshape(()).item())
    return value


# -- which path an update takes ---------------------------------------------------------------


def is_traced(value: Any) -> bool:
    """True for a tensor seen through vmap / grad transforms or by a compiler's tracer."""
    if not isinstance(value, Tensor):
        return False
    if torch.compiler.is_compiling() or _torch.forward_ad_active():  # (dual tensors)
        return True
    if type(value) in _PLAIN:  # no subclass, so not fake
        return _torch.is_functorch_wrapped_tensor(value)
    if _torch.is_functorch_wrapped_tensor(value) or isinstance(value, _torch.FakeTensor):
        return True
    try:
        value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return True
    return False


def use_plain_path(tensors: Sequence[Tensor], hyperparameters: Sequence[Any]) -> bool:
    """Whether an update takes per-leaf tensor ops rather than foreach kernels: under a
    compiler or functorch transform, or with grad mode on and a leaf or tensor hyperparameter
    that requires grad (foreach kernels would detach a differentiable lr)."""
    if torch.compiler.is_compiling() or _torch.forward_ad_active() or any(
            is_traced(value) for value in hyperparameters):
        return True
    wrapped = _torch.is_functorch_wrapped_tensor
    for t in tensors:  # is_traced, inlined: an update checks every leaf
        if wrapped(t) if type(t) in _PLAIN else is_traced(t):
            return True
    return torch.is_grad_enabled() and (
        any(t.requires_grad for t in tensors)
        or any(isinstance(v, Tensor) and v.requires_grad for v in hyperparameters))


# -- a state's host scalars -------------------------------------------------------------------


def zero_count() -> Tensor:
    """A state's update count: 0-d int64 on the host."""
    return torch.zeros((), dtype=torch.int64, device="cpu")


def host_tensor(value: Any, dtype: torch.dtype) -> Tensor:
    """``torch.as_tensor(value, dtype=dtype)``: a number on the CPU, a tensor on its device."""
    return torch.as_tensor(value, dtype=dtype,
                           device=value.device if isinstance(value, Tensor) else "cpu")


def f32_tensor(value: Any) -> Tensor:
    """``value`` as a new float32 0-d tensor (on the host unless a tensor elsewhere; a swept
    value, a tensor subclass, as its ops resolve it)."""
    if type(value) in (float, int):
        return host_tensor(value, torch.float32)  # new already
    tensor = value.detach() if isinstance(value, Tensor) else host_tensor(value, torch.float32)
    return tensor.to(torch.float32).clone()


def float32(value: Any) -> Any:
    """``value`` rounded to float32 (a tensor keeps its dtype, a number stays a float), as a
    float32 tensor of torch's state holds it."""
    if isinstance(value, Tensor):
        return value.to(torch.float32).to(value.dtype) if value.is_floating_point() else value
    return array.array("f", (value,))[0]


def updates_done(count: Any) -> int | None:
    """``int(count)``, None where the count is traced; ``ValueError`` for a count that is not a
    one-element real tensor holding a value >= 0 (a state edited by hand)."""
    if not isinstance(count, Tensor) or count.numel() != 1 or count.is_meta or count.is_complex():
        raise ValueError(f"state.count is {count!r}, not a one-element tensor; pass the state "
                         f"returned by opt.init(params) or opt.update")
    if is_traced(count):
        return None
    done = int(count)
    if done < 0:
        raise ValueError(f"state.count is {done}, but a count of updates is >= 0; pass the "
                         f"state returned by opt.init(params) or opt.update")
    return done


def next_step(count: Any) -> Any:
    """The 1-based number of the update after ``count`` updates: an int, or a float64 0-d
    tensor where ``count`` is traced.

    >>> next_step(zero_count() + 3)
    4
    """
    done = updates_done(count)
    return count.to(torch.float64) + 1 if done is None else done + 1


def schedule_count(count: Any) -> Any:
    """What a schedule is called with: the updates done as an int, or the traced ``count``."""
    done = updates_done(count)
    return count if done is None else done
