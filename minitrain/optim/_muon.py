"""Muon (Jordan et al. 2024), as torch.optim.Muon computes it: momentum, then the update
orthogonalized by a quintic Newton-Schulz iteration in bfloat16, for 2-D params only.

Muon is meant for the hidden weight matrices; embeddings, norms, biases and the output head go
to AdamW, e.g. with ``multi_transform`` (see ``examples/bytelm_muon.py``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.utils._python_dispatch as _python_dispatch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from minitrain import tree
from minitrain.optim._core import (
    EmptyState,
    GradientTransformation,
    as_optimizer,
    chain,
    hyperparameter,
    leafwise,
    tagged,
)
from minitrain.optim._family import Scalar, add_scaled, check_range, descent_prefix, zeros
from minitrain.optim._host import is_batched
from minitrain.optim._muon_vmap import newton_schulz_per_matrix, takes_per_matrix_op
from minitrain.optim._transforms_rules import add_decayed_weights, scale_by_learning_rate
from minitrain.optim.base import Optimizer, ScalarOrSchedule, is_traced, use_plain_path
from minitrain.optim.kernels.checks import donatable
from minitrain.optim.kernels.pool import BufferPool
from minitrain.tree import Params

__all__ = [
    "muon",
    "scale_by_muon",
    "muon_momentum",
    "MuonMomentumState",
    "orthogonalize_by_newton_schulz",
    "newton_schulz",
    "newton_schulz_each",
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


def _number(value: Any) -> Any:
    """A concrete tensor hyperparameter as its float (so it gives the float's bits on every
    path, and a float in the checks' cache keys); one that is traced, or carries a gradient
    under grad mode, unchanged."""
    if isinstance(value, Tensor) and not is_traced(value) \
            and not (value.requires_grad and torch.is_grad_enabled()):
        return float(value.detach().reshape(()).item())
    return value


def muon_momentum_leaf(g, buffers, p, step, momentum, nesterov):
    """torch's ``_single_tensor_muon``: ``B = lerp(B, g, 1 - mu)``; Nesterov uses
    ``lerp(g, B, mu)``, else ``B``."""
    momentum, old = _number(momentum), buffers["momentum_buffer"]
    if not isinstance(momentum, Tensor):  # a number, or a concrete tensor's float
        buf = torch.lerp(old, g, 1 - momentum)
        return (torch.lerp(g, buf, momentum) if nesterov else buf), {"momentum_buffer": buf}
    # traced or differentiable: a tensor weight must have the leaf's dtype (vmap batches it),
    # so lerp in float32 (bfloat16 leaves) as the kernel does with a number weight
    wide = torch.promote_types(old.dtype, torch.float32)
    buf = torch.lerp(old.to(wide), g.to(wide), (1 - momentum).to(wide)).to(old.dtype)
    out = torch.lerp(g.to(wide), buf.to(wide), momentum.to(wide)).to(g.dtype) if nesterov else buf
    return out, {"momentum_buffer": buf}


def muon_momentum(momentum: Scalar = 0.95, nesterov: bool = True) -> GradientTransformation:
    """Muon's momentum (an EMA of the gradients, with Nesterov's look-ahead by default).

    >>> import torch
    >>> tx = muon_momentum(momentum=0.5, nesterov=False)
    >>> tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))[0]
    [tensor([0.5000])]
    """
    momentum = check_range("momentum", momentum, 0.0)
    if isinstance(nesterov, Tensor) and (  # it picks a branch: one value, read now
            is_traced(nesterov) or nesterov.numel() != 1 or nesterov.is_meta):
        raise ValueError("invalid nesterov: a traced tensor, or one without one value, cannot "
                         "pick Nesterov's branch; pass True or False")
    return leafwise("muon_momentum", lambda p: {"momentum_buffer": zeros(p)}, muon_momentum_leaf,
                    MuonMomentumState, dict(momentum=momentum, nesterov=bool(nesterov)))


def newton_schulz(g: Tensor, coefficients: tuple[Scalar, Scalar, Scalar] = NS_COEFFICIENTS,
                  steps: int = NS_STEPS, eps: Scalar = EPS) -> Tensor:
    """An approximate ``U V^T`` of ``g = U S V^T`` by ``steps`` quintic Newton-Schulz steps in
    bfloat16 (torch's ``_zeropower_via_newtonschulz``, the same ops in the same order);
    returned in bfloat16. ``g`` is one matrix ``(m, n)`` or a stack ``(k, m, n)`` of matrices,
    each orthogonalized on its own with ``bmm``/``baddbmm``: ``3 steps`` larger GEMMs instead
    of ``3 k steps`` small ones, which need not round as they do (:func:`newton_schulz_each`
    stacks only where they were checked to). Tensor ``coefficients`` and ``eps`` that are
    traced (``vmap``) or carry a gradient stay in the graph (the coefficients then scale
    float32 products, rounded to bfloat16 once per step as ``addmm`` rounds); concrete ones
    give their floats' bits.

    >>> import torch
    >>> q = newton_schulz(torch.diag(torch.tensor([3.0, 0.5])))
    >>> [round(float(v), 1) for v in torch.diagonal(q)]  # both singular values now near 1
    [0.7, 1.0]
    >>> torch.equal(newton_schulz(torch.stack([2 * torch.eye(2), torch.ones(2, 2)]))[1],
    ...             newton_schulz(torch.ones(2, 2)))
    True
    """
    a, b, c = (_number(v) for v in coefficients)
    eps = _number(eps)
    if takes_per_matrix_op(g, a, b, c, eps):  # each matrix under vmap as in its own run
        return newton_schulz_per_matrix(g, float(a), float(b), float(c), steps, float(eps))
    if isinstance(eps, Tensor):  # clamp reads a number min in the input's dtype: so does this
        eps = eps.to(torch.bfloat16)
    tall = g.size(-2) > g.size(-1)
    x = g.bfloat16().mT if tall else g.bfloat16()
    if x.dim() == 2:
        x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
        matmul, addmatmul = torch.mm, torch.addmm
    else:  # each matrix's own norm, reduced as torch reduces one matrix
        norms = torch.stack([m.norm() for m in x.unbind(0)]).clamp(min=eps)
        # contiguous: oneDNN's batched GEMM of transposed matrices rounds differently
        x = (x / norms[:, None, None]).contiguous()
        matmul, addmatmul = torch.bmm, torch.baddbmm
    batched = is_batched(g)  # here with tensor hyperparameters, which the op cannot take
    if any(isinstance(v, Tensor) for v in (a, b, c)) or batched:
        # addmm takes number beta/alpha, and vmap splits it into a bfloat16 bmm, scale and
        # add, each rounded: bfloat16 products are exact in float32, summed there, rounded once
        def addmatmul(x, m1, m2, beta, alpha=1):
            return (beta * x.float() + alpha * (m1.float() @ m2.float())).bfloat16()
        if batched:  # a bmm may sum in another order than mm
            matmul = lambda m1, m2: (m1.float() @ m2.float()).bfloat16()  # noqa: E731
    for _ in range(steps):
        gram = matmul(x, x.mT)
        x = addmatmul(x, addmatmul(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


# A stack of matrices for one batched Newton-Schulz run holds at most this many bfloat16
# bytes (its products hold about as much again): larger groups run in several stacks.
STACK_BYTES = 32 * 2**20
# Matrices with a side under this run one at a time (see _newton_schulz_stack).
STACK_MIN_SIDE = 32
# Matrices whose sides are all at least this run one at a time with their symmetric products
# in halves (_newton_schulz_halves), where that gives the same bits, instead of stacked.
HALVES_MIN_SIDE = 1024


def same_shape_stacks(matrices: list[Tensor], stack_bytes: int | None = None) -> list[list[int]]:
    """The indices of ``matrices`` grouped by shape, dtype and device, in order of first
    appearance, each group cut into stacks of at most ``stack_bytes`` (default
    :data:`STACK_BYTES`) in bfloat16.

    >>> import torch
    >>> same_shape_stacks([torch.ones(2, 3), torch.ones(3, 3), torch.ones(2, 3)])
    [[0, 2], [1]]
    >>> same_shape_stacks([torch.ones(2, 3)] * 3, stack_bytes=24)
    [[0, 1], [2]]
    """
    stack_bytes = STACK_BYTES if stack_bytes is None else stack_bytes
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((tuple(m.shape), m.dtype, m.device), []).append(i)
    stacks = []
    for (shape, _, _), members in groups.items():
        per_stack = max(1, stack_bytes // max(1, 2 * math.prod(shape)))  # a 0-size matrix too
        stacks += [members[i:i + per_stack] for i in range(0, len(members), per_stack)]
    return stacks


def newton_schulz_each(matrices: list[Tensor], coefficients: tuple[Scalar, Scalar, Scalar]
                       = NS_COEFFICIENTS, steps: int = NS_STEPS, eps: Scalar = EPS) -> list[Tensor]:
    """:func:`newton_schulz` of each matrix, bit for bit, with matrices of one shape stacked
    into batched GEMMs where that gives the same bits (see :func:`_newton_schulz_stack`).

    >>> import torch
    >>> ms = [torch.randn(32, 48), torch.ones(2, 3), torch.randn(32, 48)]
    >>> all(torch.equal(q, newton_schulz(m)) for q, m in zip(newton_schulz_each(ms), ms))
    True
    """
    out: list[Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for stack in same_shape_stacks(matrices):
        together = _newton_schulz_stack([matrices[i] for i in stack], coefficients, steps, eps)
        for i, q in zip(stack, together, strict=True):
            out[i] = q
    return out


def _blas_library() -> str:
    """The CUDA GEMM library torch prefers now (cuBLAS, cuBLASLt, ...): a batched and a
    one-at-a-time run may round alike with one and not with another, so it is in the keys of
    the checks' caches."""
    return str(torch.backends.cuda.preferred_blas_library())


def _can_compare(matrices: list[Tensor]) -> bool:
    """Whether two results can be computed and compared here: real data, no dispatch mode
    that would count (or fake) the check, and no CUDA graph being captured."""
    if _python_dispatch._get_current_dispatch_mode() is not None or any(
        m.device.type == "meta" or isinstance(m, FakeTensor) for m in matrices
    ):
        return False
    return not (matrices[0].is_cuda and torch.cuda.is_current_stream_capturing())


# (shape, dtype, device, stack size, threads, GEMM settings, coefficients, steps, eps) ->
# whether a batched run gives the same bits as one matrix at a time (_stacking_is_exact).
_STACK_IS_EXACT: dict[tuple, bool] = {}
# (shape, dtype, device, threads, GEMM settings, ...) -> whether _newton_schulz_halves gives
# newton_schulz's bits (_halves_are_exact).
_HALVES_ARE_EXACT: dict[tuple, bool] = {}


def _newton_schulz_stack(matrices: list[Tensor], coefficients: tuple[Scalar, Scalar, Scalar],
                         steps: int, eps: Scalar) -> list[Tensor]:
    """:func:`newton_schulz` of each of a list of same-shape matrices, one batched run when
    that is known to round as one at a time does.

    Whether it does depends on the GEMM library's kernels, not on the data: on a CPU with
    oneDNN's bfloat16 GEMMs most shapes give the same bits, but some do not (a side of 17,
    stacks of some sizes, and tiny matrices, where torch's mm and bmm take different
    fallbacks). So the first stack of each shape, size, device, thread count and GEMM setting
    is tried both ways on random matrices of its shape (:func:`_stacking_is_exact`; the
    user's first update may be all zeros, which rounds alike either way), and the batched run
    is used only if the two gave the same bits. Matrices with a side under ``STACK_MIN_SIDE``
    run one at a time (their few outputs, each rounded to bfloat16, can hide a different
    summation order from a check), as do non-contiguous ones, matrices under a functorch
    transform, a compiler or autograd, and matrices without data (fake or meta tensors, as the
    step predictor traces them) or watched by a dispatch mode (the accounting ``Counter``,
    ``FlopCounterMode``; as the optimizers' streaming kernels give way to torch's ops there):
    nothing is then compared, counted twice, or predicted other than it is measured.
    Matrices with both sides at least ``HALVES_MIN_SIDE`` run one at a time with their
    symmetric products in halves instead (:func:`_newton_schulz_halves`; CPU tensors with
    oneDNN's GEMMs), checked the same way (:func:`_halves_are_exact`). Concrete tensor
    ``coefficients`` and ``eps`` are read as floats (the caches' keys); traced ones, or ones
    carrying a gradient, run one matrix at a time.
    """
    coefficients = tuple(_number(v) for v in coefficients)  # type: ignore[assignment]
    eps = _number(eps)

    def alone() -> list[Tensor]:
        return [newton_schulz(m, coefficients, steps, eps) for m in matrices]

    first = matrices[0]
    if min(first.shape) < STACK_MIN_SIDE or torch.compiler.is_compiling() \
            or any(isinstance(v, Tensor) for v in (*coefficients, eps)) \
            or not all(m.is_contiguous() for m in matrices) \
            or any(torch._C._functorch.is_functorch_wrapped_tensor(m) for m in matrices) \
            or (torch.is_grad_enabled() and any(m.requires_grad for m in matrices)) \
            or not _can_compare(matrices):
        return alone()
    settings = (torch.get_num_threads(), torch.backends.mkldnn.enabled,
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                _blas_library() if first.is_cuda else None, tuple(coefficients), steps, eps)
    if min(first.shape) >= HALVES_MIN_SIDE and first.device.type == "cpu" \
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled \
            and all(type(m) in (Tensor, torch.nn.Parameter) for m in matrices):
        key = (tuple(first.shape), first.dtype, first.device, *settings)
        exact = _HALVES_ARE_EXACT.get(key)
        if exact is None:
            exact = _HALVES_ARE_EXACT[key] = _halves_are_exact(first, coefficients, steps, eps)
        if exact:
            return [_newton_schulz_halves(m, coefficients, steps, eps) for m in matrices]
    if len(matrices) == 1:
        return alone()
    key = (tuple(first.shape), first.dtype, first.device, len(matrices), *settings)
    exact = _STACK_IS_EXACT.get(key)
    if exact is None:
        exact = _STACK_IS_EXACT[key] = _stacking_is_exact(first, len(matrices), coefficients,
                                                          steps, eps)
    if not exact:
        return alone()
    return list(newton_schulz(_bf16_stack(matrices), coefficients, steps, eps).unbind(0))


def _newton_schulz_halves(g: Tensor, coefficients: tuple[Scalar, Scalar, Scalar], steps: int,
                          eps: Scalar) -> Tensor:
    """:func:`newton_schulz` of one matrix with the symmetric products in halves: the Gram
    matrix ``X X^T`` and its update ``b G + c G G`` are symmetric, so the rows of ``X`` split
    in two give three of their four blocks (``X1 X1^T``, ``X1 X2^T``, ``X2 X2^T``) and the
    fourth is a transpose. Those two GEMMs of the step's three cost 3/4: a sixth of the step's
    FLOPs saved (measured on a 2-core EPYC, 1024 x 1024: 12% faster; 768: 3%; 512: 10%
    slower, hence :data:`HALVES_MIN_SIDE`). Each element is the same dot product as in the
    whole GEMM; :func:`_halves_are_exact` checks that the kernels sum it alike on two probes."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm().clamp(min=eps)
    h = x.size(0) // 2
    for _ in range(steps):
        x1, x2 = x[:h], x[h:]
        g11, g12, g22 = x1 @ x1.mT, x1 @ x2.mT, x2 @ x2.mT
        g1, g2 = torch.cat([g11, g12], 1), torch.cat([g12.mT, g22], 1)  # the Gram's rows
        u11 = torch.addmm(g11, g1, g1.mT, beta=b, alpha=c)
        u12 = torch.addmm(g12, g1, g2.mT, beta=b, alpha=c)
        u22 = torch.addmm(g22, g2, g2.mT, beta=b, alpha=c)
        update = torch.cat([torch.cat([u11, u12], 1), torch.cat([u12.mT, u22], 1)], 0)
        x = torch.addmm(x, update, x, beta=a)
    return x.mT if tall else x


def _halves_are_exact(like: Tensor, coefficients: tuple[Scalar, Scalar, Scalar], steps: int,
                      eps: Scalar) -> bool:
    """Whether two random matrices shaped like ``like`` get the same bits from
    :func:`_newton_schulz_halves` as from :func:`newton_schulz` (fixed seeds). A check, not a
    proof: the halves are taken only with oneDNN's CPU GEMMs, whose dot products were seen to
    sum alike at every shape of 1024 or more tried (square, tall, wide, 1 to 3 threads, data
    from subnormal to 1e30); torch's fallback GEMMs (oneDNN off) pass a probe at some smaller
    shapes and differ on other data."""
    generator = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e3):
        probe = (torch.randn(like.shape, generator=generator, device="cpu") * scale).to(
            like.device, like.dtype)
        if not torch.equal(_newton_schulz_halves(probe, coefficients, steps, eps),
                           newton_schulz(probe, coefficients, steps, eps)):
            return False
    return True


def _bf16_stack(matrices: list[Tensor]) -> Tensor:
    """``torch.stack([m.bfloat16() for m in matrices])``, cast straight into the stack."""
    first = matrices[0]
    stacked = torch.empty((len(matrices), *first.shape), dtype=torch.bfloat16,
                          device=first.device)
    for row, m in zip(stacked.unbind(0), matrices, strict=True):
        row.copy_(m)
    return stacked


def _stacking_is_exact(like: Tensor, count: int, coefficients: tuple[Scalar, Scalar, Scalar],
                       steps: int, eps: Scalar) -> bool:
    """Whether ``count`` random matrices shaped like ``like`` get the same bits from one
    batched Newton-Schulz run as from one run each (a fixed seed: the same answer every time
    for the same kernels)."""
    generator = torch.Generator().manual_seed(0)
    probe = [torch.randn(like.shape, generator=generator, device="cpu").to(like.device,
                                                                        like.dtype)
             for _ in range(count)]
    together = newton_schulz(_bf16_stack(probe), coefficients, steps, eps).unbind(0)
    return all(torch.equal(newton_schulz(m, coefficients, steps, eps), q)
               for m, q in zip(probe, together, strict=True))


def muon_lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str | None = None) -> float:
    """The factor Muon scales its lr by for an ``(A, B)`` matrix: ``sqrt(max(1, A/B))``
    (``"original"``, Keller Jordan) or ``0.2 sqrt(max(A, B))`` (``"match_rms_adamw"``, Liu
    et al. 2025, "Muon is Scalable for LLM Training").

    >>> muon_lr_ratio((1024, 256)), muon_lr_ratio((256, 1024), "match_rms_adamw")
    (2.0, 6.4)
    """
    rows, cols = shape[:2]
    if adjust_lr_fn is None or isinstance(adjust_lr_fn, str) and adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if isinstance(adjust_lr_fn, str) and adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    shown = repr(adjust_lr_fn) if isinstance(adjust_lr_fn, str) else type(adjust_lr_fn).__name__
    raise ValueError(f"invalid adjust_lr_fn={shown}: choose None, 'original' or 'match_rms_adamw'")


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


def _check_updates(leaves: list[Tensor]) -> None:
    for u in leaves:
        if u.dim() != 2:
            raise ValueError(
                f"Muon updates 2-D params only, got an update of shape {tuple(u.shape)}"
            )


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
        shown = repr(ns_steps) if isinstance(ns_steps, int | float) else type(ns_steps).__name__
        raise ValueError(f"invalid ns_steps={shown}: pass an int in [0, 100)")
    if not isinstance(ns_coefficients, tuple | list) or len(ns_coefficients) != 3:
        shown = (f"{len(ns_coefficients)} values" if isinstance(ns_coefficients, tuple | list)
                 else f"a {type(ns_coefficients).__name__}")
        raise ValueError(
            f"invalid ns_coefficients: {shown}; pass three numbers or 0-d tensors (a, b, c)"
        )
    # 0-d tensors kept (differentiable, vmappable: see newton_schulz), numbers as floats
    checked = [check_range(f"ns_coefficients[{i}]", v, -math.inf)
               for i, v in enumerate(ns_coefficients)] + [check_range("eps", eps, 0.0)]
    a, b, c, eps = (v if isinstance(v, Tensor) else float(v) for v in checked)
    coefficients = (a, b, c)
    muon_lr_ratio((1, 1), adjust_lr_fn)  # reject an unknown adjust_lr_fn now

    def init(params: Params) -> EmptyState:
        _check_matrices(params)
        return EmptyState()

    def update(updates, state, params=None):
        leaves = tree.leaves(updates)
        _check_updates(leaves)
        ortho = newton_schulz_each(leaves, coefficients, ns_steps, eps)
        new = [q.to(u.dtype) * muon_lr_ratio(tuple(u.shape), adjust_lr_fn)
               for q, u in zip(ortho, leaves, strict=True)]
        return tree.unflatten(tree.structure(updates), new), state

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
    if isinstance(lr, Tensor):  # a constant tensor lr, 0-d (a schedule is read per update)
        lr = hyperparameter("lr", lr)
    prefix = descent_prefix(maximize)
    momentum_tx = muon_momentum(momentum, nesterov)
    ortho = orthogonalize_by_newton_schulz(ns_coefficients, ns_steps, eps, adjust_lr_fn)
    lr_tx = scale_by_learning_rate(lr)
    tx = chain(*prefix, chain(momentum_tx, ortho), add_decayed_weights(weight_decay), lr_tx)
    return as_optimizer(tx)


def _in_torch_order(grads, state, params, donate, prefix, momentum_tx, lr_tx, lr, weight_decay,
                    ns):
    """:func:`muon`'s update where its lowering does not run (autograd, ``vmap``, maximize):
    the chain's transformations up to the momentum, then torch's ``p.mul_(1 - lr wd)`` and
    ``p.add_(NS(update), alpha=-lr ratio)`` as out-of-place ops (the chain would fold the decay
    into the update, ``p - lr (ratio NS + wd p)``, which rounds otherwise in bf16/fp16)."""
    n = len(prefix)
    states = list(state)
    u = grads
    for i, t in enumerate(prefix):
        u, states[i] = t.update(u, states[i], params)
    momentum_state, ortho_state = states[n]
    u, momentum_state = momentum_tx.update(u, momentum_state, params)
    states[n] = (momentum_state, ortho_state)
    leaves = tree.leaves(u)
    _check_updates(leaves)
    tree.assert_same_structure(params, u, names=("params", "updates"), check_shapes=True)
    _, states[n + 2] = lr_tx.update([], states[n + 2])
    # a constant lr as given (see _number), a schedule's in float32 as the lowering reads it
    step_lr = lr if isinstance(lr, int | float | Tensor) else states[n + 2].lr
    step_lr, weight_decay = _number(step_lr), _number(weight_decay)
    orthos = newton_schulz_each(leaves, ns["ns_coefficients"], ns["ns_steps"], ns["eps"])
    p_leaves = tree.leaves(params)
    new = []
    for p, q in zip(p_leaves, orthos, strict=True):
        # tensors in float64 for float64 params, as the floats would be
        lr_p, decay_p = (v.to(torch.promote_types(v.dtype, p.dtype)) if isinstance(v, Tensor)
                         else v for v in (step_lr, weight_decay))
        decay = 1 - lr_p * decay_p
        alpha = -lr_p * muon_lr_ratio(tuple(p.shape), ns["adjust_lr_fn"])
        shrunk = p if isinstance(decay, int | float) and decay == 1 else p * decay
        if isinstance(alpha, Tensor):  # a 0-d alpha would keep alpha q in q's bfloat16
            q = q.to(torch.promote_types(p.dtype, q.dtype))
        new.append(add_scaled(shrunk, q, alpha).to(p.dtype))
    if donate and not use_plain_path([*p_leaves, *new], []) \
            and donatable(p_leaves, tree.leaves(states), []):
        with torch.no_grad():
            torch._foreach_copy_(p_leaves, new)
        return params, tuple(states)
    return tree.unflatten(tree.structure(params), new), tuple(states)


# --------------------------------------------------------------------------------------------
# The fast path: torch.optim.Muon's per-leaf ops


def _is_muon_state(state: Any) -> bool:
    """Whether ``state`` is laid out as the init of :func:`_match`'s chain returns it."""
    return (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], tuple)
            and len(state[0]) == 2 and isinstance(state[0][0], MuonMomentumState))


