"""``transformer_memory`` counts optimizer state tensor by tensor: Adafactor's factored moments,
and Muon as it is used (the layers' matrices; AdamW for embeddings, the head, biases and norms),
checked against what torch.optim allocates on Hugging Face models built from configs."""

import collections
import math

import pytest
import torch
import transformers

from minitrain import accounting as acc

TINY_GPT2 = acc.TransformerConfig("tiny-gpt2", 2, 32, 4, vocab=97, seq_len=16, ffn=128,
                                  kv_heads=4, fused_qkv=True)
TINY_LLAMA = acc.TransformerConfig("tiny-llama", 2, 32, 4, vocab=97, seq_len=16, ffn=64,
                                   kv_heads=2, gated_mlp=True, tied_embeddings=False,
                                   learned_positions=False, biases=False, norm_params=1)


def hugging_face(config: acc.TransformerConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    if config.fused_qkv:
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=config.num_layers, n_embd=config.hidden, n_head=config.heads,
            vocab_size=config.vocab, n_positions=config.seq_len))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=config.hidden, intermediate_size=config.ffn,
        num_hidden_layers=config.num_layers, num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads, vocab_size=config.vocab,
        max_position_embeddings=config.seq_len, tie_word_embeddings=False))


def is_layer_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon's params as its authors route them: the 2-D weights inside the blocks."""
    return param.ndim == 2 and (".h." in name or ".layers." in name)


def torch_state_elements(model: torch.nn.Module, optimizer: str) -> int:
    """Elements of every non-scalar state tensor after one step of torch.optim."""
    named = list(model.named_parameters())
    for _, p in named:
        p.grad = torch.randn_like(p)
    if optimizer == "muon":
        steps = [torch.optim.Muon([p for n, p in named if is_layer_matrix(n, p)], lr=0.02),
                 torch.optim.AdamW([p for n, p in named if not is_layer_matrix(n, p)])]
    else:
        cls = {"adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor,
               "sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}[optimizer]
        kwargs = {"sgd": dict(lr=0.1, momentum=0.9)}.get(optimizer, {})
        steps = [cls([p for _, p in named], **kwargs)]
    total = 0
    for step in steps:
        step.step()
        total += sum(t.numel() for state in step.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


@pytest.mark.parametrize("config", [TINY_GPT2, TINY_LLAMA], ids=lambda c: c.name)
def test_the_tensors_are_the_hugging_face_models_tensors(config):
    model = hugging_face(config)
    ours = collections.Counter(shape for _, shape in acc.transformer_tensors(config))
    theirs = collections.Counter(tuple(p.shape) for p in model.parameters())
    assert ours == theirs
    assert acc.transformer_params(config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config", [TINY_GPT2, TINY_LLAMA], ids=lambda c: c.name)
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "muon", "sgd", "rmsprop"])
def test_state_elements_equal_what_torch_optim_allocates(config, optimizer):
    flags = {"momentum": True} if optimizer == "sgd" else {}
    expected = torch_state_elements(hugging_face(config), optimizer)
    assert acc.transformer_optimizer_state_elements(config, optimizer, **flags) == expected


@pytest.mark.parametrize("optimizer", ["muon", "adafactor", "adamw"])
@pytest.mark.parametrize(("precision", "state_bytes"),
                         [("fp32", 4), ("bf16-pure", 2), ("bf16", 4)])
@pytest.mark.parametrize(("gpus", "zero"), [(1, 0), (4, 1), (4, 0)])
def test_memory_reports_those_elements_in_the_recipes_bytes_and_shards(
        optimizer, precision, state_bytes, gpus, zero):
    memory = acc.transformer_memory(TINY_GPT2, batch=1, optimizer=optimizer,
                                    precision_name=precision, gpus=gpus, zero_stage=zero)
    elements = torch_state_elements(hugging_face(TINY_GPT2), optimizer)
    shards = gpus if zero >= 1 else 1
    assert memory.optimizer_state == pytest.approx(elements * state_bytes / shards, rel=1e-12)


def test_muon_on_gpt2_keeps_one_buffer_per_layer_matrix_and_two_for_the_rest():
    gpt2 = acc.preset("gpt2")
    params = acc.transformer_params(gpt2)
    matrices = sum(math.prod(shape) for role, shape in acc.transformer_tensors(gpt2)
                   if role == "hidden")
    assert matrices == 12 * (4 * 768 * 768 + 8 * 768 * 768)  # qkv + proj + two MLP matrices
    assert acc.transformer_optimizer_state_elements(gpt2, "muon") == (
        matrices + 2 * (params - matrices))
