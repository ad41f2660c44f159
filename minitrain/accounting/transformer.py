"""Transformer napkin math: parameter counts, FLOPs per token and training memory by preset.

Pure Python; no torch. Parameters are counted exactly from the architecture; training FLOPs
per token are ``6·N_matmul + 12·L·d·T`` (PaLM, Chowdhery et al. 2022, appendix B: the matmul
weights, LM head included, plus attention scores and values over a context of ``T`` tokens).

>>> gpt2 = preset("gpt2")
>>> transformer_params(gpt2)          # Hugging Face reports 124,439,808 for "gpt2"
124439808
>>> round(transformer_params(preset("llama3-8b")) / 1e9, 2)
8.03
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from minitrain.accounting.memory import (
    MemoryBreakdown,
    precision,
    training_memory,
    transformer_activation_bytes,
)

__all__ = [
    "PRESETS",
    "TransformerConfig",
    "preset",
    "transformer_flops_per_token",
    "transformer_matmul_params",
    "transformer_memory",
    "transformer_params",
]


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer's shape.

    ``ffn`` is the MLP's hidden width; ``gated_mlp`` (SwiGLU) uses three ``d×ffn`` matrices
    instead of two; ``kv_heads < heads`` is grouped-query attention.
    """

    name: str
    num_layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn: int
    kv_heads: int
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = True
    biases: bool = True
    norm_params: int = 2  # per norm per channel: LayerNorm has weight and bias, RMSNorm weight
    source: str = ""

    def with_(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed (e.g. ``seq_len``)."""
        return replace(self, **changes)


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> TransformerConfig:
    return TransformerConfig(
        name, layers, hidden, heads, vocab=50257, seq_len=1024, ffn=4 * hidden, kv_heads=heads,
        source="Radford et al. 2019, GPT-2 (Hugging Face config)",
    )


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> TransformerConfig:
    return TransformerConfig(
        name, layers, hidden, heads, vocab=128256, seq_len=8192, ffn=ffn, kv_heads=8,
        gated_mlp=True, tied_embeddings=False, learned_positions=False, biases=False,
        norm_params=1, source="Llama 3 Herd of Models (Dubey et al. 2024), table 3",
    )


PRESETS: dict[str, TransformerConfig] = {
    config.name: config
    for config in (
        _gpt2("gpt2", 12, 768, 12),
        _gpt2("gpt2-medium", 24, 1024, 16),
        _gpt2("gpt2-large", 36, 1280, 20),
        _gpt2("gpt2-xl", 48, 1600, 25),
        TransformerConfig(
            "gpt3-175b", 96, 12288, 96, vocab=50257, seq_len=2048, ffn=4 * 12288, kv_heads=96,
            source="Brown et al. 2020, GPT-3, table 2.1",
        ),
        _llama3("llama3-8b", 32, 4096, 32, 14336),
        _llama3("llama3-70b", 80, 8192, 64, 28672),
        _llama3("llama3-405b", 126, 16384, 128, 53248),
    )
}


def preset(name: str) -> TransformerConfig:
    """The preset called ``name`` (see :data:`PRESETS`).

    >>> preset("gpt2-xl").hidden
    1600
    """
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]


def _layer_matmul_params(c: TransformerConfig) -> int:
    kv_width = c.hidden * c.kv_heads // c.heads
    attention = 2 * c.hidden * c.hidden + 2 * c.hidden * kv_width  # q, o and k, v
    mlp = (3 if c.gated_mlp else 2) * c.hidden * c.ffn
    return attention + mlp


def _layer_other_params(c: TransformerConfig) -> int:
    kv_width = c.hidden * c.kv_heads // c.heads
    biases = (2 * c.hidden + 2 * kv_width) + (c.ffn + c.hidden) if c.biases else 0
    return biases + 2 * c.norm_params * c.hidden


def transformer_params(config: TransformerConfig) -> int:
    """Every parameter: embeddings, layers (matrices, biases, norms), final norm, LM head.

    >>> transformer_params(preset("gpt2-xl"))   # Hugging Face "gpt2-xl": 1,557,611,200
    1557611200
    """
    c = config
    embeddings = c.vocab * c.hidden + (c.seq_len * c.hidden if c.learned_positions else 0)
    layers = c.num_layers * (_layer_matmul_params(c) + _layer_other_params(c))
    head = 0 if c.tied_embeddings else c.vocab * c.hidden
    return embeddings + layers + c.norm_params * c.hidden + head


def transformer_matmul_params(config: TransformerConfig) -> int:
    """Parameters that take part in a matmul per token: layer matrices and the LM head.

    Embedding lookups, biases and norms cost no matmul FLOPs (Kaplan et al. 2020, table 1).

    >>> transformer_matmul_params(preset("gpt2"))
    123532032
    """
    c = config
    return c.num_layers * _layer_matmul_params(c) + c.vocab * c.hidden


def transformer_flops_per_token(
    config: TransformerConfig, *, seq_len: int | None = None, training: bool = True
) -> float:
    """FLOPs per token: ``2·N_matmul + 4·L·d·T`` forward, three times that for training.

    The attention term (``QKᵀ`` and ``A·V``, ``2·T·d`` each per token and layer) follows PaLM
    appendix B, counting the full ``T×T`` score matrix as a dense kernel does.

    >>> c = preset("gpt2")
    >>> transformer_flops_per_token(c) == 6 * transformer_matmul_params(c) + 12 * 12 * 768 * 1024
    True
    """
    c = config
    context = c.seq_len if seq_len is None else seq_len
    forward = 2 * transformer_matmul_params(c) + 4 * c.num_layers * c.hidden * context
    return float(3 * forward if training else forward)


def transformer_memory(
    config: TransformerConfig,
    *,
    batch: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    precision_name: str = "bf16-mixed",
    gpus: int = 1,
    zero_stage: int = 0,
    recompute: str = "none",
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
) -> MemoryBreakdown:
    """Bytes per device to train ``config`` with ``batch`` sequences per device.

    Params, grads and optimizer state from :func:`training_memory` (sharded by ZeRO stage over
    ``gpus``, or split by tensor parallelism); activations by Korthikanti et al. 2022.

    >>> m = transformer_memory(preset("gpt2-xl"), batch=1, precision_name="bf16-mixed")
    >>> round(m.params / 1e9, 2), round(m.total / 1e9, 1)
    (3.12, 33.9)
    """
    context = config.seq_len if seq_len is None else seq_len
    activations = transformer_activation_bytes(
        seq_len=context, batch=batch, hidden=config.hidden, heads=config.heads,
        num_layers=config.num_layers, recompute=recompute, tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        bytes_per_element=precision(precision_name).activations,
    )
    return training_memory(
        transformer_params(config) / tensor_parallel, optimizer=optimizer,
        precision=precision_name, activation_bytes=activations, gpus=gpus, zero_stage=zero_stage,
    )
