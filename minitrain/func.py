"""Function transforms: thin wrappers over ``torch.func`` with JAX's argument order.

>>> import torch
>>> loss = lambda params, x: (params["w"] * x).sum()
>>> value_and_grad(loss)({"w": torch.tensor([2.0])}, torch.tensor([3.0]))
(tensor(6.), {'w': tensor([3.])})
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from minitrain import _torch
from minitrain._torch import pytree
from minitrain.tree import Params

__all__ = [
    "value_and_grad", "grad", "vmap", "from_module", "per_example_grads",
    "saved_tensor_hooks_inside",
]

vmap = torch.func.vmap
"""``torch.func.vmap``, re-exported: ``vmap(f, in_dims=0, out_dims=0, randomness="error")``."""


_INNER_HOOKS: list[tuple[Callable[[Any], Any], Callable[[Any], Any]]] = []


@contextlib.contextmanager
def saved_tensor_hooks_inside(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]
) -> Iterator[None]:
    """Saved-tensor hooks that run inside the functions this module's transforms differentiate.

    ``torch.func.grad`` refuses hooks registered outside it; these are registered inside.

    >>> seen = []
    >>> with saved_tensor_hooks_inside(lambda t: seen.append(t.shape) or t, lambda t: t):
    ...     _ = grad(lambda w: w.exp().sum())(torch.ones(3))
    >>> seen
    [torch.Size([3])]
    """
    pair = (pack, unpack)
    _INNER_HOOKS.append(pair)
    try:
        yield
    finally:
        _INNER_HOOKS.remove(pair)


def _with_saved_tensor_hooks(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with saved-tensor hooks (and activation checkpointing) allowed inside a transform,
    and the :func:`saved_tensor_hooks_inside` hooks entered."""

    @functools.wraps(fn)
    def allowed(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            _torch.saved_tensors_hooks_enable()  # allowed inside a transform
            for pack, unpack in list(_INNER_HOOKS):
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            return fn(*args, **kwargs)

    return allowed


def value_and_grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Return ``f(*args) -> (value, grads)``; with ``has_aux``, ``((value, aux), grads)``.

    Activation checkpointing (``use_reentrant=False``) works inside ``fn``. As ``torch.func``'s,
    the grads stay differentiable through a tensor that requires grad which ``fn`` closes over
    (a hyperparameter learned by hypergradient), except under ``torch.no_grad()``; finding one
    takes a walk of the autograd graph, which a caller under ``no_grad`` (``minitrain run``'s
    steps) skips.

    >>> f = lambda p: ((p["w"] ** 2).sum(), {"w_max": p["w"].max()})
    >>> (v, aux), g = value_and_grad(f, has_aux=True)({"w": torch.tensor([1.0, 2.0])})
    >>> v, aux, g
    (tensor(5.), {'w_max': tensor(2.)}, {'w': tensor([2., 4.])})
    """
    grad_and_value = torch.func.grad_and_value(
        _with_saved_tensor_hooks(fn), argnums=argnums, has_aux=has_aux
    )
    nums = (argnums,) if isinstance(argnums, int) else argnums
    plain_argnums = isinstance(nums, tuple) and nums and all(
        type(n) is int and n >= 0 for n in nums) and len(set(nums)) == len(nums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if plain_argnums and max(nums) < len(args) and not torch.compiler.is_compiling() and \
                _torch.peek_interpreter_stack() is None:
            found = _autograd_value_and_grad(fn, nums, has_aux, args, kwargs)
            if found is not None:
                return found[0], found[1][0] if isinstance(argnums, int) else found[1]
        grads, value = grad_and_value(*args, **kwargs)  # also words the errors
        return value, grads

    return wrapped


def _autograd_value_and_grad(fn: Callable[..., Any], nums: tuple[int, ...], has_aux: bool,
                             args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> tuple[Any, tuple] | None:
    """``torch.func.grad_and_value``'s value and grads (a tuple, one per ``nums``) through plain
    autograd, without functorch's per-op cost (about 6% of a GPT step on CPU); None where that
    would differ: a leaf to differentiate that is no floating tensor or already on a graph (its
    grads must stay differentiable), or an output ``torch.func`` refuses (it words the error).
    Any other tensor that requires grad (closed over, or an argument not differentiated) makes
    the grads differentiable, as ``torch.func`` does."""
    args, wrapped, tensor = list(args), _torch.is_functorch_wrapped_tensor, torch.Tensor
    flat, specs = [], []
    for n in nums:
        leaves, spec = pytree.tree_flatten(args[n])
        if not all(isinstance(t, tensor) and (t.is_floating_point() or t.is_complex())
                   and not t.requires_grad and not wrapped(t) for t in leaves):
            return None
        leaves = [t.detach().requires_grad_() for t in leaves]
        args[n] = pytree.tree_unflatten(leaves, spec)
        flat += leaves
        specs.append((spec, len(leaves)))
    recording = torch.is_grad_enabled()  # else nothing outside can differentiate the grads
    if recording and not _INNER_HOOKS:
        output = fn(*args, **kwargs)
    else:
        with torch.enable_grad():
            output = (_with_saved_tensor_hooks(fn) if _INNER_HOOKS else fn)(*args, **kwargs)
    if has_aux:
        if not (isinstance(output, tuple) and len(output) == 2):
            return None
        output, aux = output
    if not isinstance(output, torch.Tensor) or output.dim() != 0:
        return None
    outer = recording and output.requires_grad and _reaches_other_leaves(output, flat)
    # Detached before the backward pass: the counter names every op after it "update".
    value = output if outer else output.detach()
    if has_aux:
        value = (value, _detached_aux(aux, keep_graph=outer))
    if recording and not outer and output.requires_grad:  # the walk found only flat's leaves:
        torch.autograd.backward(output)  # backward() touches no other, 3% cheaper than grad()
        found = [t.grad for t in flat]
    else:
        found = torch.autograd.grad(output, flat, allow_unused=True, create_graph=outer) \
            if output.requires_grad else [None] * len(flat)
    if any(g is None for g in found):  # (not `None in found`: that compares tensors)
        found = [torch.zeros_like(t) if g is None else g for t, g in zip(flat, found, strict=True)]
    found = iter(found)
    return value, tuple(pytree.tree_unflatten([next(found) for _ in range(size)], spec)
                        for spec, size in specs)


def _reaches_other_leaves(output: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``output``'s autograd graph reaches a leaf other than ``inputs``: a tensor that
    requires grad which the differentiated function closed over (a meta-learned hyperparameter)
    or took as an argument it does not differentiate."""
    own, stack = {id(t) for t in inputs}, [output.grad_fn] if output.grad_fn else []
    seen = set(stack)
    while stack:
        node = stack.pop()
        following = node.next_functions
        if not following:  # a leaf's AccumulateGrad holds it as .variable
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) not in own:
                return True
        for child, _ in following:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


