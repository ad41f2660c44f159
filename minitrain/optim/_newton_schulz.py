"""Muon's orthogonalization: the quintic Newton-Schulz iteration in bfloat16 as
torch.optim.Muon runs it, on one matrix, on stacks of same-shape matrices (batched GEMMs, only
where a probe showed they round as one matrix's do) and under ``vmap`` (a custom op whose
batching rule runs each matrix on its own, so a sweep's member gets its own run's bits).
"""

import math
from typing import Any

import torch
from torch import Tensor

from minitrain import _torch
from minitrain.optim._checks import is_traced

__all__ = ["NS_COEFFICIENTS", "NS_STEPS", "EPS", "as_number", "newton_schulz",
           "newton_schulz_each", "same_shape_stacks"]

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
    """An approximate ``U V^T`` of ``g = U S V^T`` (one matrix, or a stack ``(k, m, n)``) by
    ``steps`` quintic Newton-Schulz steps in bfloat16, torch's ``_zeropower_via_newtonschulz``
    op for op. Traced or differentiable tensor ``coefficients`` and ``eps`` stay in the graph.

    >>> import torch
    >>> q = newton_schulz(torch.diag(torch.tensor([3.0, 0.5])))
    >>> [round(float(v), 1) for v in torch.diagonal(q)]  # both singular values now near 1
    [0.7, 1.0]
    >>> torch.equal(newton_schulz(torch.stack([2 * torch.eye(2), torch.ones(2, 2)]))[1],
    ...             newton_schulz(torch.ones(2, 2)))
    True
    """
    a, b, c = (as_number(v) for v in coefficients)
    eps = as_number(eps)
    wrappers = functorch_wrappers(g)
    batched = "batched" in wrappers
    # under vmap with nothing to differentiate (the op has no backward): each matrix as in its
    # own run
    if batched and "grad" not in wrappers and not g.requires_grad \
            and not any(isinstance(v, Tensor) for v in (a, b, c, eps)):
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


# -- under vmap: one matrix at a time ----------------------------------------------------------
# vmap turns an addmm into a batched GEMM, a rounded scale and a rounded add, and a batched
# GEMM may sum in another order than one matrix's; this op's batching rule avoids both.


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
    return torch.stack([newton_schulz_per_matrix(m, a, b, c, steps, eps)
                        for m in matrices]), 0


newton_schulz_per_matrix.register_vmap(_each_matrix)


# -- stacks of same-shape matrices -------------------------------------------------------------

# A stack holds at most this many bfloat16 bytes (its products about as much again): larger
# groups run in several stacks.
STACK_BYTES = 32 * 2**20
# Matrices with a side under this run one at a time: their few outputs, each rounded to
# bfloat16, can hide another summation order from a probe.
STACK_MIN_SIDE = 32
# (shape, dtype, device, stack size, threads, GEMM settings, coefficients, steps, eps) ->
# whether a batched run gives the bits of one matrix at a time (_stacking_is_exact).
_STACK_IS_EXACT: dict[tuple, bool] = {}


def same_shape_stacks(matrices: list[Tensor], stack_bytes: int | None = None) -> list[list[int]]:
    """The indices of ``matrices`` grouped by shape, dtype and device, each group cut into
    stacks of at most ``stack_bytes`` (default :data:`STACK_BYTES`) in bfloat16.

    >>> same_shape_stacks([torch.ones(2, 3), torch.ones(3, 3), torch.ones(2, 3)])
    [[0, 2], [1]]
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


def newton_schulz_each(matrices: list[Tensor], coefficients: Coefficients = NS_COEFFICIENTS,
                       steps: int = NS_STEPS, eps: Any = EPS) -> list[Tensor]:
    """:func:`newton_schulz` of each matrix, bit for bit, the matrices of one shape stacked
    into batched GEMMs where that gives the same bits (:func:`_stacks`)."""
    coefficients = tuple(as_number(v) for v in coefficients)  # type: ignore[assignment]
    eps = as_number(eps)
    out: list[Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for stack in same_shape_stacks(matrices):
        members = [matrices[i] for i in stack]
        if _stacks(members, coefficients, steps, eps):
            together = newton_schulz(_bf16_stack(members), coefficients, steps, eps).unbind(0)
        else:
            together = [newton_schulz(m, coefficients, steps, eps) for m in members]
        for i, q in zip(stack, together, strict=True):
            out[i] = q
    return out


def _stacks(matrices: list[Tensor], coefficients: Coefficients, steps: int, eps: Any) -> bool:
    """Whether these same-shape matrices run as one batched Newton-Schulz run: whether it
    rounds as one matrix at a time does depends on the GEMM kernels, not the data, so the first
    stack of each key is probed both ways on random matrices (:func:`_stacking_is_exact`).
    Never stacked nor probed: tiny or non-contiguous matrices, tensor hyperparameters, a
    functorch transform, a compiler, autograd, a dispatch mode (a probe would be counted), fake
    or meta tensors, CUDA graph capture."""
    first = matrices[0]
    if len(matrices) == 1 or min(first.shape) < STACK_MIN_SIDE \
            or torch.compiler.is_compiling() \
            or any(isinstance(v, Tensor) for v in (*coefficients, eps)) \
            or not all(m.is_contiguous() for m in matrices) \
            or any(_torch.is_functorch_wrapped_tensor(m) for m in matrices) \
            or (torch.is_grad_enabled() and any(m.requires_grad for m in matrices)) \
            or _torch.get_current_dispatch_mode() is not None \
            or any(m.is_meta or isinstance(m, _torch.FakeTensor) for m in matrices) \
            or first.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    key = (tuple(first.shape), first.dtype, first.device, len(matrices),
           torch.get_num_threads(), torch.backends.mkldnn.enabled,
           torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
           _blas_library() if first.is_cuda else None, tuple(coefficients), steps, eps)
    exact = _STACK_IS_EXACT.get(key)
    if exact is None:
        exact = _STACK_IS_EXACT[key] = _stacking_is_exact(first, len(matrices), coefficients,
                                                          steps, eps)
    return exact


def _blas_library() -> str:
    """The CUDA GEMM library torch prefers now (part of the probes' cache keys)."""
    return str(torch.backends.cuda.preferred_blas_library())


def _bf16_stack(matrices: list[Tensor]) -> Tensor:
    return torch.stack([m.bfloat16() for m in matrices])


def _stacking_is_exact(like: Tensor, count: int, coefficients: Coefficients, steps: int,
                       eps: Any) -> bool:
    """Whether ``count`` random matrices like ``like`` (a fixed seed, made on the CPU) get the
    same bits from one batched run as from one run each."""
    generator = torch.Generator().manual_seed(0)
    probe = [torch.randn(like.shape, generator=generator, device="cpu").to(like.device,
                                                                        like.dtype)
             for _ in range(count)]
    together = newton_schulz(_bf16_stack(probe), coefficients, steps, eps).unbind(0)
    return all(torch.equal(newton_schulz(m, coefficients, steps, eps), q)
               for m, q in zip(probe, together, strict=True))
