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

import math
from dataclasses import dataclass

from minitrain.accounting.memory import (
    MemoryBreakdown,
    optimizer_key,
    optimizer_state_elements,
    precision,
    training_memory,
)
from minitrain.errors import UserError

__all__ = ["ATTENTION", "PRESETS", "RECOMPUTE", "TransformerConfig", "preset",
           "transformer_activation_bytes", "transformer_activation_terms",
           "transformer_flops_per_token", "transformer_matmul_params", "transformer_memory",
           "transformer_optimizer_state_elements", "transformer_params", "transformer_tensors"]


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer's shape: ``ffn`` the MLP's width, ``gated_mlp`` (SwiGLU) three
    ``d×ffn`` matrices instead of two, ``kv_heads < heads`` grouped-query attention.

    >>> preset("gpt2").hidden, preset("gpt2").ffn
    (768, 3072)
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
    fused_qkv: bool = False  # one d×(q+k+v) matrix (GPT-2's c_attn) instead of three
    source: str = ""


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> TransformerConfig:
    return TransformerConfig(
        name, layers, hidden, heads, vocab=50257, seq_len=1024, ffn=4 * hidden, kv_heads=heads,
        fused_qkv=True, source="Radford et al. 2019, GPT-2 (Hugging Face config)",
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
            fused_qkv=True, source="Brown et al. 2020, GPT-3, table 2.1",
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
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]


