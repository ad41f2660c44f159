"""mt.nn and mt.models.gpt against torch's modules and a nanoGPT ``nn.Module`` written here
(Karpathy's ``model.py``: LayerNorm, CausalSelfAttention, MLP, Block, GPT with a tied head),
loaded with the same weights; explicit dropout keys under grad and vmap; examples/gpt.py runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from jaxtyping import TypeCheckError
from torch import nn as tnn

import minitrain as mt
from minitrain import random

ROOT = Path(__file__).resolve().parents[1]
CFG = mt.models.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


# --------------------------------------------------------------------- nanoGPT, as an nn.Module


class LayerNorm(tnn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = tnn.Parameter(torch.ones(ndim))
        self.bias = tnn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(tnn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = tnn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = tnn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(tnn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = tnn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = tnn.GELU()
        self.c_proj = tnn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(tnn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(tnn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = tnn.ModuleDict(dict(
            wte=tnn.Embedding(config.vocab_size, config.n_embd),
            wpe=tnn.Embedding(config.block_size, config.n_embd),
            h=tnn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = tnn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nested(named: dict[str, torch.Tensor]) -> dict:
    """``{"h.0.ln_1.weight": t}`` -> ``{"h": [{"ln_1": {"weight": t}}]}`` (lists for digits)."""
    tree: dict = {}
    for name, value in named.items():
        *path, leaf = name.split(".")
        node = tree
        for part, after in zip(path, path[1:] + [leaf], strict=True):
            default = [] if after.isdigit() else {}
            if isinstance(node, list):
                while len(node) <= int(part):
                    node.append(default)
                    default = [] if after.isdigit() else {}
                node = node[int(part)]
            else:
                node = node.setdefault(part, default)
        node[leaf] = value
    return tree


def gpt_params_of(module: GPT) -> dict:
    """The module's tensors (shared, not copied) as mt.models.gpt's params tree."""
    named = {name.removeprefix("transformer."): p for name, p in module.named_parameters()
             if name != "lm_head.weight"}
    return nested(named)


# --------------------------------------------------------------------- layers vs torch modules


def test_linear_embedding_and_norms_equal_torch_modules():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g)
    for bias in (True, False):
        module = tnn.Linear(8, 6, bias=bias)
        params = dict(module.named_parameters())
        torch.testing.assert_close(mt.nn.linear(params, x), module(x), rtol=0, atol=0)
        norm = tnn.LayerNorm(8, bias=bias)
        with torch.no_grad():
            norm.weight.normal_(generator=g)
        params = dict(norm.named_parameters())
        assert sorted(params) == sorted(mt.nn.layer_norm_init(8, bias))
        torch.testing.assert_close(mt.nn.layer_norm(params, x), norm(x), rtol=0, atol=0)
    rms = tnn.RMSNorm(8)
    assert sorted(dict(rms.named_parameters())) == sorted(mt.nn.rms_norm_init(8))
    torch.testing.assert_close(mt.nn.rms_norm(mt.nn.rms_norm_init(8), x), rms(x))
    table = tnn.Embedding(10, 4)
    ids = torch.randint(0, 10, (2, 7), generator=g)
    torch.testing.assert_close(mt.nn.embedding({"weight": table.weight}, ids), table(ids))


def test_linear_init_matches_torch_layout_and_scale():
    p = mt.nn.linear_init(random.key(0), 400, 300)
    assert p["weight"].shape == (300, 400) and p["bias"].shape == (300,)
    bound = 1 / math.sqrt(400)  # nn.Linear's kaiming_uniform(a=sqrt(5)) and bias bound
    assert float(p["weight"].abs().max()) <= bound and float(p["weight"].abs().max()) > 0.99 * bound
    assert float(p["weight"].var()) == pytest.approx(bound**2 / 3, rel=0.02)
    q = mt.nn.linear_init(random.key(0), 400, 300, bias=False, std=0.02)
    assert list(q) == ["weight"] and float(q["weight"].std()) == pytest.approx(0.02, rel=0.02)
    e = mt.nn.embedding_init(random.key(1), 1000, 64)["weight"]
    assert float(e.std()) == pytest.approx(1.0, rel=0.02)  # nn.Embedding: N(0, 1)
    assert not torch.equal(mt.nn.linear_init(random.key(1), 4, 4)["weight"],
                           mt.nn.linear_init(random.key(2), 4, 4)["weight"])


def test_attention_mlp_and_block_equal_nanogpt_modules():
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    for bias in (True, False):
        cfg = mt.models.GPTConfig(n_layer=1, n_head=4, n_embd=32, bias=bias)
        attn, mlp, block = CausalSelfAttention(cfg), MLP(cfg), Block(cfg)
        params = nested(dict(attn.named_parameters()))
        assert mt.tree.structure(params) == mt.tree.structure(
            mt.nn.attention_init(random.key(0), 32, bias))
        for impl in ("sdpa", "math"):
            torch.testing.assert_close(mt.nn.attention(params, x, 4, impl=impl), attn(x))
        torch.testing.assert_close(mt.nn.mlp(nested(dict(mlp.named_parameters())), x), mlp(x))
        params = nested(dict(block.named_parameters()))
        assert mt.tree.structure(params) == mt.tree.structure(
            mt.nn.block_init(random.key(0), 32, bias))
        torch.testing.assert_close(mt.nn.block(params, x, n_head=4), block(x))


def test_attention_is_causal_and_checks_its_arguments():
    params = mt.nn.attention_init(random.key(0), 8)
    x = torch.randn(1, 6, 8)
    changed = x.clone()
    changed[0, 4:] += 1.0  # the future must not reach the past
    for impl in ("sdpa", "math"):
        a = mt.nn.attention(params, x, 2, impl=impl)
        b = mt.nn.attention(params, changed, 2, impl=impl)
        assert torch.equal(a[0, :4], b[0, :4]) and not torch.allclose(a[0, 4:], b[0, 4:])
    with pytest.raises(ValueError, match="impl must be one of"):
        mt.nn.attention(params, x, 2, impl="flash")
    with pytest.raises(ValueError, match="not divisible by n_head=3"):
        mt.nn.attention(params, x, 3)


def test_a_wrong_input_width_names_the_dimension():
    with pytest.raises(TypeCheckError, match="in_features"):
        mt.nn.linear(mt.nn.linear_init(random.key(0), 4, 3), torch.ones(2, 5))


# --------------------------------------------------------------------- dropout and keys


def test_dropout_against_its_definition():
    x = torch.randn(200, 500, generator=torch.Generator().manual_seed(0))
    assert mt.nn.dropout(x, 0.3) is x and mt.nn.dropout(x, 0.0, random.key(0)) is x
    assert torch.equal(mt.nn.dropout(x, 1.0, random.key(0)), torch.zeros_like(x))
    y = mt.nn.dropout(x, 0.3, random.key(0))
    kept = random.uniform(random.key(0), tuple(x.shape)) >= 0.3
    torch.testing.assert_close(y, torch.where(kept, x / 0.7, 0.0), rtol=0, atol=0)
    assert float((y == 0).float().mean()) == pytest.approx(0.3, abs=0.01)
    assert torch.equal(y, mt.nn.dropout(x, 0.3, random.key(0)))
    assert not torch.equal(y, mt.nn.dropout(x, 0.3, random.key(1)))
    grad = torch.func.grad(lambda x: mt.nn.dropout(x, 0.3, random.key(0)).sum())(x)
    torch.testing.assert_close(grad, kept / 0.7)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        mt.nn.dropout(x, 1.5, random.key(0))


def test_gpt_dropout_is_a_pure_function_of_its_key():
    cfg = mt.models.GPTConfig(**{**vars(CFG), "dropout": 0.2})
    params = mt.models.gpt_init(random.key(0), cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    train = mt.models.gpt(params, ids, random.key(5), config=cfg)
    assert torch.equal(train, mt.models.gpt(params, ids, random.key(5), config=cfg))
    assert not torch.allclose(train, mt.models.gpt(params, ids, random.key(6), config=cfg))
    evaluation = mt.models.gpt(params, ids, config=cfg)  # no key: no dropout
    torch.testing.assert_close(evaluation, mt.models.gpt(params, ids, random.key(5), config=CFG))
    assert not torch.allclose(train, evaluation)


def test_vmap_over_split_keys_gives_each_member_its_own_dropout():
    cfg = mt.models.GPTConfig(**{**vars(CFG), "dropout": 0.2})
    params = mt.models.gpt_init(random.key(0), cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(params, key):
        logits = mt.models.gpt(params, ids, key, config=cfg, impl="math")
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    keys = random.split(random.key(1), 3)
    losses, grads = mt.vmap(mt.value_and_grad(loss), in_dims=(None, 0))(params, keys)
    for i, key in enumerate(keys):
        one_loss, one_grads = mt.value_and_grad(loss)(params, key)
        torch.testing.assert_close(losses[i], one_loss)
        torch.testing.assert_close(grads["wte"]["weight"][i], one_grads["wte"]["weight"])
    assert len(set(losses.tolist())) == 3


def test_second_derivatives_through_math_attention():
    params = mt.nn.block_init(random.key(0), 8)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    params = mt.tree.map(lambda p: p.double(), params)

    def energy(x):
        return mt.nn.block(params, x, n_head=2, impl="math").pow(2).sum()

    direction = torch.ones_like(x)  # grad of grad: a Hessian-vector product
    hvp = torch.func.grad(lambda x: (torch.func.grad(energy)(x) * direction).sum())(x)
    eps = 1e-6  # central difference of the gradient along the same direction
    step = direction * eps
    numeric = (torch.func.grad(energy)(x + step) - torch.func.grad(energy)(x - step)) / (2 * eps)
    torch.testing.assert_close(hvp, numeric, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- the GPT vs nanoGPT


def test_gpt_params_are_named_as_nanogpt_state_dict():
    module = GPT(CFG)
    params = mt.models.gpt_init(random.key(0), CFG)
    ours = {name: tuple(p.shape) for name, p in mt.tree.named_leaves(params)}
    theirs = {name.removeprefix("transformer."): tuple(p.shape)
              for name, p in module.state_dict().items() if name != "lm_head.weight"}
    assert ours == theirs
    proj = params["h"][1]["mlp"]["c_proj"]["weight"]  # GPT-2's 1/sqrt(2·n_layer) residual init
    assert float(proj.std()) == pytest.approx(0.02 / math.sqrt(2 * CFG.n_layer), rel=0.1)
    assert float(params["h"][0]["attn"]["c_attn"]["weight"].std()) == pytest.approx(0.02, rel=0.1)
    assert all(float(p.abs().sum()) == 0 for n, p in mt.tree.named_leaves(params)
               if n.endswith("bias"))


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_forward_and_grads_equal_nanogpt(bias):
    cfg = mt.models.GPTConfig(**{**vars(CFG), "bias": bias})
    torch.manual_seed(0)
    module = GPT(cfg)
    with torch.no_grad():  # biases and norms away from their init, so each is tested
        for name, p in module.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    params = gpt_params_of(module)
    ids = torch.randint(0, 64, (3, 16))
    targets = torch.randint(0, 64, (3, 16))
    torch.testing.assert_close(mt.models.gpt(params, ids, config=cfg), module(ids))
    torch.testing.assert_close(mt.models.gpt(params, ids[:, :5], config=cfg), module(ids[:, :5]))

    F.cross_entropy(module(ids).flatten(0, 1), targets.flatten()).backward()
    detached = mt.tree.map(lambda p: p.detach(), params)
    grads = mt.grad(lambda p: F.cross_entropy(
        mt.models.gpt(p, ids, config=cfg).flatten(0, 1), targets.flatten()))(detached)
    for name, grad in mt.tree.named_leaves(grads):
        want = dict(module.named_parameters())[
            name if name.startswith("lm_head") else "transformer." + name].grad
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=name)


def test_gpt_refuses_sequences_past_its_block_size_and_bad_configs():
    params = mt.models.gpt_init(random.key(0), CFG)
    with pytest.raises(ValueError, match="longer than block_size=16"):
        mt.models.gpt(params, torch.zeros(1, 17, dtype=torch.long), config=CFG)
    with pytest.raises(ValueError, match="divisible by n_head"):
        mt.models.GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="dropout"):
        mt.models.GPTConfig(dropout=1.0)


# --------------------------------------------------------------------- examples/gpt.py


def test_example_gpt_trains_with_minitrain_run(tmp_path):
    from minitrain.data import source_files, stdlib_dir

    source = tmp_path / "src"
    source.mkdir()
    for path in source_files(stdlib_dir())[:20]:
        (source / path.name).write_bytes(path.read_bytes())
    sets = ["n_embd=32", "n_layer=1", "n_head=2", "block_size=32", "batch_size=4",
            "dropout=0.1", "eval_batches=1", f"source_dir={source}",
            f"data_dir={tmp_path / 'data'}"]
    done = subprocess.run(
        [sys.executable, "-m", "minitrain", "run", str(ROOT / "examples" / "gpt.py"),
         "--steps", "3", "--log-every", "1", "--out", str(tmp_path / "run"), "--json",
         *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] < 6 for r in rows if "loss" in r)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval"]["val_bpb"] < 8.5


@pytest.mark.parametrize("bad", [[0, 5], [-1, 2], [7]], ids=["past-the-end", "negative", "far"])
def test_embedding_of_ids_outside_the_table_says_the_range(bad):
    table = {"weight": torch.randn(5, 3)}
    with pytest.raises(IndexError, match=r"^embedding: token ids must lie in \[0, 5\) for a "
                                         rf"table of 5 rows; got ids from {min(bad)} to "
                                         rf"{max(bad)} "):
        mt.nn.embedding(table, torch.tensor(bad))
    with pytest.raises(IndexError, match="index out of range"):  # vmapped: torch's own words
        torch.func.vmap(lambda i: mt.nn.embedding(table, i))(torch.tensor([bad, bad]))
    with pytest.raises(IndexError, match="token ids must lie in"):  # the GPT's first layer
        config = mt.models.GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4)
        mt.models.gpt(mt.models.gpt_init(mt.random.key(0), config), torch.tensor([bad]),
                      config=config)
