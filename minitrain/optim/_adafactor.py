"""Adafactor (Shazeer & Stern 2018), as torch.optim.Adafactor computes it: second moments
factored into row and column means for leaves of two or more dims (the last two)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import (
    Scalar,
    check_hyperparameter,
    check_like,
    check_maximize,
    check_state_type,
    checked,
    f32_tensor,
    is_zero,
    next_step,
    schedule_count,
    tensor_leaves,
    zero_count,
)
from minitrain.optim.base import (
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    as_optimizer,
    chain,
    tagged,
)
from minitrain.optim.transforms import scale
from minitrain.tree import Params

__all__ = ["adafactor", "scale_by_adafactor", "ScaleByAdafactorState", "factored_shapes"]


class ScaleByAdafactorState(NamedTuple):
    """``count``; ``lr`` of the last update (float32); per leaf of two or more dims
    ``row_var`` (shape ``(..., m, 1)``) and ``col_var`` (``(..., 1, n)``), per smaller leaf
    ``variance``; other entries are ``()``."""

    count: Tensor
    lr: Tensor
    row_var: Any
    col_var: Any
    variance: Any


FIELDS = ("row_var", "col_var", "variance")


def factored_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The state shapes Adafactor keeps for a param of ``shape``.

    >>> factored_shapes((4, 1024, 512)), factored_shapes((7,))
    ([(4, 1024, 1), (4, 1, 512)], [(7,)])
    """
    if len(shape) > 1:
        return [(*shape[:-1], 1), (*shape[:-2], 1, shape[-1])]
    return [tuple(shape)]


def _buffers_like(values: Any, make: Any) -> list[Any]:
    """Per field, a tree like ``values`` of ``make(leaf, shape)`` for each leaf's buffer, and
    ``()`` where the leaf keeps none (a matrix no ``variance``, a vector no row and column)."""
    spec, leaves = tree.structure(values), tree.leaves(values)
    shapes = [dict(zip(FIELDS, [*factored_shapes(v.shape), None] if v.dim() > 1
                       else [None, None, tuple(v.shape)], strict=True)) for v in leaves]
    return [tree.unflatten(spec, [() if s[field] is None else make(v, s[field])
                                  for v, s in zip(leaves, shapes, strict=True)])
            for field in FIELDS]


def adafactor_leaf(g, row_var, col_var, variance, p, step, lr, beta2_decay, eps1, eps2, d,
                   weight_decay):
    """One leaf's full update, torch's ``_single_tensor_adafactor``:
    ``beta2_t = 1 - t^decay``, ``rho_t = min(lr, 1/sqrt(t))``, ``alpha_t = max(eps2, RMS(p))
    rho_t``; ``V`` from the factored (or plain) running means of ``g²``; ``U = g / max(sqrt(V),
    eps1)`` clipped to RMS ``d``; the update is ``-alpha_t U - lr wd p``."""
    traced = isinstance(step, Tensor)
    if eps1 is None:
        eps1 = torch.finfo(p.dtype).eps
    one_minus_beta2 = step**beta2_decay
    if traced:  # lerp wants its weight in the leaf's dtype (torch rounds a Python one so too)
        one_minus_beta2 = one_minus_beta2.to(p.dtype)
        rho = torch.clamp(1 / step.sqrt(), max=lr)
    elif isinstance(lr, Tensor):  # a tensor lr (vmap's traced one too): no Python comparison
        rho = torch.clamp(lr, max=1 / math.sqrt(step))
    else:
        rho = min(lr, 1 / math.sqrt(step))
    alpha = torch.clamp(torch.linalg.vector_norm(p) / math.sqrt(p.numel()), min=eps2) * rho
    if g.dim() > 1:
        row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.size(-1)
        col_mean = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / g.size(-2)
        row_var = torch.lerp(row_var, row_mean, one_minus_beta2)
        col_var = torch.lerp(col_var, col_mean, one_minus_beta2)
        estimate = (row_var @ col_var) / row_var.mean(dim=-2, keepdim=True).clamp(min=eps1)
    else:
        variance = torch.lerp(variance, g * g, one_minus_beta2)
        estimate = variance
    scaled = estimate.clamp(min=eps1 * eps1).rsqrt() * g
    clip = torch.clamp(torch.linalg.vector_norm(scaled) / (math.sqrt(scaled.numel()) * d), min=1)
    update = scaled * (-alpha / clip)
    if not is_zero(weight_decay):
        update = update - (lr * weight_decay) * p
    return update, row_var, col_var, variance