def _muon_stack(ps: list[Tensor], gs: list[Tensor], bufs: list[Tensor], lr: float,
                weight_decay: Any, momentum: dict[str, Any], ns: dict[str, Any],
                pool: BufferPool | None) -> tuple[list[Tensor], list[Tensor]]:
    """torch's ``_single_tensor_muon`` for matrices of one shape: ``B = lerp(B, g, 1 - mu)``,
    the update ``NS(lerp(g, B, mu))`` (one batched Newton-Schulz run for the stack where that
    gives the same bits, see :func:`_newton_schulz_stack`), then
    ``p <- p (1 - lr wd) - lr ratio update`` (the bfloat16 update added without a float32
    copy). Without a ``pool`` (donated), ``p`` and ``B`` are written in place; with one, into
    its recycled buffers. Tensor hyperparameters arrive concrete (read as floats)."""
    mu = _number(momentum["momentum"])  # a concrete tensor: its float's bits
    with torch.no_grad():
        if pool is None:
            bufs = [buf.lerp_(g, 1 - mu) for buf, g in zip(bufs, gs, strict=True)]
        else:
            bufs = [torch.lerp(buf, g, 1 - mu, out=pool.empty_like(buf))
                    for buf, g in zip(bufs, gs, strict=True)]
        updates = ([torch.lerp(g, buf, mu) for g, buf in zip(gs, bufs, strict=True)]
                   if momentum["nesterov"] else bufs)
        orthos = _newton_schulz_stack(updates, ns["ns_coefficients"], ns["ns_steps"],
                                      ns["eps"])
        del updates
        alpha = -lr * muon_lr_ratio(tuple(ps[0].shape), ns["adjust_lr_fn"])
        decay = 1 - lr * weight_decay
        new_params = []
        for p, ortho in zip(ps, orthos, strict=True):
            if pool is not None:
                p = torch.mul(p, decay, out=pool.empty_like(p))
            elif not (isinstance(decay, int | float) and decay == 1):
                p.mul_(decay)
            new_params.append(p.add_(ortho, alpha=alpha))
        return new_params, bufs


