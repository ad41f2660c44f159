"""Models as pure ``(init, apply)`` pairs over plain pytrees of tensors.

``*_init`` functions take an explicit ``torch.Generator`` and return a params pytree; the apply
functions are pure ``(params, x) -> y``. The Cruncher is the chapter's deep linear model (3.5.2):
``num_layers`` D×D layers, then a D→1 head, output ``(batch,)``.

>>> import torch
>>> import minitrain as mt
>>> params = cruncher_init(dim=64, num_layers=2, generator=torch.Generator().manual_seed(0))
>>> [(name, p.numel()) for name, p in mt.tree.named_leaves(params)]
[('layers.0.weight', 4096), ('layers.1.weight', 4096), ('final.weight', 64)]
>>> cruncher(params, torch.randn(8, 64)).shape
torch.Size([8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minitrain import init as initializers
from minitrain.typecheck import Float, Tensor, typechecked

__all__ = ["linear_init", "linear", "cruncher_init", "cruncher", "cruncher_param_count"]

_INITIALIZERS = {
    "xavier": initializers.xavier_normal,
    "truncated": initializers.truncated_normal,
    "normal": initializers.normal,
}


def linear_init(
    in_dim: int, out_dim: int, *, generator: torch.Generator, init: str = "xavier",
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """``{"weight": (in_dim, out_dim)}``, the chapter's ``Linear`` (no bias).

    ``init`` is ``"xavier"`` (``randn / sqrt(in_dim)``, the chapter's default), ``"truncated"``
    or ``"normal"``.

    >>> linear_init(3, 2, generator=torch.Generator().manual_seed(0))["weight"].shape
    torch.Size([3, 2])
    """
    if in_dim <= 0 or out_dim <= 0:
        raise ValueError(f"linear dims must be positive, got in_dim={in_dim}, out_dim={out_dim}")
    if init not in _INITIALIZERS:
        raise ValueError(f"unknown init {init!r}; choose one of {sorted(_INITIALIZERS)}")
    weight = _INITIALIZERS[init]((in_dim, out_dim), generator=generator, dtype=dtype, device=device)
    return {"weight": weight}


def linear(
    params: dict[str, Tensor], x: Float[Tensor, "*batch in_dim"]
) -> Float[Tensor, "*batch out_dim"]:
    """``x @ weight``.

    >>> p = {"weight": torch.ones(3, 2)}
    >>> linear(p, torch.ones(4, 3))
    tensor([[3., 3.],
            [3., 3.],
            [3., 3.],
            [3., 3.]])
    """
    return _matmul(x, params["weight"])


@typechecked  # linear's check: x and the weight together, so a mismatch names in_dim
def _matmul(
    x: Float[Tensor, "*batch in_dim"], weight: Float[Tensor, "in_dim out_dim"]
) -> Float[Tensor, "*batch out_dim"]:
    # F.linear(x, weight.T) is x @ weight through nn.Linear's kernels: on CPU its backward
    # takes faster GEMM layouts (a GPT step's matmuls ~10% faster than with x @ weight).
    return F.linear(x, weight.T)


def cruncher_init(
    dim: int, num_layers: int, *, generator: torch.Generator, init: str = "xavier",
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> dict:
    """Params of the chapter's Cruncher: ``{"layers": [{"weight": D×D}, ...], "final": {...}}``.

    ``num_layers=0`` gives plain linear regression (one ``D×1`` weight).

    >>> p = cruncher_init(dim=16, num_layers=0, generator=torch.Generator().manual_seed(0))
    >>> p["layers"], p["final"]["weight"].shape
    ([], torch.Size([16, 1]))
    """
    if dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    kwargs = dict(generator=generator, init=init, dtype=dtype, device=device)
    return {
        "layers": [linear_init(dim, dim, **kwargs) for _ in range(num_layers)],
        "final": linear_init(dim, 1, **kwargs),
    }


@typechecked
def cruncher(params: dict, x: Float[Tensor, "batch dim"]) -> Float[Tensor, " batch"]:
    """Apply the Cruncher: each D×D layer, then the head, then drop the size-1 axis.

    >>> p = cruncher_init(dim=4, num_layers=1, generator=torch.Generator().manual_seed(0))
    >>> cruncher(p, torch.zeros(5, 4))
    tensor([0., 0., 0., 0., 0.])
    """
    for layer in params["layers"]:
        x = _matmul(x, layer["weight"])
    return _matmul(x, params["final"]["weight"]).squeeze(-1)


def cruncher_param_count(dim: int, num_layers: int) -> int:
    """``D·D·num_layers + D``: the chapter's parameter count (3.5.6).

    >>> cruncher_param_count(64, 2)
    8256
    """
    return dim * dim * num_layers + dim
