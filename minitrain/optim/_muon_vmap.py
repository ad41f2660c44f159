"""Newton-Schulz under ``vmap``, one matrix at a time, so that each member of a sweep rounds
its bfloat16 products as its own run does.

Under ``vmap`` an ``addmm`` becomes a batched GEMM, a rounded scale and a rounded add, and a
batched GEMM may sum in another order than one matrix's: 1-30% of an update apart after five
steps. The custom op below has a batching rule that runs the single-matrix iteration on each
matrix of the batch (``torch.library.register_vmap``), so a vmapped Muon update is bit for bit
the member's own.
"""


import torch
from torch import Tensor

from minitrain.optim._host import functorch_wrappers

__all__ = ["newton_schulz_per_matrix", "takes_per_matrix_op"]


@torch.library.custom_op("minitrain::newton_schulz", mutates_args=())
def newton_schulz_per_matrix(g: Tensor, a: float, b: float, c: float, steps: int,
                             eps: float) -> Tensor:
    """:func:`minitrain.optim._muon.newton_schulz` of ``g`` with number coefficients."""
    from minitrain.optim._muon import newton_schulz  # imports this module: import it late

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


_HAS_VMAP_RULES = hasattr(torch.library, "register_vmap")  # torch >= 2.5
if _HAS_VMAP_RULES:
    newton_schulz_per_matrix.register_vmap(_each_matrix)


def takes_per_matrix_op(g: Tensor, *hyperparameters: object) -> bool:
    """Whether ``g`` is batched by ``vmap`` with nothing to differentiate: no autograd history
    or ``grad`` transform on it, and number hyperparameters (the op has no backward)."""
    if not _HAS_VMAP_RULES or g.requires_grad or any(
            isinstance(v, Tensor) for v in hyperparameters):
        return False
    wrappers = functorch_wrappers(g)
    return "batched" in wrappers and "grad" not in wrappers
