"""Models as pure ``(init, apply)`` pairs over plain pytrees of tensors.

``*_init`` functions take an explicit ``torch.Generator`` and return a params pytree; the apply
functions are pure ``(params, x) -> y``. The Cruncher is the chapter's deep linear model (3.5.2):
``num_layers`` D×D layers, then a D→1 head, output ``(batch,)``. The GPT is nanoGPT's (Karpathy,
``model.py``; GPT-2, Radford et al. 2019) made of :mod:`minitrain.nn` layers, its params named
as nanoGPT's ``state_dict`` names them (less the ``transformer.`` prefix and the tied head), and
takes a :mod:`minitrain.random` key.

>>> import torch
>>> import minitrain as mt
>>> params = cruncher_init(dim=64, num_layers=2, generator=torch.Generator().manual_seed(0))
>>> [(name, p.numel()) for name, p in mt.tree.named_leaves(params)]
[('layers.0.weight', 4096), ('layers.1.weight', 4096), ('final.weight', 64)]
>>> cruncher(params, torch.randn(8, 64)).shape
torch.Size([8])
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from minitrain import init as initializers
from minitrain import nn, random
from minitrain.typecheck import Float, Int, Tensor, typechecked

__all__ = ["linear_init", "linear", "cruncher_init", "cruncher", "cruncher_param_count",
           "GPTConfig", "gpt_init", "gpt"]

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

    >>> linear({"weight": torch.ones(3, 2)}, torch.ones(4, 3))[0]
    tensor([3., 3.])
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


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's ``GPTConfig``, with its defaults (GPT-2 124M; vocabulary padded to 50304).

    ``bias``: biases in the linear layers and LayerNorms (GPT-2 has them; without is a bit
    better and faster, as nanoGPT notes).

    >>> config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
    >>> config.n_embd // config.n_head  # each head's width
    32
    """

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got "
                                 f"{getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def gpt_init(key: Tensor, config: GPTConfig) -> dict:
    """nanoGPT's init: every weight ``N(0, 0.02²)``, the residual projections (``c_proj``)
    ``N(0, (0.02/sqrt(2·n_layer))²)`` (GPT-2 paper, 2.3), biases zero, norms one.

    >>> cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    >>> params = gpt_init(random.key(0), cfg)
    >>> sorted(params), params["h"][0]["attn"]["c_attn"]["weight"].shape
    (['h', 'ln_f', 'wpe', 'wte'], torch.Size([24, 8]))
    """
    k_wte, k_wpe, *k_blocks = random.split(key, 2 + config.n_layer)
    proj_std = 0.02 / math.sqrt(2 * config.n_layer)
    return {
        "wte": nn.embedding_init(k_wte, config.vocab_size, config.n_embd, std=0.02),
        "wpe": nn.embedding_init(k_wpe, config.block_size, config.n_embd, std=0.02),
        "h": [nn.block_init(k, config.n_embd, config.bias, std=0.02, proj_std=proj_std)
              for k in k_blocks],
        "ln_f": nn.layer_norm_init(config.n_embd, config.bias),
    }


@typechecked
def gpt(
    params: dict, ids: Int[Tensor, "batch seq"], key: Tensor | None = None, *,
    config: GPTConfig, impl: str = "sdpa",
) -> Float[Tensor, "batch seq vocab"]:
    """Logits of nanoGPT's GPT for token ``ids``; the head is tied to ``wte``.

    With a ``key`` and ``config.dropout > 0`` it trains (dropout drawn from the key); without a
    key it evaluates. ``impl`` is :func:`minitrain.nn.attention`'s.

    >>> cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    >>> gpt(gpt_init(random.key(0), cfg), torch.zeros(3, 5, dtype=torch.long), config=cfg).shape
    torch.Size([3, 5, 16])
    """
    seq = ids.shape[1]
    if seq > config.block_size:
        raise ValueError(f"sequence of {seq} tokens is longer than block_size={config.block_size}")
    p = config.dropout if key is not None else 0.0
    n_keys = 1 + len(params["h"])
    k_embed, *k_blocks = random.split(key, n_keys) if p > 0 else [None] * n_keys
    positions = torch.arange(seq, device=ids.device)
    x = nn.embedding(params["wte"], ids) + nn.embedding(params["wpe"], positions)
    x = nn.dropout(x, p, k_embed)
    for block, k in zip(params["h"], k_blocks, strict=True):
        x = nn.block(block, x, config.n_head, dropout=p, key=k, impl=impl)
    x = nn.layer_norm(params["ln_f"], x)
    return F.linear(x, params["wte"]["weight"])
