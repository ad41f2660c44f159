"""Precision policies: one vocabulary of precisions for the backends, the CLI and napkin math.

A :class:`Policy` (jmp's) says which format params, math and outputs run in, whether
low-precision params keep a master copy, whether the loss needs scaling (fp16) and which
simulated matmul format, if any, the matmuls run in. :data:`POLICIES` names them; a shipped
backend is called ``<device>-<name>`` (plain ``cpu`` runs ``fp32``, plain ``cuda`` ``bf16``).
:func:`element_bytes` is what a policy costs per element. No torch at import.

>>> import torch
>>> p = policy("bf16")
>>> p.param_dtype, p.compute_dtype, element_bytes(p).activations
(torch.float32, torch.bfloat16, 2)
>>> p.cast_to_compute({"w": torch.ones(2), "step": torch.tensor(3)})
{'w': tensor([1., 1.], dtype=torch.bfloat16), 'step': tensor(3)}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from minitrain.errors import UserError
from minitrain.precision.formats import spec

if TYPE_CHECKING:
    import torch

    from minitrain.tree import PyTree

__all__ = ["POLICIES", "PRECISIONS", "Policy", "Precision", "element_bytes", "policy",
           "without_matmul_format"]


def _dtype(fmt: str) -> torch.dtype:
    import torch

    name = spec(fmt).torch_dtype
    if name is None or not hasattr(torch, name):
        raise ValueError(f"{fmt} is not a torch dtype; params and math take fp32, bf16 or fp16")
    return getattr(torch, name)


class Policy(NamedTuple):
    """What runs in what, by format name: jmp's param, compute and output formats, a master
    copy, loss scaling and a matmul format."""

    param: str = "fp32"  # params, their grads, and the optimizer state without a master copy
    compute: str = "fp32"  # the forward and backward math (autocast where it is not param)
    output: str = "fp32"
    master: str | None = None  # the copy of low-precision params the update runs on
    loss_scaling: bool = False  # fp16: scale the loss so small grads do not flush to zero
    matmul_format: str | None = None  # a simulated matmul recipe: fp8, mxfp8, mxfp4, nvfp4
    name: str = "custom"

    @property
    def param_dtype(self) -> torch.dtype:
        return _dtype(self.param)

    @property
    def compute_dtype(self) -> torch.dtype:
        return _dtype(self.compute)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """The floating-point tensor leaves of ``tree`` in ``compute``; the rest as they are."""
        import torch

        from minitrain.tree import map as tree_map

        def cast(leaf: Any) -> Any:
            floating = isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
            return leaf.to(self.compute_dtype) if floating else leaf

        return tree_map(cast, tree)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy(name="fp32"),
        # the chapter's 3.5.9 recipe, autocast over fp32 params: bf16 has fp32's range
        Policy("fp32", "bf16", name="bf16"),
        Policy("fp32", "fp16", loss_scaling=True, name="fp16"),  # Micikevicius et al. 2018
        Policy(matmul_format="fp8", name="fp8"),  # Transformer Engine: e4m3 fwd, e5m2 bwd
        Policy(matmul_format="mxfp8", name="mxfp8"),
        Policy(matmul_format="mxfp4", name="mxfp4"),
        Policy(matmul_format="nvfp4", name="nvfp4"),
        # bf16 params and grads, fp32 master weights and optimizer state (Micikevicius et al.
        # 2018; the ZeRO paper's 2 + 2 + 12 bytes per param for Adam, Rajbhandari et al. 2020,
        # section 3.1). No shipped backend runs these two; the napkin math counts them.
        Policy("bf16", "bf16", master="fp32", name="bf16-mixed"),
        Policy("bf16", "bf16", "bf16", name="bf16-pure"),  # everything 2 bytes
    )
}

def policy(name: str | Policy) -> Policy:
    """The policy called ``name`` (see :data:`POLICIES`).

    >>> policy("fp16").loss_scaling, policy("fp8").matmul_format
    (True, 'fp8')
    """
    if isinstance(name, Policy):
        return name
    key = name.strip().lower() if isinstance(name, str) else name
    if key in POLICIES:
        return POLICIES[key]
    raise UserError(f"unknown precision {name!r}; choose one of: {', '.join(POLICIES)}")


def without_matmul_format(p: Policy | str) -> Policy:
    """The policy with its matmuls at the compute format, for a forward pass that runs its own
    :func:`minitrain.precision.simulate` (delayed scaling differentiates the history)."""
    return policy(p)._replace(matmul_format=None)


class Precision(NamedTuple):
    """Bytes per element of each kind of tensor a policy trains with (the napkin math's view)."""

    params: int
    grads: int
    optimizer_state: int
    master_weights: int
    activations: int


def element_bytes(p: Policy | str) -> Precision:
    """Bytes per element: params and grads in ``param``, optimizer state in ``master`` (else
    ``param``), activations in ``compute``.

    >>> element_bytes("bf16-mixed")
    Precision(params=2, grads=2, optimizer_state=4, master_weights=4, activations=2)
    """
    p = policy(p)

    def size(fmt: str | None) -> int:
        return 0 if fmt is None else spec(fmt).bits // 8

    state = p.master or p.param
    return Precision(size(p.param), size(p.param), size(state), size(p.master), size(p.compute))


PRECISIONS: dict[str, Precision] = {name: element_bytes(p) for name, p in POLICIES.items()}
