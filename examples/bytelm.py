"""A byte-level GPT on Python's own standard library, trained with AdamW.

Every Python install ships its standard library as ``.py`` source, about 30 MB of text. The
first run writes its bytes into uint16 token memmaps (``minitrain prepare`` does the same) and
holds out ~5% of the files; then a small pre-LayerNorm transformer (Radford et al. 2019, GPT-2)
learns to predict the next byte. Params are a plain pytree; the forward pass is a pure function.
Loss is reported in bits per byte (cross-entropy in nats / ln 2): 8 bits is a uniform guess over
256 bytes; the default run gets well under 3 bits in a couple of minutes on 2 CPU cores.

    minitrain run examples/bytelm.py --out runs/bytelm            # train, log, summarize
    minitrain run examples/bytelm.py --set d_model=256 --set n_layers=4 --steps 5000
    minitrain plot runs/bytelm                                    # runs/bytelm/loss.png
"""

import math

import torch
import torch.nn.functional as F
from einops import rearrange

import minitrain as mt
from minitrain.data import ensure_prepared, get_batch, load_prepared

CONFIG = {
    "d_model": 128,
    "n_layers": 2,
    "n_heads": 4,
    "seq_len": 128,  # bytes of context
    "batch_size": 16,
    "lr": 3e-3,
    "warmup_steps": 30,
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
    "steps": 600,
    "eval_batches": 8,  # held-out batches per evaluation (fixed, the same every time)
    "eval_every": 100,
    "data_dir": "",  # prepared data; "" = the minitrain cache (~/.cache/minitrain/...)
    "source_dir": "",  # .py files to prepare from; "" = the standard library
}
# With data_dir alone the corpus must already be there (minitrain prepare --out DIR); with
# source_dir too it is prepared on first use. A corpus that fails its checks is an error naming
# the file, never rebuilt from another source.

VOCAB = 256  # one token per byte value
LN2 = math.log(2.0)


def init_params(config: dict, generator: torch.Generator) -> dict:
    """GPT-2's layout and init: N(0, 0.02) embeddings, residual projections scaled 1/sqrt(2L)."""
    d, layers = config["d_model"], config["n_layers"]

    def linear(d_in: int, d_out: int, scale: float = 1.0) -> dict:
        weight = mt.init.normal((d_in, d_out), generator=generator, std=0.02 * scale)
        return {"weight": weight}

    def norm() -> dict:
        return {"weight": torch.ones(d), "bias": torch.zeros(d)}

    residual = 1 / math.sqrt(2 * layers)  # GPT-2: keep the residual stream's variance flat
    return {
        "embed": mt.init.normal((VOCAB, d), generator=generator, std=0.02),  # tied with the head
        "pos": mt.init.normal((config["seq_len"], d), generator=generator, std=0.01),
        "blocks": [
            {
                "ln1": norm(),
                "attn": {"qkv": linear(d, 3 * d), "out": linear(d, d, residual)},
                "ln2": norm(),
                "mlp": {"fc": linear(d, 4 * d), "proj": linear(4 * d, d, residual)},
            }
            for _ in range(layers)
        ],
        "ln_f": norm(),
    }


def layer_norm(params: dict, h: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(h, h.shape[-1:], params["weight"], params["bias"])


def attention(params: dict, h: torch.Tensor, n_heads: int) -> torch.Tensor:
    qkv = mt.models.linear(params["qkv"], h)
    q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=n_heads)
    mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return mt.models.linear(params["out"], rearrange(mixed, "b h t d -> b t (h d)"))


def mlp(params: dict, h: torch.Tensor) -> torch.Tensor:
    return mt.models.linear(params["proj"], F.gelu(mt.models.linear(params["fc"], h)))