def _detached_aux(aux: Any, keep_graph: bool) -> Any:
    """``aux`` with its tensors detached, refusing what torch.func refuses (non-tensors)."""

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x if keep_graph else x.detach()
        if isinstance(x, tuple):  # namedtuples, as torch.func unwraps them
            return pytree.tree_map(one, tuple(x))
        raise RuntimeError(f"Expected tensors, got unsupported type {type(x)}")

    return pytree.tree_map(one, aux)


def grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """Return ``f(*args) -> grads`` (``(grads, aux)`` with ``has_aux``), as ``jax.grad``.

    >>> grad(lambda w: (w ** 3).sum())(torch.tensor([1.0, 2.0]))
    tensor([ 3., 12.])
    """
    return torch.func.grad(_with_saved_tensor_hooks(fn), argnums=argnums, has_aux=has_aux)


def from_module(
    module: nn.Module, *, with_state: bool = False
) -> tuple[Params, Callable[..., Any]] | tuple[Params, Params, Callable[..., Any]]:
    """Split an ``nn.Module`` into ``(params, apply)`` with ``apply(params, *args, **kwargs)``.

    ``params`` are detached copies; the module is only a template. With ``with_state=True`` the
    buffers are explicit state: ``apply(params, state, *args) -> (out, new_state)``.

    >>> net = torch.nn.Linear(3, 2)
    >>> params, apply = from_module(net)
    >>> sorted(params), apply(params, torch.zeros(4, 3)).shape
    (['bias', 'weight'], torch.Size([4, 2]))
    >>> bn = torch.nn.BatchNorm1d(2)
    >>> params, state, apply = from_module(bn, with_state=True)
    >>> out, new_state = apply(params, state, torch.tensor([[0.0, 1.0], [2.0, 5.0]]))
    >>> state["running_mean"], new_state["running_mean"]   # momentum 0.1 of the batch mean
    (tensor([0., 0.]), tensor([0.1000, 0.3000]))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_module expects a torch.nn.Module, got {type(module).__name__}")
    named = [(name, p.detach().clone(), p.requires_grad) for name, p in module.named_parameters()]
    params = {name: p for name, p, trained in named if trained}
    frozen = {name: p for name, p, trained in named if not trained}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    names = sorted(buffers)

    def apply(params: Params, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, (params, frozen, buffers), args, kwargs)

    def stateful(params: Params, state: Params, *args: Any, **kwargs: Any) -> tuple[Any, Params]:
        if not isinstance(state, dict) or sorted(state) != names:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"state must be the dict of buffers from_module(..., with_state=True) returned "
                f"(keys {names}), got {got}; pass apply(params, state, *inputs)"
            )
        # Copies, made inside any torch.func transform: the forward pass may update them in
        # place (BatchNorm), and they are returned as the new state.
        new_state = {name: t.clone() for name, t in state.items()}
        out = torch.func.functional_call(module, (params, frozen, new_state), args, kwargs)
        return out, new_state

    return (params, buffers, stateful) if with_state else (params, apply)


def per_example_grads(
    loss_fn: Callable[[Params, Any], torch.Tensor], batch_dim: int = 0
) -> Callable[[Params, Any], Params]:
    """Return ``f(params, batch) -> grads`` with a leading batch axis (one ``vmap(grad)``).

    >>> import torch
    >>> loss = lambda p, batch: ((batch[0] @ p["w"] - batch[1]) ** 2).mean()
    >>> x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([1.0, 0.0])
    >>> per_example_grads(loss)({"w": torch.zeros(2)}, (x, y))["w"]  # 2 (x·w - y) x, per row
    tensor([[-2.,  0.],
            [ 0.,  0.]])
    """

    def one_example(params: Params, example: Any) -> Params:
        batch = pytree.tree_map(lambda t: t.unsqueeze(batch_dim), example)
        return torch.func.grad(_with_saved_tensor_hooks(loss_fn))(params, batch)

    return torch.func.vmap(one_example, in_dims=(None, batch_dim))