def transformer_tensors(config: TransformerConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter tensor's ``(role, shape)``, role ``"hidden"`` (a layer's matrices),
    ``"embedding"``, ``"head"``, ``"bias"`` or ``"norm"``; shapes as Hugging Face keeps them.

    >>> sorted({shape for role, shape in transformer_tensors(preset("gpt2")) if role == "hidden"})
    [(768, 768), (768, 2304), (768, 3072), (3072, 768)]
    """
    c = config
    d, kv = c.hidden, c.hidden * c.kv_heads // c.heads
    tensors = [("embedding", (c.vocab, d))]
    if c.learned_positions:
        tensors.append(("embedding", (c.seq_len, d)))
    attention = [(d, d + 2 * kv)] if c.fused_qkv else [(d, d), (kv, d), (kv, d)]
    mlp = [(c.ffn, d)] * (2 if c.gated_mlp else 1) + [(d, c.ffn)]
    biases = [(d + 2 * kv,), (d,), (c.ffn,), (d,)] if c.biases else []
    norms = [(d,)] * (2 * c.norm_params)
    layer = ([("hidden", shape) for shape in attention + [(d, d)] + mlp]
             + [("bias", shape) for shape in biases] + [("norm", shape) for shape in norms])
    tensors += layer * c.num_layers + [("norm", (d,))] * c.norm_params
    if not c.tied_embeddings:
        tensors.append(("head", (c.vocab, d)))
    return tensors


def transformer_params(config: TransformerConfig) -> int:
    """Every parameter: embeddings, layers (matrices, biases, norms), final norm, LM head.

    >>> transformer_params(preset("gpt2-xl"))   # Hugging Face "gpt2-xl": 1,557,611,200
    1557611200
    """
    return sum(math.prod(shape) for _, shape in transformer_tensors(config))


def transformer_optimizer_state_elements(config: TransformerConfig, optimizer: str = "adamw",
                                         **state_options: bool) -> int:
    """Elements of optimizer state torch.optim keeps for ``config``, tensor by tensor (0-d
    counters aside): Adafactor factored, Muon for the layers' matrices only and AdamW for the
    rest (Jordan et al. 2024; ``torch.optim.Muon``).

    >>> c = preset("gpt2")
    >>> transformer_optimizer_state_elements(c, "adamw") == 2 * transformer_params(c)
    True
    >>> muon = transformer_optimizer_state_elements(c, "muon")   # one state per matrix element
    >>> muon == 2 * transformer_params(c) - (transformer_matmul_params(c) - 50257 * 768)
    True
    """
    key = optimizer_key(optimizer)
    flags = state_options if key != "muon" else {}
    return sum(optimizer_state_elements("adamw" if key == "muon" and role != "hidden" else key,
                                        shape, scalars=False, **flags)
               for role, shape in transformer_tensors(config))


def transformer_matmul_params(config: TransformerConfig) -> int:
    """Parameters in a matmul per token: layer matrices and the LM head (embeddings, biases
    and norms cost no matmul FLOPs; Kaplan et al. 2020, table 1).

    >>> transformer_matmul_params(preset("gpt2"))
    123532032
    """
    tensors = transformer_tensors(config)
    layers = sum(math.prod(shape) for role, shape in tensors if role == "hidden")
    return layers + config.vocab * config.hidden


def transformer_flops_per_token(config: TransformerConfig, *, seq_len: int | None = None) -> float:
    """Training FLOPs per token: three times the forward's ``2·N_matmul + 4·L·d·T``; the
    attention term (``QKᵀ`` and ``A·V``, full ``T×T``) as PaLM's appendix B.

    >>> c = preset("gpt2")
    >>> transformer_flops_per_token(c) == 6 * transformer_matmul_params(c) + 12 * 12 * 768 * 1024
    True
    """
    c = config
    context = c.seq_len if seq_len is None else seq_len
    forward = 2 * transformer_matmul_params(c) + 4 * c.num_layers * c.hidden * context
    return float(3 * forward)


def transformer_memory(
    config: TransformerConfig, *, batch: int, seq_len: int | None = None,
    optimizer: str = "adamw", precision_name: str = "bf16-mixed", gpus: int = 1,
    zero_stage: int = 0, recompute: str = "none", attention: str = "eager",
    **state_options: bool,
) -> MemoryBreakdown:
    """Bytes per device to train ``config`` with ``batch`` sequences per device: params and
    grads by :func:`training_memory` (ZeRO shards), optimizer state tensor by tensor,
    activations by :func:`transformer_activation_bytes`.

    >>> m = transformer_memory(preset("gpt2-xl"), batch=1, precision_name="bf16-mixed")
    >>> round(m.params / 1e9, 2), round(m.total / 1e9, 1)
    (3.12, 33.9)
    """
    recipe = precision(precision_name)
    activations = transformer_activation_bytes(
        seq_len=config.seq_len if seq_len is None else seq_len, batch=batch,
        hidden=config.hidden, heads=config.heads, num_layers=config.num_layers,
        recompute=recompute, bytes_per_element=recipe.activations, attention=attention,
    )
    memory = training_memory(
        transformer_params(config), optimizer=optimizer, precision=precision_name,
        activation_bytes=activations, gpus=gpus, zero_stage=zero_stage, **state_options)
    state = transformer_optimizer_state_elements(config, optimizer, **state_options)
    shards = gpus if zero_stage >= 1 else 1
    return memory._replace(optimizer_state=float(state * recipe.optimizer_state / shards))


ATTENTION = ("eager", "selective", "flash")


def transformer_activation_terms(
    *, seq_len: int, batch: int, hidden: int, heads: int, attention: str = "eager",
    dropout: bool = True, bytes_per_element: int | float = 2, mask_bytes: int | float = 1,
    norm_stats_bytes: int | float = 0,
) -> dict[str, float]:
    """Bytes one transformer layer saves for the backward pass, term by term as Korthikanti et
    al. 2022 (section 4.1) list them: ``s·b·h·(34 + 5·a·s/h)`` at 16-bit (eq. 1).

    ``attention="selective"`` recomputes the ``s²`` terms (eq. 6); ``"flash"`` (Dao et al.
    2022, 3.1) saves the softmax's fp32 log-sum-exp instead (``4·a·s·b``). ``norm_stats_bytes``:
    the mean and rstd ``native_layer_norm`` saves per row (8), which the paper leaves out.

    >>> t = transformer_activation_terms(seq_len=2048, batch=1, hidden=12288, heads=96)
    >>> sum(t.values()) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)     # eq. 1, GPT-3
    True
    """
    if attention not in ATTENTION:
        raise UserError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTION)}")
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden),
                        ("heads", heads), ("bytes_per_element", bytes_per_element)):
        if value <= 0:
            raise UserError(f"{name} must be > 0, got {value}")
    p, sbh, asb = bytes_per_element, seq_len * batch * hidden, heads * seq_len * batch
    s2 = asb * seq_len  # a·s²·b: one score per head, query and key
    mask = mask_bytes if dropout else 0
    eager = attention == "eager"
    terms = {
        "qkv_input": p * sbh,
        "q_and_k": 2 * p * sbh,
        "softmax_output": p * s2 if eager else 0,
        "attention_dropout_mask": mask * s2 if eager else 0,
        "attention_dropout_output": p * s2 if eager and dropout else 0,
        "softmax_logsumexp": 4 * asb if attention == "flash" else 0,
        "v": p * sbh,
        "projection_input": p * sbh,
        "projection_dropout_mask": mask * sbh,
        "mlp_input": p * sbh,
        "gelu_input": 4 * p * sbh,
        "mlp_output_input": 4 * p * sbh,
        "mlp_dropout_mask": mask * sbh,
        "layernorm_inputs": 2 * p * sbh,
        "layernorm_stats": 2 * norm_stats_bytes * seq_len * batch,
    }
    return {name: float(value) for name, value in terms.items()}


RECOMPUTE = ("none", "selective", "full")


def transformer_activation_bytes(
    *, seq_len: int, batch: int, hidden: int, heads: int, num_layers: int,
    recompute: str = "none", bytes_per_element: int = 2, attention: str = "eager",
    mask_bytes: int = 1,
) -> float:
    """Activation bytes of a transformer's layers (Korthikanti et al. 2022, section 4): eq. 1
    per layer (:func:`transformer_activation_terms`); selective recomputation drops the ``s²``
    terms (eq. 6), full recomputation keeps each layer's input, ``2·s·b·h`` (Table 2).

    >>> transformer_activation_bytes(seq_len=2048, batch=1, hidden=12288, heads=96,
    ...                              num_layers=1) / 2**30   # GPT-3, one layer
    2.671875
    """
    if recompute not in RECOMPUTE:
        raise UserError(f"unknown recompute {recompute!r}; choose one of {', '.join(RECOMPUTE)}")
    if num_layers < 1:
        raise UserError(f"num_layers must be >= 1, got {num_layers}")
    kept = "selective" if attention == "eager" and recompute == "selective" else attention
    terms = transformer_activation_terms(
        seq_len=seq_len, batch=batch, hidden=hidden, heads=heads, attention=kept,
        bytes_per_element=bytes_per_element, mask_bytes=mask_bytes,
    )
    if recompute == "full":  # each layer's input
        return float(bytes_per_element * seq_len * batch * hidden * num_layers)
    return sum(terms.values()) * num_layers
