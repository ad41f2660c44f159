"""Muon (Jordan et al. 2024), as torch.optim.Muon computes it: momentum, then the update
orthogonalized by a quintic Newton-Schulz iteration in bfloat16, for 2-D params only.

Muon is meant for the hidden weight matrices; embeddings, norms, biases and the output head go
to AdamW, e.g. with ``multi_transform`` (see ``examples/bytelm_muon.py``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._buffers import BufferPool
from minitrain.optim._core import (
    EmptyState,
    GradientTransformation,
    as_optimizer,
    chain,
    leafwise,
    register_lowering,
    spec,
    tagged,
)
from minitrain.optim._family import Scalar, check_range, descent_prefix, zeros
from minitrain.optim._lowering import chain_lowering, spec_tensors
from minitrain.optim._transforms_rules import add_decayed_weights, scale_by_learning_rate
from minitrain.optim.base import Optimizer, ScalarOrSchedule, use_plain_path
from minitrain.tree import Params

__all__ = [
    "muon",
    "scale_by_muon",
    "muon_momentum",
    "MuonMomentumState",
    "orthogonalize_by_newton_schulz",
    "newton_schulz",
    "muon_lr_ratio",
]

# Keller Jordan's coefficients and steps (torch.optim._muon, from github.com/KellerJordan/Muon).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


class MuonMomentumState(NamedTuple):
    """``count`` and ``momentum_buffer``, like torch.optim.Muon's state."""

    count: Tensor
    momentum_buffer: Params


def muon_momentum_leaf(g, buffers, p, step, momentum, nesterov):
    """torch's ``_single_tensor_muon``: ``B = lerp(B, g, 1 - mu)``; Nesterov uses
    ``lerp(g, B, mu)``, else ``B``."""
    buf = torch.lerp(buffers["momentum_buffer"], g, 1 - momentum)
    return (torch.lerp(g, buf, momentum) if nesterov else buf), {"momentum_buffer": buf}


def muon_momentum(momentum: Scalar = 0.95, nesterov: bool = True) -> GradientTransformation:
    """Muon's momentum (an EMA of the gradients, with Nesterov's look-ahead by default).

    >>> import torch
    >>> tx = muon_momentum(momentum=0.5, nesterov=False)
    >>> tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))[0]
    [tensor([0.5000])]
    """
    momentum = check_range("momentum", momentum, 0.0)
    return leafwise("muon_momentum", lambda p: {"momentum_buffer": zeros(p)}, muon_momentum_leaf,
                    MuonMomentumState, dict(momentum=momentum, nesterov=bool(nesterov)))


def newton_schulz(g: Tensor, coefficients: tuple[Scalar, Scalar, Scalar] = NS_COEFFICIENTS,
                  steps: int = NS_STEPS, eps: Scalar = EPS) -> Tensor:
    """An approximate ``U V^T`` of ``g = U S V^T`` by ``steps`` quintic Newton-Schulz steps in
    bfloat16 (torch's ``_zeropower_via_newtonschulz``, the same ops in the same order);
    returned in bfloat16.

    >>> import torch
    >>> q = newton_schulz(torch.diag(torch.tensor([3.0, 0.5])))
    >>> [round(float(v), 1) for v in torch.diagonal(q)]  # both singular values now near 1
    [0.7, 1.0]
    """
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str | None = None) -> float:
    """The factor Muon scales its lr by for an ``(A, B)`` matrix: ``sqrt(max(1, A/B))``
    (``"original"``, Keller Jordan) or ``0.2 sqrt(max(A, B))`` (``"match_rms_adamw"``, Liu
    et al. 2025, "Muon is Scalable for LLM Training").

    >>> muon_lr_ratio((1024, 256)), muon_lr_ratio((256, 1024), "match_rms_adamw")
    (2.0, 6.4)
    """
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(
        f"invalid adjust_lr_fn={adjust_lr_fn!r}: choose None, 'original' or 'match_rms_adamw'"
    )


