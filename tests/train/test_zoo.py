"""A zoo of models nobody here wrote, built from configs (no downloads): the step predicted on
fake tensors against the same step run for real under the Counter.

For each model, with SGD and AdamW, pure and donated: the predicted peak is within 10% of the
measured one (live storages, CPU), the predicted FLOPs equal the counted FLOPs, the counted
matmul FLOPs equal ``FlopCounterMode``'s, and every op has a FLOP formula. The ResNet trains
its BatchNorm layers in train mode, the running statistics carried as model state.
"""

import functools
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import minitrain as mt
from minitrain.accounting.predict import predict_step
from minitrain.train import Experiment
from minitrain.train.step import init_carry, make_train_step
from tests.references import require

transformers = require("transformers")

# Ops the Counter has no FLOP formula for (each named in the README); nothing else may be.
WITHOUT_FORMULA: set[str] = set()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOCAB, SEQ, BATCH = 128, 16, 4


def _example(name):
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tokens(generator):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids


def _causal_lm(module):
    params, apply = mt.from_module(module)

    def loss(params, ids):
        return apply(params, input_ids=ids, labels=ids).loss

    return params, loss, _tokens


def gpt2(attention):
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=SEQ,
        tie_word_embeddings=True, attn_implementation=attention, bos_token_id=0, eos_token_id=0,
    )
    return _causal_lm(transformers.GPT2LMHeadModel(config))


def llama():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return _causal_lm(transformers.LlamaForCausalLM(config))


def bert():
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=3,
        attn_implementation="eager",
    )
    params, apply = mt.from_module(transformers.BertForSequenceClassification(config))

    def loss(params, batch):
        ids, labels = batch
        return apply(params, input_ids=ids, labels=labels).loss

    def data(generator):
        return _tokens(generator), torch.randint(0, 3, (BATCH,), generator=generator)

    return params, loss, data


def resnet():
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic", num_labels=5,
    )
    # Train-mode BatchNorm: the running statistics are model state, taken and returned.
    module = transformers.ResNetForImageClassification(config).train()
    params, state, apply = mt.from_module(module, with_state=True)

    def loss(params, state, batch):
        images, labels = batch
        out, new_state = apply(params, state, pixel_values=images, labels=labels)
        return out.loss, new_state

    def data(generator):
        return (torch.randn(BATCH, 3, 16, 16, generator=generator),
                torch.randint(0, 5, (BATCH,), generator=generator))

    return params, loss, data, state


def cruncher():
    params = mt.models.cruncher_init(dim=32, num_layers=2, generator=torch.Generator())

    def loss(params, batch):
        x, y = batch
        return mt.losses.mse(mt.models.cruncher(params, x), y)

    def data(generator):
        return torch.randn(8, 32, generator=generator), torch.randn(8, generator=generator)

    return params, loss, data


def linreg():
    exp = _example("linreg").experiment({"dim": 16, "num_layers": 0, "batch_size": 4,
                                         "lr": 0.01, "steps": 1})
    return exp.init(torch.Generator()), exp.loss, exp.next_batch


def bytelm():
    example = _example("bytelm")
    config = dict(example.CONFIG, d_model=32, n_layers=2, n_heads=4, seq_len=SEQ)
    params = example.init_params(config, torch.Generator())

    def loss(params, batch):
        x, y = batch
        logits = example.forward(params, x, config["n_heads"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def data(generator):
        ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    return params, loss, data


ZOO = {
    "gpt2-eager": lambda: gpt2("eager"),
    "gpt2-sdpa": lambda: gpt2("sdpa"),
    "llama": llama,
    "bert": bert,
    "resnet": resnet,
    "cruncher": cruncher,
    "linreg": linreg,
    "bytelm": bytelm,
}
OPTIMIZERS = {
    "sgd": lambda: mt.optim.sgd(lr=0.1, momentum=0.9),
    "adamw": lambda: mt.optim.adamw(lr=1e-3, weight_decay=0.1),
}


def measure(params, loss, batch, optimizer, donate, flop_counter=True, state=None):
    """One real train step (the loop's own) under the Counter (and under FlopCounterMode)."""
    exp = Experiment(init=lambda g: params, loss=loss, next_batch=lambda g: batch,
                     optimizer=optimizer, steps=1,
                     init_state=None if state is None else (lambda g: state))
    backend = mt.get_backend("cpu")
    step = make_train_step(exp, backend, donate=donate)
    counts = [None, None]
    for watch in ("counter", "flop_counter")[: 1 + flop_counter]:
        opt_state = optimizer.init(params)
        copy = mt.tree.map(torch.clone, params)
        carry = init_carry(exp, backend, torch.Generator())
        torch.manual_seed(0)
        if watch == "counter":
            with mt.accounting.Counter(keep_records=False) as counter:
                counter.track(copy, opt_state, batch, carry)
                out = step(copy, opt_state, batch, carry=carry)
                del out
        else:
            with FlopCounterMode(display=False) as flop_counter:
                out = step(copy, opt_state, batch, carry=carry)
                del out
        counts[watch == "flop_counter"] = counter if watch == "counter" else flop_counter
    return counts


@functools.cache
def build(name):
    return ZOO[name]()


def zoo_row(name, opt_name, donate, flop_counter=True):
    params, loss, data, *state = build(name)
    state = state[0] if state else None
    batch = data(torch.Generator().manual_seed(0))
    optimizer = OPTIMIZERS[opt_name]()
    counter, flop_counter = measure(params, loss, batch, optimizer, donate, flop_counter, state)
    pred = predict_step(loss, params, batch, optimizer=optimizer, donate=donate,
                        model_state=state)
    return pred, counter, flop_counter, mt.tree.size(params)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(ZOO))
def test_predicted_step_matches_the_measured_one(name, opt_name, donate):
    # FlopCounterMode once per model (the update does no matmul).
    check_matmuls = opt_name == "sgd" and not donate
    pred, counter, flop_counter, _ = zoo_row(name, opt_name, donate, check_matmuls)
    ratio = pred.peak_bytes / counter.peak_bytes
    assert math.isclose(ratio, 1.0, abs_tol=0.10), (pred.memory, counter.peak_bytes)
    assert pred.flops == counter.flops
    if check_matmuls:
        assert counter.matmul_flops == flop_counter.get_total_flops()
    assert pred.matmul_flops == counter.matmul_flops
    assert pred.unknown_ops == counter.unknown
    assert set(pred.unknown_ops) <= WITHOUT_FORMULA
    if name == "resnet":  # the running statistics are state, kept beside the new ones
        assert pred.memory["persistent"]["buffers"] > 0
    assert pred.memory["saved_for_backward"] > 0 and pred.saved