def forward(params: dict, x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Logits ``(batch, seq, 256)`` for byte ids ``x`` of shape ``(batch, seq)``."""
    # F.embedding, not params["embed"][x]: the backward of tensor indexing on CPU accumulates
    # with atomic adds across threads, so its float sums (and a resumed run) would not be
    # bit-reproducible; embedding's backward sums in a fixed order.
    h = F.embedding(x, params["embed"]) + params["pos"][: x.shape[1]]
    for block in params["blocks"]:
        h = h + attention(block["attn"], layer_norm(block["ln1"], h), n_heads)
        h = h + mlp(block["mlp"], layer_norm(block["ln2"], h))
    return layer_norm(params["ln_f"], h) @ params["embed"].T


def flops_per_step(config: dict) -> int:
    """Matmul FLOPs of one training step: 3 x forward (backward = 2 x forward).

    Per token and layer the forward does 2·12·d² in the QKV, output and MLP matmuls and 2·2·T·d
    in ``QKᵀ`` and ``AV`` (computed in full, as PaLM Appendix B's 6N + 12·L·d·T counts them);
    the tied head adds 2·d·256. Embedding lookups, norms and softmax are not matmuls.
    """
    d, layers, seq = config["d_model"], config["n_layers"], config["seq_len"]
    forward_per_token = layers * (24 * d * d + 4 * seq * d) + 2 * d * VOCAB
    return 3 * config["batch_size"] * seq * forward_per_token


def load_data(data_dir: str, source_dir: str) -> mt.data.PreparedData:
    """The prepared corpus: a given ``data_dir`` alone is only read (never built from the
    standard library in its place); with ``source_dir`` it is prepared from there on first
    use; neither: the standard library corpus in the minitrain cache."""
    if data_dir and not source_dir:
        return load_prepared(data_dir)
    return ensure_prepared(data_dir or None, source_dir or None)


def experiment(config: dict) -> mt.Experiment:
    if config["d_model"] % config["n_heads"]:
        raise ValueError(
            f"d_model={config['d_model']} must be divisible by n_heads={config['n_heads']}"
        )
    data = load_data(config["data_dir"], config["source_dir"])
    batch_size, seq_len, n_heads = config["batch_size"], config["seq_len"], config["n_heads"]

    def loss(params: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        x, y = batch
        nats = mt.losses.cross_entropy(forward(params, x, n_heads), y)
        return nats, {"bpb": nats / LN2}

    eval_generator = torch.Generator().manual_seed(1234)
    eval_set = [
        get_batch(data.val, batch_size, seq_len, eval_generator)
        for _ in range(config["eval_batches"])
    ]

    @torch.no_grad()
    def evaluate(params: dict) -> dict[str, float]:
        device = params["embed"].device
        losses = [
            float(mt.losses.cross_entropy(forward(params, x.to(device), n_heads), y.to(device)))
            for x, y in eval_set
        ]
        val_loss = sum(losses) / len(losses)
        return {"val_loss": val_loss, "val_bpb": val_loss / LN2}

    decay_matrices = lambda name, p: p.ndim >= 2 and not name.startswith(("embed", "pos"))  # noqa: E731
    # Warmup is cut short for runs shorter than it (e.g. --steps 10), so any step count works.
    decay_steps = max(config["steps"], 1)
    warmup_steps = min(config["warmup_steps"], decay_steps - 1)
    schedule = mt.optim.cosine_schedule(
        config["lr"], decay_steps=decay_steps, warmup_steps=warmup_steps
    )
    return mt.Experiment(
        name="bytelm",
        init=lambda generator: init_params(config, generator),
        loss=loss,
        has_aux=True,
        next_batch=lambda g: get_batch(data.train, batch_size, seq_len, g),
        optimizer=mt.optim.adamw(
            lr=schedule,
            betas=(0.9, 0.95),
            weight_decay=config["weight_decay"],
            mask=decay_matrices,
        ),
        steps=config["steps"],
        evaluate=evaluate,
        eval_every=config["eval_every"],
        tokens_per_batch=batch_size * seq_len,
        flops_per_step=flops_per_step(config),
        max_grad_norm=config["max_grad_norm"] or None,
    )
