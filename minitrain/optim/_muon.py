"""Muon (Jordan et al. 2024), as torch.optim.Muon computes it: momentum, then the update
orthogonalized by a quintic Newton-Schulz iteration in bfloat16, for 2-D params only (the rest
go to AdamW with ``multi_transform``, as ``examples/bytelm_muon.py`` does). Under ``vmap`` the
iteration is a custom op whose batching rule runs each matrix on its own, so a sweep's member
gets its own run's bits."""

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain.optim._checks import checked, is_traced
from minitrain.optim.alias import torch_order
from minitrain.optim.base import (
    EmptyState,
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    chain,
    tagged,
)
from minitrain.optim.leafwise import leafwise
from minitrain.optim.transforms import add_decayed_weights
from minitrain.tree import Params

__all__ = ["muon", "scale_by_muon", "muon_momentum", "orthogonalize_by_newton_schulz",
           "newton_schulz"]

Coefficients = tuple[Any, Any, Any]

# Keller Jordan's coefficients and steps (torch.optim._muon, from github.com/KellerJordan/Muon).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def as_number(value: Any) -> Any:
    """A concrete tensor hyperparameter as its float; one that is traced, or carries a gradient
    under grad mode, unchanged."""
    if isinstance(value, Tensor) and not is_traced(value) \
            and not (value.requires_grad and torch.is_grad_enabled()):
        return float(value.detach().reshape(()).item())
    return value


def functorch_wrappers(value: Tensor) -> list[str]:
    """The torch.func wrappers around ``value``, outermost first: ``"batched"`` (``vmap``),
    ``"grad"`` (``grad``, ``jvp``) or ``"other"``."""
    kinds = []
    while _torch.is_functorch_wrapped_tensor(value):
        kinds.append("batched" if _torch.is_batchedtensor(value) else
                     "grad" if _torch.is_gradtrackingtensor(value) else "other")
        value = _torch.get_unwrapped(value)
    return kinds


