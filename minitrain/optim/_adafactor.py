"""Adafactor (Shazeer & Stern 2018), as torch.optim.Adafactor computes it: second moments
factored into row and column means for leaves of two or more dims (the last two)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain.optim._checks import Scalar, checked, f32_tensor, is_zero
from minitrain.optim._family import family_optimizer
from minitrain.optim.base import GradientTransformation, Optimizer, ScalarOrSchedule
from minitrain.optim.leafwise import leafwise
from minitrain.optim.transforms import lr_function

__all__ = ["adafactor", "scale_by_adafactor", "ScaleByAdafactorState"]


class ScaleByAdafactorState(NamedTuple):
    """``count``; ``lr`` of the last update (float32); per leaf of two or more dims
    ``row_var`` (shape ``(..., m, 1)``) and ``col_var`` (``(..., 1, n)``), per smaller leaf
    ``variance``; other entries are ``()``."""

    count: Tensor
    lr: Tensor
    row_var: Any
    col_var: Any
    variance: Any


def _buffer_shapes(p: Tensor) -> dict[str, tuple[int, ...] | None]:
    """A leaf's buffers: for two or more dims the means of ``g²`` over the last and over the
    second-to-last dim, ``(..., m, 1)`` and ``(..., 1, n)``, else ``variance``, like ``p``."""
    if p.is_complex():
        raise ValueError("Adafactor does not support complex params; pass real ones (e.g. "
                         "torch.view_as_real)")
    shape = tuple(p.shape)
    if p.dim() > 1:
        return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1]),
                "variance": None}
    return {"row_var": None, "col_var": None, "variance": shape}


def adafactor_leaf(g, buffers, p, step, lr, beta2_decay, eps1, eps2, d, weight_decay):
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
    row_var, col_var, variance = buffers["row_var"], buffers["col_var"], buffers["variance"]
    if g.dim() > 1:
        row_mean = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.size(-1)
        col_mean = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / g.size(-2)
        row_var = torch.lerp(row_var, row_mean, one_minus_beta2)
        col_var = torch.lerp(col_var, col_mean, one_minus_beta2)
        estimate = (row_var @ col_var) / row_var.mean(dim=-2, keepdim=True).clamp(min=eps1)
    else:
        estimate = variance = torch.lerp(variance, g * g, one_minus_beta2)
    scaled = estimate.clamp(min=eps1 * eps1).rsqrt() * g
    clip = torch.clamp(torch.linalg.vector_norm(scaled) / (math.sqrt(scaled.numel()) * d), min=1)
    update = scaled * (-alpha / clip)
    if not is_zero(weight_decay):
        update = update - (lr * weight_decay) * p
    return update, {"row_var": row_var, "col_var": col_var, "variance": variance}


def scale_by_adafactor(lr: ScalarOrSchedule = 1e-2, beta2_decay: Scalar = -0.8,
                       eps: tuple[Any, Any] = (None, 1e-3), d: Scalar = 1.0,
                       weight_decay: Scalar = 0.0) -> GradientTransformation:
    """Adafactor's whole update (``lr`` caps the relative step size and scales the decay).
    optax adafactor's ``momentum`` is ``ema_updates(momentum, debias=False)`` after it (with
    no weight decay).

    >>> state = scale_by_adafactor().init({"w": torch.ones(2, 3), "b": torch.ones(3)})
    >>> [tuple(t.shape) for t in (state.row_var["w"], state.col_var["w"], state.variance["b"])]
    [(2, 1), (1, 3), (3,)]
    """
    lr, lr_at = lr_function(lr)
    beta2_decay = checked("beta2_decay", beta2_decay, -float("inf"), 0.0)
    if not isinstance(eps, tuple | list) or len(eps) != 2:
        raise ValueError(f"invalid eps={eps!r}: pass a pair (eps1 or None, eps2)")
    eps1 = None if eps[0] is None else checked("eps[0] (epsilon1)", eps[0], 0.0)
    eps2 = checked("eps[1] (epsilon2)", eps[1], 0.0)
    d = checked("d (clipping threshold)", d, 1.0)
    weight_decay = checked("weight_decay", weight_decay, 0.0)

    def advance(step, lr):  # the lr of this update, kept in the state as the last one
        now = lr_at(step - 1 if isinstance(step, int) else (step - 1).to(torch.int64))
        return {"lr": f32_tensor(now)}, {"lr": now}

    return leafwise("scale_by_adafactor", None, adafactor_leaf, ScaleByAdafactorState,
                    dict(beta2_decay=beta2_decay, eps1=eps1, eps2=eps2, d=d,
                         weight_decay=weight_decay), needs_params=True, also_watch=(lr,),
                    scalars={"lr": lambda: f32_tensor(lr_at(0))}, advance=advance,
                    buffer_shapes=_buffer_shapes)


def adafactor(lr: ScalarOrSchedule = 1e-2, beta2_decay: Scalar = -0.8,
              eps: tuple[Any, Any] = (None, 1e-3), d: Scalar = 1.0,
              weight_decay: Scalar = 0.0, *, maximize: bool = False) -> Optimizer:
    """torch.optim.Adafactor (Shazeer & Stern 2018): ``scale_by_adafactor``, after ``scale(-1)``
    with ``maximize``. ``eps = (eps1, eps2)`` floor the second moments (None: the dtype's eps)
    and the param's RMS.

    >>> opt, params = adafactor(), {"w": torch.ones(2, 2)}
    >>> params, state = opt.update({"w": torch.ones(2, 2)}, opt.init(params), params)
    >>> params["w"]
    tensor([[0.9900, 0.9900],
            [0.9900, 0.9900]])
    """
    return family_optimizer(scale_by_adafactor(lr, beta2_decay, eps, d, weight_decay),
                            maximize=maximize)
