"""nanoGPT's GPT made of ``mt.nn`` layers, trained on Python's standard library byte by byte.

The model is ``mt.models.gpt``: pre-LayerNorm blocks of causal self-attention and a GELU MLP
(Radford et al. 2019), a head tied to the token embedding, nanoGPT's init and names
(``wte``, ``wpe``, ``h.0.attn.c_attn.weight``, ...). Dropout is explicit: every batch carries a
fresh ``mt.random`` key drawn with the step's data generator, so a run, and a resumed run, is a
pure function of its seed; evaluation passes no key and so drops nothing. The data are the
bytes bundled with every Python install (``examples/bytelm.py`` trains on the same corpus with
a hand-written model); loss is reported in bits per byte (8 bits is a uniform guess).

Eagerly, dropout's mask draws (Threefry, some 170 integer ops per element) cost several times
the step on a CPU; ``--compile`` fuses them into one loop and trains to the same losses.

    minitrain run examples/gpt.py --out runs/gpt
    minitrain run examples/gpt.py --set dropout=0.1 --set n_layer=4 --steps 2000 --compile
"""

import math

import torch

import minitrain as mt
from minitrain.data import ensure_prepared, get_batch, load_prepared

CONFIG = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "block_size": 128,  # bytes of context
    "dropout": 0.0,
    "bias": False,  # no biases in the linear layers and LayerNorms, as nanoGPT recommends
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

VOCAB = 256  # one token per byte value
LN2 = math.log(2.0)


def gpt_config(config: dict) -> mt.models.GPTConfig:
    keys = ("block_size", "n_layer", "n_head", "n_embd", "dropout", "bias")
    return mt.models.GPTConfig(vocab_size=VOCAB, **{k: config[k] for k in keys})


def flops_per_step(config: dict) -> int:
    """Matmul FLOPs of a training step, 3 x forward: per token and layer 2·12·d² in the
    projections and MLP plus 2·2·T·d in ``QKᵀ`` and ``AV`` (PaLM, Appendix B), and the head."""
    d, layers, seq = config["n_embd"], config["n_layer"], config["block_size"]
    forward_per_token = layers * (24 * d * d + 4 * seq * d) + 2 * d * VOCAB
    return 3 * config["batch_size"] * seq * forward_per_token


def load_data(config: dict) -> mt.data.PreparedData:
    """A given ``data_dir`` alone is only read; with ``source_dir`` it is prepared from there on
    first use; neither: the standard library corpus in the minitrain cache."""
    if config["data_dir"] and not config["source_dir"]:
        return load_prepared(config["data_dir"])
    return ensure_prepared(config["data_dir"] or None, config["source_dir"] or None)


def experiment(config: dict) -> mt.Experiment:
    cfg = gpt_config(config)
    data = load_data(config)
    batch_size, seq = config["batch_size"], cfg.block_size

    def sample(generator: torch.Generator) -> tuple:
        x, y = get_batch(data.train, batch_size, seq, generator)
        return x, y, mt.random.key(generator)

    def loss(params: dict, batch: tuple) -> tuple:
        x, y, key = batch
        nats = mt.losses.cross_entropy(mt.models.gpt(params, x, key, config=cfg), y)
        return nats, {"bpb": nats / LN2}

    eval_generator = torch.Generator().manual_seed(1234)
    eval_set = [get_batch(data.val, batch_size, seq, eval_generator)
                for _ in range(config["eval_batches"])]

    @torch.no_grad()
    def evaluate(params: dict) -> dict[str, float]:
        device = params["wte"]["weight"].device
        losses = [float(mt.losses.cross_entropy(
            mt.models.gpt(params, x.to(device), config=cfg), y.to(device))) for x, y in eval_set]
        val_loss = sum(losses) / len(losses)
        return {"val_loss": val_loss, "val_bpb": val_loss / LN2}

    def init(generator: torch.Generator) -> dict:
        return mt.models.gpt_init(mt.random.key(generator), cfg)

    # nanoGPT decays the 2-D weights (matmuls and embeddings), not biases or norms.
    decay = lambda name, p: p.ndim >= 2  # noqa: E731
    decay_steps = max(config["steps"], 1)
    schedule = mt.optim.cosine_schedule(
        config["lr"], decay_steps=decay_steps,
        warmup_steps=min(config["warmup_steps"], decay_steps - 1),
    )
    return mt.Experiment(
        name="gpt",
        init=init,
        loss=loss,
        has_aux=True,
        next_batch=sample,
        optimizer=mt.optim.adamw(lr=schedule, betas=(0.9, 0.95),
                                 weight_decay=config["weight_decay"], mask=decay),
        steps=config["steps"],
        evaluate=evaluate,
        eval_every=config["eval_every"],
        tokens_per_batch=batch_size * seq,
        flops_per_step=flops_per_step(config),
        max_grad_norm=config["max_grad_norm"] or None,
    )
