"""Pure layers as ``(init, apply)`` pairs: ``p = linear_init(key, 64, 128); y = linear(p, x)``.

Params are plain dicts of tensors named as ``nn.Module`` state dicts name them (``weight``,
``bias``; a block holds ``ln_1``, ``attn.c_attn``, ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``,
``mlp.c_proj`` as nanoGPT's does), with weights in torch's ``(out, in)`` layout, so a module's
``state_dict`` loads as it is. Randomness is explicit: an init takes a key from
:mod:`minitrain.random`, and dropout draws from the key it is given (none: no dropout), so an
apply is a pure function of its arguments under ``grad``, ``vmap`` and ``torch.compile``.

>>> import torch
>>> from minitrain import random
>>> k1, k2 = random.split(random.key(0))
>>> p = linear_init(k1, 64, 128)
>>> y = linear(p, torch.ones(8, 64))
>>> y.shape, dropout(y, 0.1, key=k2).shape
(torch.Size([8, 128]), torch.Size([8, 128]))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minitrain import _torch, random
from minitrain.tree import Params
from minitrain.typecheck import Float, Int, Tensor, typechecked

__all__ = [
    "linear_init", "linear", "embedding_init", "embedding", "layer_norm_init", "layer_norm",
    "rms_norm_init", "rms_norm", "dropout", "attention_init", "attention", "mlp_init", "mlp",
    "block_init", "block",
]

Key = Int[Tensor, "2"]
_IMPLS = ("sdpa", "math")


def _split(key: Key | None, num: int) -> list[Key | None]:
    """``num`` keys from ``key``, or ``num`` Nones: no key, no dropout."""
    return [None] * num if key is None else list(random.split(key, num))


def linear_init(key: Key, in_features: int, out_features: int, bias: bool = True, *,
                std: float | None = None, dtype: torch.dtype = torch.float32) -> Params:
    """``weight (out_features, in_features)`` and ``bias (out_features,)``.

    Default: ``nn.Linear``'s init, both uniform on ``±1/sqrt(in_features)``. With ``std``: a
    ``N(0, std²)`` weight and a zero bias (GPT-2's init).

    >>> p = linear_init(random.key(0), 3, 2)
    >>> p["weight"].shape, p["bias"].shape
    (torch.Size([2, 3]), torch.Size([2]))
    """
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"linear sizes must be positive, got {in_features} -> {out_features}")
    k_weight, k_bias = random.split(key)
    shape = (out_features, in_features)
    if std is None:
        bound = 1 / math.sqrt(in_features)
        params = {"weight": random.uniform(k_weight, shape, dtype, -bound, bound)}
        if bias:
            params["bias"] = random.uniform(k_bias, (out_features,), dtype, -bound, bound)
        return params
    params = {"weight": std * random.normal(k_weight, shape, dtype)}
    if bias:
        params["bias"] = torch.zeros(out_features, dtype=dtype)
    return params


def linear(params: Params, x: Float[Tensor, "*batch in_features"]) -> Float[Tensor, "*batch out"]:
    """``x @ weight.T + bias`` (``F.linear``, ``nn.Linear``'s kernel).

    >>> linear({"weight": torch.ones(2, 3)}, torch.ones(4, 3))[0]
    tensor([3., 3.])
    """
    weight, bias = params["weight"], params.get("bias")
    if _fits(x, weight, bias):  # what _affine's annotations check, in a few attribute reads
        return F.linear(x, weight, bias)
    return _affine(x, weight, bias)  # refuses, naming the mismatched dimension


def _fits(x: object, weight: object, bias: object) -> bool:
    """Whether :func:`_affine`'s annotations hold: floating ``x (*batch, in)``,
    ``weight (out, in)`` and ``bias (out,)`` or None."""
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.is_floating_point() and weight.is_floating_point()
            and x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and (bias is None or (isinstance(bias, torch.Tensor) and bias.is_floating_point()
                                  and bias.dim() == 1 and bias.shape[0] == weight.shape[0])))


@typechecked  # x, weight and bias together, so a mismatch names in_features or out
def _affine(
    x: Float[Tensor, "*batch in_features"], weight: Float[Tensor, "out in_features"],
    bias: Float[Tensor, " out"] | None,
) -> Float[Tensor, "*batch out"]:
    return F.linear(x, weight, bias)


def embedding_init(key: Key, num_embeddings: int, embedding_dim: int, *, std: float = 1.0,
                   dtype: torch.dtype = torch.float32) -> Params:
    """``weight (num_embeddings, embedding_dim)`` from ``N(0, std²)`` (``nn.Embedding``: std 1).

    >>> embedding_init(random.key(0), 10, 4)["weight"].shape
    torch.Size([10, 4])
    """
    return {"weight": std * random.normal(key, (num_embeddings, embedding_dim), dtype)}


@typechecked
def embedding(params: Params, ids: Int[Tensor, "*batch"]) -> Float[Tensor, "*batch dim"]:
    """Row ``ids`` of the table. ``F.embedding``, not indexing: its CPU backward sums in a fixed
    order (indexing's accumulates with atomic adds, so its float sums are not reproducible).

    >>> embedding({"weight": torch.eye(3)}, torch.tensor([2, 0]))
    tensor([[0., 0., 1.],
            [1., 0., 0.]])
    """
    try:
        return F.embedding(ids, params["weight"])
    except IndexError as error:  # torch's words name no numbers (CPU; CUDA asserts on device)
        if torch.compiler.is_compiling() or _torch.is_functorch_wrapped_tensor(ids):
            raise  # the ids' range cannot be read here
        rows = params["weight"].shape[0]
        raise IndexError(f"embedding: token ids must lie in [0, {rows}) for a table of {rows} "
                         f"rows; got ids from {int(ids.min())} to {int(ids.max())} (raise the "
                         f"vocabulary size or map the ids into range)") from error


def layer_norm_init(dim: int, bias: bool = True, dtype: torch.dtype = torch.float32) -> Params:
    """``weight`` ones and (with ``bias``) ``bias`` zeros, as ``nn.LayerNorm(dim, bias=bias)``.

    >>> sorted(layer_norm_init(4))
    ['bias', 'weight']
    """
    params = {"weight": torch.ones(dim, dtype=dtype)}
    if bias:
        params["bias"] = torch.zeros(dim, dtype=dtype)
    return params


@typechecked
def layer_norm(
    params: Params, x: Float[Tensor, "*batch dim"], eps: float = 1e-5
) -> Float[Tensor, "*batch dim"]:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (Ba et al. 2016).

    >>> layer_norm(layer_norm_init(2), torch.tensor([[1.0, 3.0]]))
    tensor([[-1.0000,  1.0000]])
    """
    return F.layer_norm(x, x.shape[-1:], params["weight"], params.get("bias"), eps)


def rms_norm_init(dim: int, dtype: torch.dtype = torch.float32) -> Params:
    """``weight`` ones, as ``nn.RMSNorm(dim)``.

    >>> rms_norm_init(3)
    {'weight': tensor([1., 1., 1.])}
    """
    return {"weight": torch.ones(dim, dtype=dtype)}


@typechecked
def rms_norm(
    params: Params, x: Float[Tensor, "*batch dim"], eps: float | None = None
) -> Float[Tensor, "*batch dim"]:
    """``x / sqrt(mean(x²) + eps) * weight`` (Zhang & Sennrich 2019); ``eps`` None is
    ``torch.finfo(x.dtype).eps``, as ``nn.RMSNorm``.

    >>> rms_norm(rms_norm_init(2), torch.tensor([3.0, 4.0])) * (12.5 ** 0.5)
    tensor([3., 4.])
    """
    return F.rms_norm(x, x.shape[-1:], params["weight"], eps)


@typechecked
def dropout(
    x: Float[Tensor, "*shape"], p: float, key: Key | None = None
) -> Float[Tensor, "*shape"]:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)`` (Srivastava et
    al. 2014, as ``F.dropout``), the mask drawn from ``key``; the identity without a key (eval).

    >>> x = torch.ones(1000)
    >>> y = dropout(x, 0.5, random.key(0))
    >>> bool((dropout(x, 0.5) == x).all()), round(float((y == 0).float().mean()), 1), float(y.max())
    (True, 0.5, 2.0)
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if key is None or p == 0.0:
        return x
    if p == 1.0:
        return torch.zeros_like(x)
    keep = random.uniform(key, tuple(x.shape)) >= p
    return torch.where(keep, x / (1.0 - p), 0.0)


_dropout = dropout  # for the layers whose rate argument is named ``dropout``, as nanoGPT's


def attention_init(key: Key, n_embd: int, bias: bool = True, *, std: float | None = None,
                   proj_std: float | None = None) -> Params:
    """``c_attn`` (query, key and value in one ``n_embd -> 3·n_embd`` linear) and ``c_proj``;
    ``proj_std`` (default ``std``) is the output projection's init std.

    >>> p = attention_init(random.key(0), 8)
    >>> p["c_attn"]["weight"].shape, p["c_proj"]["weight"].shape
    (torch.Size([24, 8]), torch.Size([8, 8]))
    """
    k_attn, k_proj = random.split(key)
    proj_std = std if proj_std is None else proj_std
    return {"c_attn": linear_init(k_attn, n_embd, 3 * n_embd, bias, std=std),
            "c_proj": linear_init(k_proj, n_embd, n_embd, bias, std=proj_std)}


@typechecked
def attention(
    params: Params, x: Float[Tensor, "*batch seq embd"], n_head: int, *, dropout: float = 0.0,
    key: Key | None = None, impl: str = "sdpa",
) -> Float[Tensor, "*batch seq embd"]:
    """Multi-head causal self-attention (Vaswani et al. 2017), nanoGPT's ``CausalSelfAttention``.

    ``impl="sdpa"`` runs ``F.scaled_dot_product_attention``; ``"math"`` writes
    ``softmax(QKᵀ/√d + mask) V`` in plain ops, which every ``torch.func`` transform
    differentiates and batches (the CPU flash kernel has no batching rule nor second
    derivative). With a key and ``dropout > 0`` the weights and the output drop out, drawn from
    ``key`` on the math path (SDPA's own dropout draws from torch's global generator).

    >>> p = attention_init(random.key(0), 8)
    >>> x = torch.randn(2, 5, 8)
    >>> torch.allclose(attention(p, x, 2), attention(p, x, 2, impl="math"), atol=1e-6)
    True
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    n_embd = x.shape[-1]
    if n_embd % n_head:
        raise ValueError(f"embedding size {n_embd} is not divisible by n_head={n_head}")
    k_attn, k_resid = _split(key if dropout > 0 else None, 2)
    q, k, v = linear(params["c_attn"], x).split(n_embd, dim=-1)
    # (..., seq, embd) -> (..., head, seq, head_dim), the view and transpose nanoGPT makes
    q, k, v = (t.unflatten(-1, (n_head, n_embd // n_head)).transpose(-3, -2) for t in (q, k, v))
    if impl == "math" or k_attn is not None:
        y = _math_attention(q, k, v, dropout, k_attn)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = linear(params["c_proj"], y.transpose(-3, -2).reshape(x.shape))
    return _dropout(y, dropout, k_resid)


def _math_attention(q: Tensor, k: Tensor, v: Tensor, p: float, key: Key | None) -> Tensor:
    """``softmax(QKᵀ / sqrt(head_dim) + causal mask) V``, the weights dropped out with ``key``."""
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return _dropout(weights, p, key) @ v


def mlp_init(key: Key, n_embd: int, hidden: int | None = None, bias: bool = True, *,
             std: float | None = None, proj_std: float | None = None) -> Params:
    """``c_fc`` (``n_embd -> hidden``, default ``4·n_embd``) and ``c_proj`` back to ``n_embd``.

    >>> mlp_init(random.key(0), 8, bias=False)["c_fc"]["weight"].shape
    torch.Size([32, 8])
    """
    k_fc, k_proj = random.split(key)
    hidden = 4 * n_embd if hidden is None else hidden
    proj_std = std if proj_std is None else proj_std
    return {"c_fc": linear_init(k_fc, n_embd, hidden, bias, std=std),
            "c_proj": linear_init(k_proj, hidden, n_embd, bias, std=proj_std)}


@typechecked
def mlp(
    params: Params, x: Float[Tensor, "*batch embd"], *, dropout: float = 0.0,
    key: Key | None = None,
) -> Float[Tensor, "*batch embd"]:
    """``c_proj(gelu(c_fc(x)))`` with exact GELU (Hendrycks & Gimpel 2016), then dropout.

    >>> mlp(mlp_init(random.key(0), 4), torch.zeros(3, 4)).shape
    torch.Size([3, 4])
    """
    y = linear(params["c_proj"], F.gelu(linear(params["c_fc"], x)))
    return _dropout(y, dropout, key)


def block_init(key: Key, n_embd: int, bias: bool = True, *, std: float | None = None,
               proj_std: float | None = None) -> Params:
    """A pre-LayerNorm transformer block's params: ``ln_1``, ``attn``, ``ln_2``, ``mlp``.

    >>> sorted(block_init(random.key(0), 8))
    ['attn', 'ln_1', 'ln_2', 'mlp']
    """
    k_attn, k_mlp = random.split(key)
    return {
        "ln_1": layer_norm_init(n_embd, bias),
        "attn": attention_init(k_attn, n_embd, bias, std=std, proj_std=proj_std),
        "ln_2": layer_norm_init(n_embd, bias),
        "mlp": mlp_init(k_mlp, n_embd, bias=bias, std=std, proj_std=proj_std),
    }


@typechecked
def block(
    params: Params, x: Float[Tensor, "*batch seq embd"], n_head: int, *, dropout: float = 0.0,
    key: Key | None = None, impl: str = "sdpa",
) -> Float[Tensor, "*batch seq embd"]:
    """``x + attn(ln_1(x))``, then ``+ mlp(ln_2(·))`` (GPT-2's pre-LN block, nanoGPT's ``Block``).

    >>> block(block_init(random.key(0), 8), torch.randn(2, 5, 8), n_head=2).shape
    torch.Size([2, 5, 8])
    """
    k_attn, k_mlp = _split(key if dropout > 0 else None, 2)
    x = x + attention(params["attn"], layer_norm(params["ln_1"], x), n_head, dropout=dropout,
                      key=k_attn, impl=impl)
    return x + mlp(params["mlp"], layer_norm(params["ln_2"], x), dropout=dropout, key=k_mlp)
