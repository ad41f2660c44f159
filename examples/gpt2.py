"""GPT-2 from Hugging Face ``transformers``, built from a config (no download), trained by
minitrain: the module becomes a params pytree and a pure apply (``mt.from_module``).

The task is synthetic, so nothing has to be downloaded: each sequence is a random block of
tokens written twice, and the model learns to copy the first half into the second (the loss
falls from ln(vocab) towards half of it). The default size trains on a laptop; the sizes of
GPT-2 XL (1.5B params) are one set of ``--set`` away, for predicting a step before running it:

    minitrain run examples/gpt2.py --steps 200
    minitrain estimate step examples/gpt2.py --hardware h100 \\
        --set n_layer=48 --set n_head=25 --set n_embd=1600 --set vocab_size=50257 \\
        --set seq_len=1024 --set batch_size=8
"""

import torch

import minitrain as mt

CONFIG = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 64,
    "vocab_size": 256,
    "seq_len": 64,  # tokens of context (n_positions)
    "batch_size": 8,
    "attention": "sdpa",  # or "eager" (the softmax(QK^T)V written out)
    "dropout": 0.0,
    "lr": 1e-3,
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
    "steps": 300,
}


def build_model(config: dict) -> torch.nn.Module:
    """``GPT2LMHeadModel`` with random init (GPT-2's N(0, 0.02)), tied embeddings."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:  # one line, not a traceback
        raise ImportError("examples/gpt2.py needs transformers: pip install transformers") from exc
    gpt_config = GPT2Config(
        n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
        vocab_size=config["vocab_size"], n_positions=config["seq_len"],
        resid_pdrop=config["dropout"], embd_pdrop=config["dropout"],
        attn_pdrop=config["dropout"], bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True, attn_implementation=config["attention"],
    )
    return GPT2LMHeadModel(gpt_config)


def experiment(config: dict) -> mt.Experiment:
    module = build_model(config)
    params, apply = mt.from_module(module)
    batch_size, seq_len, vocab = config["batch_size"], config["seq_len"], config["vocab_size"]

    def init(generator: torch.Generator) -> dict:
        return params  # the module's own init (copied by from_module)

    def next_batch(generator: torch.Generator) -> torch.Tensor:
        half = torch.randint(0, vocab, (batch_size, seq_len - seq_len // 2), generator=generator)
        return torch.cat([half, half], dim=1)[:, :seq_len]

    def loss(params: dict, ids: torch.Tensor) -> torch.Tensor:
        # transformers shifts the labels: position t predicts token t + 1.
        return apply(params, input_ids=ids, labels=ids).loss

    return mt.Experiment(
        name="gpt2",
        init=init,
        loss=loss,
        next_batch=next_batch,
        optimizer=mt.optim.adamw(lr=config["lr"], weight_decay=config["weight_decay"]),
        steps=config["steps"],
        max_grad_norm=config["max_grad_norm"],
        tokens_per_batch=batch_size * seq_len,
    )