def scale_by_adafactor(lr: ScalarOrSchedule = 1e-2, beta2_decay: Scalar = -0.8,
                       eps: tuple[Any, Any] = (None, 1e-3), d: Scalar = 1.0,
                       weight_decay: Scalar = 0.0) -> GradientTransformation:
    """Adafactor's whole update (``lr`` caps the relative step size and scales the decay).
    optax adafactor's ``momentum`` is ``ema_updates(momentum, debias=False)`` after it (with
    no weight decay).

    >>> import torch, minitrain as mt
    >>> tx = scale_by_adafactor()
    >>> params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    >>> state = tx.init(params)
    >>> [tuple(t.shape) for t in (state.row_var["w"], state.col_var["w"], state.variance["b"])]
    [(2, 1), (1, 3), (3,)]
    >>> updates, state = tx.update(mt.tree.map(torch.ones_like, params), state, params)
    >>> updates["b"]
    tensor([-0.0100, -0.0100, -0.0100])
    """
    schedule = callable(lr) and not isinstance(lr, Tensor)
    if not schedule:
        lr = checked("lr", lr, 0.0)
    beta2_decay = checked("beta2_decay", beta2_decay, -float("inf"), 0.0)
    if not isinstance(eps, tuple | list) or len(eps) != 2:
        raise ValueError(f"invalid eps={eps!r}: pass a pair (eps1 or None, eps2)")
    eps1 = None if eps[0] is None else checked("eps[0] (epsilon1)", eps[0], 0.0)
    eps2 = checked("eps[1] (epsilon2)", eps[1], 0.0)
    d = checked("d (clipping threshold)", d, 1.0)
    weight_decay = checked("weight_decay", weight_decay, 0.0)

    def lr_at(count: Any) -> Any:
        value = lr(schedule_count(count)) if schedule else lr
        check_hyperparameter("lr (from the schedule)", value, 0.0)
        return value

    def init(params: Params) -> ScaleByAdafactorState:
        tensor_leaves("scale_by_adafactor", params, "param", floating=True)
        for name, leaf in tree.named_leaves(params):
            if leaf.is_complex():
                raise ValueError(f"Adafactor does not support complex params ({name!r}); "
                                 f"pass real ones (e.g. torch.view_as_real)")
        return ScaleByAdafactorState(zero_count(), f32_tensor(lr_at(zero_count())),
                                     *_buffers_like(params, lambda p, shape: p.new_zeros(shape)))

    def update(updates, state, params=None):
        check_state_type("scale_by_adafactor", ScaleByAdafactorState, state)
        if params is None:
            raise ValueError("scale_by_adafactor needs params: call update(updates, state, params)")
        spec = tree.structure(updates)
        g_leaves, p_leaves = tree.leaves(updates), tree.leaves(params)
        buffers = _buffers(state, updates)
        step, step_lr = next_step(state.count), lr_at(state.count)
        rows = [adafactor_leaf(g, *b, p, step, step_lr, beta2_decay, eps1, eps2, d, weight_decay)
                for g, p, *b in zip(g_leaves, p_leaves, *buffers, strict=True)]
        out, *columns = zip(*rows, strict=True) if rows else [()] * 4
        return tree.unflatten(spec, list(out)), ScaleByAdafactorState(
            state.count + 1, f32_tensor(step_lr), *(tree.unflatten(spec, list(c)) for c in columns))

    return tagged("scale_by_adafactor", GradientTransformation(init, update), lr=lr,
                  beta2_decay=beta2_decay, eps=(eps1, eps2), d=d, weight_decay=weight_decay)


def _buffers(state: ScaleByAdafactorState, updates: Any) -> list[list[Any]]:
    """Per field, the state's per-leaf entries laid out like the updates (``()`` included),
    refused naming the first leaf whose buffer does not fit its update (a state from another
    model would otherwise broadcast or fail deep inside the update)."""
    wanted = _buffers_like(updates, lambda g, shape: torch.empty(shape, device="meta"))
    for field, want in zip(FIELDS, wanted, strict=True):
        check_like(getattr(state, field), want, (f"state.{field}", "what these updates need"))
    return [_pytree.tree_flatten(getattr(state, field),
                                 is_leaf=lambda x: isinstance(x, Tensor) or x == ())[0]
            for field in FIELDS]


def adafactor(lr: ScalarOrSchedule = 1e-2, beta2_decay: Scalar = -0.8,
              eps: tuple[Any, Any] = (None, 1e-3), d: Scalar = 1.0,
              weight_decay: Scalar = 0.0, *, maximize: bool = False) -> Optimizer:
    """torch.optim.Adafactor (Shazeer & Stern 2018): ``scale_by_adafactor``, after ``scale(-1)``
    with ``maximize``. ``eps = (eps1, eps2)`` floor the second moments (None: the dtype's eps)
    and the param's RMS.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adafactor()
    >>> params = {"w": torch.ones(2, 2)}
    >>> params, state = opt.update({"w": torch.ones(2, 2)}, opt.init(params), params)
    >>> params["w"]
    tensor([[0.9900, 0.9900],
            [0.9900, 0.9900]])
    """
    return as_optimizer(chain(*([scale(-1.0)] if check_maximize(maximize) else []),
                              scale_by_adafactor(lr, beta2_decay, eps, d, weight_decay)),
                        strict=True)