def _check_matrices(params: Params) -> None:
    for name, leaf in tree.named_leaves(params):
        if not isinstance(leaf, Tensor) or leaf.dim() != 2:
            shape = tuple(leaf.shape) if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(
                f"Muon updates 2-D params only, but {name!r} has shape {shape}; route other "
                f"leaves to AdamW with mt.optim.multi_transform"
            )
        if leaf.is_complex():
            raise ValueError(f"Muon does not support complex params ({name!r}); pass real ones")


def orthogonalize_by_newton_schulz(
    ns_coefficients: tuple[Scalar, Scalar, Scalar] = NS_COEFFICIENTS, ns_steps: int = NS_STEPS,
    eps: Scalar = EPS, adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Replace each 2-D update by :func:`newton_schulz` of it, times :func:`muon_lr_ratio`
    (in the update's dtype).

    >>> import torch
    >>> tx = orthogonalize_by_newton_schulz()
    >>> params = [torch.zeros(4, 1)]
    >>> updates, _ = tx.update([torch.ones(4, 1)], tx.init(params), params)
    >>> updates[0].T  # a column of spectral norm ~0.69 (NS), times sqrt(4 / 1)
    tensor([[0.6875, 0.6875, 0.6875, 0.6875]])
    """
    if not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"invalid ns_steps={ns_steps!r}: pass an int in [0, 100)")
    if not isinstance(ns_coefficients, tuple | list) or len(ns_coefficients) != 3:
        raise ValueError(
            f"invalid ns_coefficients={ns_coefficients!r}: pass three numbers (a, b, c)"
        )
    coefficients = tuple(float(v) for v in ns_coefficients)
    eps = float(check_range("eps", eps, 0.0))
    muon_lr_ratio((1, 1), adjust_lr_fn)  # reject an unknown adjust_lr_fn now

    def init(params: Params) -> EmptyState:
        _check_matrices(params)
        return EmptyState()

    def one(u: Tensor) -> Tensor:
        if u.dim() != 2:
            raise ValueError(
                f"Muon updates 2-D params only, got an update of shape {tuple(u.shape)}"
            )
        ratio = muon_lr_ratio(tuple(u.shape), adjust_lr_fn)
        return newton_schulz(u, coefficients, ns_steps, eps).to(u.dtype) * ratio

    def update(updates, state, params=None):
        return tree.map(one, updates), state

    return tagged("orthogonalize_by_newton_schulz", GradientTransformation(init, update),
                  ns_coefficients=coefficients, ns_steps=ns_steps, eps=eps,
                  adjust_lr_fn=adjust_lr_fn)


def scale_by_muon(momentum: Scalar = 0.95, nesterov: bool = True,
                  ns_coefficients: tuple[Scalar, Scalar, Scalar] = NS_COEFFICIENTS,
                  eps: Scalar = EPS, ns_steps: int = NS_STEPS,
                  adjust_lr_fn: str | None = None) -> GradientTransformation:
    """Muon's direction (before weight decay and ``-lr``): momentum, then orthogonalized."""
    return chain(muon_momentum(momentum, nesterov),
                 orthogonalize_by_newton_schulz(ns_coefficients, ns_steps, eps, adjust_lr_fn))


def muon(lr: ScalarOrSchedule = 1e-3, weight_decay: Any = 0.1, momentum: Scalar = 0.95,
         nesterov: bool = True, ns_coefficients: tuple[Scalar, Scalar, Scalar] = NS_COEFFICIENTS,
         eps: Scalar = EPS, ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None,
         *, maximize: bool = False) -> Optimizer:
    """torch.optim.Muon: ``p <- p (1 - lr wd) - lr ratio NS(momentum)``, 2-D params only.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.muon(lr=0.02)
    >>> params = {"w": torch.zeros(3, 3)}
    >>> params, state = opt.update({"w": torch.eye(3)}, opt.init(params), params)
    >>> round(float(params["w"][0, 0]), 3)
    -0.014
    """
    weight_decay = check_range("weight_decay", weight_decay, 0.0)
    return as_optimizer(chain(*descent_prefix(maximize),
                              scale_by_muon(momentum, nesterov, ns_coefficients, eps, ns_steps,
                                            adjust_lr_fn),
                              add_decayed_weights(weight_decay), scale_by_learning_rate(lr)))


# --------------------------------------------------------------------------------------------
# The fast path: torch.optim.Muon's per-leaf ops


def _match(tx: GradientTransformation):
    """The lowered update of ``chain(scale_by_muon(...), add_decayed_weights(wd),
    scale_by_learning_rate(lr))`` (what :func:`muon` builds), or None for another chain."""
    found = chain_lowering(tx, "chain")
    if found is None:
        return None
    parts, before, _, decoupled, weight_decay, mask, lr = found
    inner = parts["chain"]["transforms"]
    inner_specs = [spec(t) for t in inner]
    names = [s[0] if s else None for s in inner_specs]
    if before or mask is not None or not decoupled or names != [
        "muon_momentum", "orthogonalize_by_newton_schulz"
    ]:
        return None
    momentum = inner_specs[0][1]
    ns = inner_specs[1][1]
    lr_tx = spec(tx)[1]["transforms"][-1]
    hyperparameters = spec_tensors(tx)
    pool = BufferPool()  # a pure update's new params and buffers, recycled

    def lowered(grads, state, params, donate):
        p_leaves, g_leaves = tree.leaves(params), tree.leaves(grads)
        if (len(p_leaves) != len(g_leaves) or use_plain_path(
                "auto", [*p_leaves, *g_leaves], hyperparameters)
                or not all(isinstance(t, Tensor) and t.dim() == 2
                           for t in (*p_leaves, *g_leaves))):
            return None
        (momentum_state, ortho_state), decay_state, lr_state = state
        _, new_lr_state = lr_tx.update([], lr_state)  # the lr of this step, and its count
        step_lr = lr if isinstance(lr, int | float) else float(new_lr_state.lr)
        buffers = tree.leaves(momentum_state.momentum_buffer)
        if len(buffers) != len(p_leaves) or any(
            not isinstance(b, Tensor) or b.shape != p.shape or b.dtype != g.dtype
            for b, p, g in zip(buffers, p_leaves, g_leaves, strict=False)
        ):
            return None  # the plain chain names what does not fit
        new_params, new_buffers = [], []
        with pool.lock:
            pool.begin_update()
            for p, g, buf in zip(p_leaves, g_leaves, buffers, strict=True):
                p, buf = _muon_leaf(p, g, buf, step_lr, weight_decay, momentum, ns,
                                    None if donate else pool)
                new_params.append(p)
                new_buffers.append(buf)
        momentum_state = MuonMomentumState(
            momentum_state.count + 1,
            tree.unflatten(tree.structure(momentum_state.momentum_buffer), new_buffers),
        )
        new_state = ((momentum_state, ortho_state), decay_state, new_lr_state)
        return tree.unflatten(tree.structure(params), new_params), new_state

    return lowered


def _muon_leaf(p: Tensor, g: Tensor, buf: Tensor, lr: float, weight_decay: Any,
               momentum: dict[str, Any], ns: dict[str, Any], pool: BufferPool | None):
    """torch's ``_single_tensor_muon`` for one matrix: ``B = lerp(B, g, 1 - mu)``, the update
    ``NS(lerp(g, B, mu))``, then ``p <- p (1 - lr wd) - lr ratio update`` (the bfloat16 update
    added without a float32 copy). Without a ``pool`` (donated), ``p`` and ``B`` are written in
    place; with one, into its recycled buffers."""
    mu = momentum["momentum"]
    with torch.no_grad():
        if pool is None:
            buf = buf.lerp_(g, 1 - mu)
        else:
            buf = torch.lerp(buf, g, 1 - mu, out=pool.empty_like(buf))
        update = torch.lerp(g, buf, mu) if momentum["nesterov"] else buf
        ortho = newton_schulz(update, ns["ns_coefficients"], ns["ns_steps"], ns["eps"])
        alpha = -lr * muon_lr_ratio(tuple(p.shape), ns["adjust_lr_fn"])
        decay = 1 - lr * weight_decay
        if pool is not None:
            p = torch.mul(p, decay, out=pool.empty_like(p))
        elif not (isinstance(decay, int | float) and decay == 1):
            p.mul_(decay)
        return p.add_(ortho, alpha=alpha), buf


register_lowering(_match)