def newton_schulz(g: Tensor, coefficients: Coefficients = NS_COEFFICIENTS,
                  steps: int = NS_STEPS, eps: Any = EPS) -> Tensor:
    """An approximate ``U V^T`` of a matrix ``g = U S V^T`` by ``steps`` quintic Newton-Schulz
    steps in bfloat16, torch's ``_zeropower_via_newtonschulz`` op for op. Traced or
    differentiable tensor ``coefficients`` and ``eps`` stay in the graph.

    >>> q = newton_schulz(torch.diag(torch.tensor([3.0, 0.5])))
    >>> [round(float(v), 1) for v in torch.diagonal(q)]  # both singular values now near 1
    [0.7, 1.0]
    """
    if g.dim() != 2:
        raise ValueError(f"newton_schulz takes one matrix, got shape {tuple(g.shape)}; "
                         "orthogonalize a stack with torch.func.vmap")
    a, b, c = (as_number(v) for v in coefficients)  # (three: muon checks them; so does unpacking)
    eps = as_number(eps)
    wrappers = functorch_wrappers(g)
    batched = "batched" in wrappers
    # under vmap with nothing to differentiate (the op has no backward): each matrix as its own run
    if batched and "grad" not in wrappers and not g.requires_grad \
            and not any(isinstance(v, Tensor) for v in (a, b, c, eps)):
        return newton_schulz_per_matrix(g, float(a), float(b), float(c), steps, float(eps))
    if isinstance(eps, Tensor):  # clamp reads a number min in the input's dtype: so does this
        eps = eps.to(torch.bfloat16)
    tall = g.size(0) > g.size(1)
    x = g.bfloat16().T if tall else g.bfloat16()
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    matmul, addmatmul = torch.mm, torch.addmm
    if any(isinstance(v, Tensor) for v in (a, b, c)) or batched:
        # addmm takes number beta/alpha, and vmap splits it into a bfloat16 bmm, scale and
        # add, each rounded: bfloat16 products are exact in float32, summed there, rounded once
        def addmatmul(x, m1, m2, beta, alpha=1):
            return (beta * x.float() + alpha * (m1.float() @ m2.float())).bfloat16()
        if batched:  # a bmm may sum in another order than mm
            matmul = lambda m1, m2: (m1.float() @ m2.float()).bfloat16()  # noqa: E731
    for _ in range(steps):
        gram = matmul(x, x.T)
        x = addmatmul(x, addmatmul(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


# -- under vmap: one matrix at a time ----------------------------------------------------------


@torch.library.custom_op("minitrain::newton_schulz", mutates_args=())
def newton_schulz_per_matrix(g: Tensor, a: float, b: float, c: float, steps: int,
                             eps: float) -> Tensor:
    """:func:`newton_schulz` of ``g`` with number coefficients."""
    return newton_schulz(g, (a, b, c), steps, eps)


@newton_schulz_per_matrix.register_fake
def _(g: Tensor, a: float, b: float, c: float, steps: int, eps: float) -> Tensor:
    return torch.empty(g.shape, dtype=torch.bfloat16, device=g.device)


def _each_matrix(info, in_dims, g, a, b, c, steps, eps):
    if in_dims[0] is None:
        return newton_schulz_per_matrix(g, a, b, c, steps, eps), None
    matrices = g.movedim(in_dims[0], 0)
    return torch.stack([newton_schulz_per_matrix(m, a, b, c, steps, eps) for m in matrices]), 0


newton_schulz_per_matrix.register_vmap(_each_matrix)


ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


class MuonMomentumState(NamedTuple):
    """``count`` and ``momentum_buffer``, like torch.optim.Muon's state."""

    count: Tensor
    momentum_buffer: Params


def muon_momentum_leaf(g, buffers, p, step, momentum, nesterov):
    """torch's ``_single_tensor_muon``: ``B = lerp(B, g, 1 - mu)``; Nesterov uses
    ``lerp(g, B, mu)``, else ``B``."""
    momentum, old = as_number(momentum), buffers["momentum_buffer"]
    if not isinstance(momentum, Tensor):  # a number, or a concrete tensor's float
        buf = torch.lerp(old, g, 1 - momentum)
        return (torch.lerp(g, buf, momentum) if nesterov else buf), {"momentum_buffer": buf}
    # traced or differentiable: a tensor weight must have the leaf's dtype (vmap batches it),
    # so lerp in float32 (bfloat16 leaves) as the kernel does with a number weight
    wide = torch.promote_types(old.dtype, torch.float32)
    buf = torch.lerp(old.to(wide), g.to(wide), (1 - momentum).to(wide)).to(old.dtype)
    out = torch.lerp(g.to(wide), buf.to(wide), momentum.to(wide)).to(g.dtype) if nesterov else buf
    return out, {"momentum_buffer": buf}


def muon_momentum(momentum: Any = 0.95, nesterov: bool = True) -> GradientTransformation:
    """Muon's momentum (an EMA of the gradients, with Nesterov's look-ahead by default).

    >>> tx = muon_momentum(momentum=0.5, nesterov=False)
    >>> tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))[0]
    [tensor([0.5000])]
    """
    momentum = checked("momentum", momentum, 0.0)
    if isinstance(nesterov, Tensor) and (  # it picks a branch: one value, read now
            is_traced(nesterov) or nesterov.numel() != 1 or nesterov.is_meta):
        raise ValueError("invalid nesterov: a traced tensor, or one without one value, cannot "
                         "pick Nesterov's branch; pass True or False")
    return leafwise("muon_momentum", None, muon_momentum_leaf, MuonMomentumState,
                    dict(momentum=momentum, nesterov=bool(nesterov)))


def muon_lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str | None = None) -> float:
    """The factor Muon scales its lr by for an ``(A, B)`` matrix (torch's ``_adjust_lr``):
    ``sqrt(max(1, A/B))`` (``"original"``, the default: Keller Jordan), ``0.2 sqrt(max(A, B))``
    (``"match_rms_adamw"``: Liu et al. 2025) or ``sqrt(A/B)`` (``"spectral_unclamped"``:
    Bernstein, "Deriving Muon").

    >>> muon_lr_ratio((1024, 256)), muon_lr_ratio((256, 1024), "match_rms_adamw")
    (2.0, 6.4)
    """
    if not (adjust_lr_fn is None or isinstance(adjust_lr_fn, str)
            and adjust_lr_fn in ADJUST_LR_FNS):
        shown = repr(adjust_lr_fn) if isinstance(adjust_lr_fn, str) else type(adjust_lr_fn).__name__
        raise ValueError(f"invalid adjust_lr_fn={shown}: choose None, 'original', "
                         f"'match_rms_adamw' or 'spectral_unclamped'")
    rows, cols = shape[0], max(shape[1], 1)  # a 0-column matrix has no update to scale
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(rows / cols)
    return math.sqrt(max(1, rows / cols))


def _check_matrices(values: Any, what: str) -> list[Tensor]:
    """The leaves of ``values``, each a real 2-D tensor, else a ``ValueError`` naming it."""
    for name, leaf in tree.named_leaves(values):
        if not isinstance(leaf, Tensor) or leaf.dim() != 2:
            shape = tuple(leaf.shape) if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(f"Muon updates 2-D params only, but {what} {name!r} has shape "
                             f"{shape}; route other leaves to AdamW with mt.optim.multi_transform")
        if leaf.is_complex():
            raise ValueError(f"Muon does not support complex {what}s ({name!r}); pass real ones")
    return tree.leaves(values)


def _check_ns_arguments(ns_coefficients: Any, ns_steps: Any, eps: Any) -> tuple[Coefficients, Any]:
    """The coefficients and eps as the iteration takes them: numbers as floats, 0-d tensors kept."""
    if not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        shown = repr(ns_steps) if isinstance(ns_steps, int | float) else type(ns_steps).__name__
        raise ValueError(f"invalid ns_steps={shown}: pass an int in [0, 100)")
    if not isinstance(ns_coefficients, tuple | list) or len(ns_coefficients) != 3:
        shown = (f"{len(ns_coefficients)} values" if isinstance(ns_coefficients, tuple | list)
                 else f"a {type(ns_coefficients).__name__}")
        raise ValueError(f"invalid ns_coefficients: {shown}; pass three numbers or 0-d tensors "
                         f"(a, b, c)")
    values = [checked(f"ns_coefficients[{i}]", v, -math.inf)
              for i, v in enumerate(ns_coefficients)] + [checked("eps", eps, 0.0)]
    a, b, c, eps = (v if isinstance(v, Tensor) else float(v) for v in values)
    return (a, b, c), eps


def orthogonalize_by_newton_schulz(
    ns_coefficients: Coefficients = NS_COEFFICIENTS, ns_steps: int = NS_STEPS,
    eps: Any = EPS, adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Replace each 2-D update by :func:`newton_schulz` of it, times :func:`muon_lr_ratio`
    (in the update's dtype).

    >>> tx = orthogonalize_by_newton_schulz()
    >>> params = [torch.zeros(4, 1)]
    >>> updates, _ = tx.update([torch.ones(4, 1)], tx.init(params), params)
    >>> updates[0].T  # a column of spectral norm ~0.69 (NS), times sqrt(4 / 1)
    tensor([[0.6875, 0.6875, 0.6875, 0.6875]])
    """
    coefficients, eps = _check_ns_arguments(ns_coefficients, ns_steps, eps)
    muon_lr_ratio((1, 1), adjust_lr_fn)  # refuse an unknown adjust_lr_fn now

    def init(params: Params) -> EmptyState:
        _check_matrices(params, "param")
        return EmptyState()

    def update(updates, state, params=None):
        leaves = _check_matrices(updates, "update")
        new = []
        for u in leaves:
            q = newton_schulz(u, coefficients, ns_steps, eps).to(u.dtype)
            ratio = muon_lr_ratio(tuple(u.shape), adjust_lr_fn)
            new.append(q if ratio == 1 else q * ratio)
        return tree.unflatten(tree.structure(updates), new), state

    return tagged("orthogonalize_by_newton_schulz", GradientTransformation(init, update),
                  ns_coefficients=coefficients, ns_steps=ns_steps, eps=eps,
                  adjust_lr_fn=adjust_lr_fn)


def scale_by_muon(momentum: Any = 0.95, nesterov: bool = True,
                  ns_coefficients: Coefficients = NS_COEFFICIENTS,
                  eps: Any = EPS, ns_steps: int = NS_STEPS,
                  adjust_lr_fn: str | None = None) -> GradientTransformation:
    """Muon's direction (before weight decay and ``-lr``): momentum, then orthogonalized.

    >>> tx, params = scale_by_muon(), {"w": torch.eye(3)}
    >>> updates, state = tx.update({"w": torch.randn(3, 3)}, tx.init(params), params)
    >>> updates["w"].shape
    torch.Size([3, 3])
    """
    return chain(muon_momentum(momentum, nesterov),
                 orthogonalize_by_newton_schulz(ns_coefficients, ns_steps, eps, adjust_lr_fn))


def muon(lr: ScalarOrSchedule = 1e-3, weight_decay: Any = 0.1, momentum: Any = 0.95,
         nesterov: bool = True, ns_coefficients: Coefficients = NS_COEFFICIENTS,
         eps: Any = EPS, ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None,
         *, maximize: bool = False) -> Optimizer:
    """torch.optim.Muon, ``p <- p - lr (ratio NS(momentum(g)) + wd p)`` for 2-D params: the
    chain ``scale_by_muon``, ``add_decayed_weights(weight_decay)``, ``scale_by_learning_rate``.
    The buffers and direction carry torch's bits; the params agree with it to rounding.

    >>> opt, params = muon(lr=0.02), {"w": torch.zeros(3, 3)}
    >>> params, state = opt.update({"w": torch.eye(3)}, opt.init(params), params)
    >>> round(float(params["w"][0, 0]), 3)
    -0.014
    """
    return torch_order(
        [scale_by_muon(momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)], lr,
        maximize=maximize, decoupled=True,
        decay=add_decayed_weights(checked("weight_decay", weight_decay, 0.0)))
