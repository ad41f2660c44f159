"""Activation memory per transformer layer: Korthikanti et al. 2022 against predict_step and a
measured step of a Hugging Face GPT-2 built from a config (no download)."""

import re

import pytest
import torch

import minitrain as mt
from minitrain import accounting as acc
from minitrain.accounting.predict import TensorSpec, predict_step
from minitrain.accounting.transformer import transformer_activation_terms
from tests.references import require

transformers = require("transformers")

SHAPES = [dict(seq_len=2048, batch=1, hidden=12288, heads=96),  # GPT-3 175B
          dict(seq_len=1024, batch=8, hidden=1600, heads=25),  # GPT-2 XL
          dict(seq_len=64, batch=3, hidden=96, heads=4)]


def transformer_layer_activation_bytes(**kwargs):
    """Bytes one layer saves: the sum of the paper's terms."""
    return sum(transformer_activation_terms(**kwargs).values())


@pytest.mark.parametrize("shape", SHAPES)
def test_the_papers_equations_at_16_bit(shape):
    s, b, h, a = shape["seq_len"], shape["batch"], shape["hidden"], shape["heads"]
    sbh = s * b * h
    eager = transformer_layer_activation_bytes(**shape)
    selective = transformer_layer_activation_bytes(**shape, attention="selective")
    flash = transformer_layer_activation_bytes(**shape, attention="flash")
    assert eager == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)  # eq. 1
    assert selective == 34 * sbh  # eq. 6
    assert flash == 34 * sbh + 4 * a * s * b  # no s² terms; the fp32 log-sum-exp per row
    # the same as the multi-layer formula (tensor and sequence parallelism off)
    one = dict(seq_len=s, batch=b, hidden=h, heads=a, num_layers=1)
    assert acc.transformer_activation_bytes(**one) == pytest.approx(eager, rel=1e-12)
    assert acc.transformer_activation_bytes(**one, recompute="selective") == selective
    assert acc.transformer_activation_bytes(**one, attention="flash") == flash
    # fp32 activations, 1-byte masks: each term by what it holds, not the 16-bit total doubled
    fp32 = transformer_layer_activation_bytes(**shape, bytes_per_element=4)
    assert fp32 == pytest.approx(sbh * (66 + 9 * a * s / h), rel=1e-12)
    assert acc.transformer_activation_bytes(**one, bytes_per_element=4) == pytest.approx(
        fp32, rel=1e-12)


def test_bad_attention_is_one_line():
    with pytest.raises(ValueError, match="choose one of eager, selective, flash"):
        transformer_activation_terms(seq_len=1, batch=1, hidden=1, heads=1, attention="sparse")


# --- against predict_step and a real step ------------------------------------------------------

S, B, H, A = 16, 2, 32, 2  # a tiny GPT-2: context, batch, width, heads
SBH = S * B * H


def gpt2(layers, attention, activation, dropout):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_head=A, n_embd=H, vocab_size=64, n_positions=S,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        activation_function=activation, attn_implementation=attention,
        bos_token_id=0, eos_token_id=0,
    )
    params, apply = mt.from_module(transformers.GPT2LMHeadModel(config).train())
    return params, lambda p, ids: apply(p, input_ids=ids, labels=ids).loss


def predicted_per_layer(attention, activation, dropout):
    params, loss = gpt2(2, attention, activation, dropout)
    prediction = predict_step(loss, params, TensorSpec((B, S), torch.int64))
    first = re.compile(r"\.h\.0(\.|$)")
    return sum(b for module, b in prediction.saved_by_module.items() if first.search(module))


def measured_saved(layers, attention, activation, dropout):
    params, loss = gpt2(layers, attention, activation, dropout)
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(0))
    with acc.Counter(watch_saved=True, keep_records=False) as counter:
        counter.track(params, category="params")
        counter.track(ids, category="batch")
        mt.value_and_grad(loss)(params, ids)
    return counter.live_at_backward["activations"]


# PyTorch's layer, fp32, under torch.func: the paper's terms at 4 bytes, dropout masks as wide
# as the activations (dropout is bernoulli_ and a multiply under torch.func, not native_dropout's
# bool mask) and the layer norms' fp32 mean and rstd (8 bytes per row); what Hugging Face's
# GPT-2 adds on top, in units of s·b·h fp32 elements.
CASES = {
    "eager, dropout, exact GeLU": ("eager", "gelu", 0.1, "eager", 0),
    "eager, no dropout": ("eager", "gelu", 0.0, "eager", 0),
    # GPT-2's own gelu_new written out in ops saves 0.5·x, tanh(·) and 1 + tanh(·): 3·4h more
    "eager, dropout, GPT-2's tanh GeLU": ("eager", "gelu_new", 0.1, "eager", 12),
    # sdpa: Q goes to the kernel as a view of the fused QKV output, which stays alive whole
    # beside the copies of K and V the KV-cache concatenation made: 2·s·b·h more
    "sdpa (CPU flash kernel), no dropout": ("sdpa", "gelu", 0.0, "flash", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gpt2_layer_predicted_and_measured_equal_the_formula(case):
    attention, activation, dropout, kind, extra = CASES[case]
    formula = transformer_layer_activation_bytes(
        seq_len=S, batch=B, hidden=H, heads=A, attention=kind, dropout=dropout > 0,
        bytes_per_element=4, mask_bytes=4, norm_stats_bytes=8,
    ) + extra * SBH * 4
    predicted = predicted_per_layer(attention, activation, dropout)
    assert predicted == formula
    measured = (measured_saved(2, attention, activation, dropout)
                - measured_saved(1, attention, activation, dropout))
    assert measured == predicted
