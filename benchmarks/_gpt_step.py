"""``python benchmarks/step.py --model gpt``: bytelm's functional GPT step against nanoGPT's
``nn.Module``.

Both train the same pre-LayerNorm GPT-2 (examples/bytelm.py's model: tied embedding, causal
``scaled_dot_product_attention``, GELU MLP, no linear biases) on the same batch of bytes, with
the same AdamW hyperparameters, interleaved round by round in one process:

* the peer: nanoGPT's structure (``model.py``: ``Block``, ``CausalSelfAttention``, ``MLP``,
  weight-tied ``lm_head``) trained by ``loss.backward()`` and ``torch.optim.AdamW(fused=True)``;
* minitrain: ``mt.value_and_grad`` over bytelm's pure ``forward`` under
  :func:`minitrain.precision.compute_context`, then ``mt.optim.adamw(...).update`` with
  ``donate=True`` (what the fit loop does).

Rows: fp32 and bf16 autocast, eager and (``compile=True``) with the forward pass under
``torch.compile`` on both sides; and the simulated fp8 step
(:mod:`minitrain.precision.simulation`) against the fp32 functional step. Returns seconds per
step and the ratios (functional / peer; fp8 / fp32).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _timing import best_rounds, paired_median_ratio, time_rounds
from torch import nn

import minitrain as mt
from minitrain.errors import UserError
from minitrain.precision import compute_context, delayed_scaling
from minitrain.precision import simulation as lowp

__all__ = ["GPTConfig", "NanoGPT", "load_bytelm", "gpt_step_ratios"]

GPTConfig = dict  # bytelm's config keys: d_model, n_layers, n_heads, seq_len, batch_size
DEFAULT = {"d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 128, "batch_size": 16}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


def load_bytelm() -> Any:
    """examples/bytelm.py as a module (it ships in the repository, not in the wheel)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "bytelm.py"
    if not path.exists():
        raise UserError(f"{path} not found: run the gpt benchmark from a repository clone")
    spec = importlib.util.spec_from_file_location("benchmarks_bytelm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.compile looks the module up by name
    spec.loader.exec_module(module)
    return module


class _Attention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, n_heads)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT (Karpathy, ``model.py``) at bytelm's layout: 256 tokens, tied head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config["d_model"]
        self.wte = nn.Embedding(256, d)
        self.wpe = nn.Parameter(torch.zeros(config["seq_len"], d))
        self.blocks = nn.ModuleList(_Block(d, config["n_heads"]) for _ in range(config["n_layers"]))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.ln_f(h) @ self.wte.weight.T


def _copy_bytelm_params(module: NanoGPT, params: dict) -> None:
    """Load bytelm's pytree (weights stored (in, out)) into the nn.Module (out, in)."""
    with torch.no_grad():
        module.wte.weight.copy_(params["embed"])
        module.wpe.copy_(params["pos"])
        for block, p in zip(module.blocks, params["blocks"], strict=True):
            block.ln_1.weight.copy_(p["ln1"]["weight"])
            block.ln_1.bias.copy_(p["ln1"]["bias"])
            block.ln_2.weight.copy_(p["ln2"]["weight"])
            block.ln_2.bias.copy_(p["ln2"]["bias"])
            block.attn.c_attn.weight.copy_(p["attn"]["qkv"]["weight"].T)
            block.attn.c_proj.weight.copy_(p["attn"]["out"]["weight"].T)
            block.c_fc.weight.copy_(p["mlp"]["fc"]["weight"].T)
            block.c_proj.weight.copy_(p["mlp"]["proj"]["weight"].T)
        module.ln_f.weight.copy_(params["ln_f"]["weight"])
        module.ln_f.bias.copy_(params["ln_f"]["bias"])


def _peer_step(module: NanoGPT, batch: tuple, dtype: torch.dtype, compile: bool) -> Callable:
    optimizer = torch.optim.AdamW(module.parameters(), fused=True, **ADAMW)
    x, y = batch
    forward = torch.compile(module) if compile else module

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = forward(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _functional_step(
    bytelm: Any, params: dict, batch: tuple, n_heads: int, policy: str, compile: bool
) -> Callable:
    """One functional train step; the fp8 policy scales from amax histories (delayed scaling,
    as ``minitrain run --backend cpu-fp8`` trains): they are differentiated and carried."""
    opt = mt.optim.adamw(**ADAMW)
    state = {"params": params, "opt": opt.init(params), "history": None}

    def loss(p: dict, history: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with compute_context(policy, "cpu", history):
            logits = bytelm.forward(p, x, n_heads)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    delayed = delayed_scaling(policy) is not None
    if delayed:
        count = lowp.count_matmuls(bytelm.forward, params, batch[0], n_heads)
        state["history"] = lowp.init_state(delayed_scaling(policy), count)
    if compile:  # the forward pass, as the peer compiles its module
        loss = torch.compile(loss)
    grads_of = mt.value_and_grad(loss, argnums=(0, 1) if delayed else 0)

    def step() -> None:
        _, grads = grads_of(state["params"], state["history"], *batch)
        if delayed:
            grads, state["history"] = grads
        state["params"], state["opt"] = opt.update(
            grads, state["opt"], state["params"], donate=True
        )

    return step


def gpt_step_ratios(
    config: GPTConfig | None = None,
    rounds: int = 5,
    inner: int = 3,
    compile: bool = False,
    fp8: bool = True,
) -> dict[str, Any]:
    """Seconds per step of each variant (best round) and the ratios the targets are stated in:
    of the best rounds (``ratios``) and the median of the per-round ratios
    (``paired_median_ratios``).

    ``ratios["fp32"]`` etc. are functional / nanoGPT (target <= 1.05); ``ratios["fp8/fp32"]`` is
    the simulated fp8 functional step over the fp32 functional step (target <= 2).
    """
    config = {**DEFAULT, **(config or {})}
    bytelm = load_bytelm()
    g = torch.Generator().manual_seed(0)
    params = bytelm.init_params(config, g)
    x = torch.randint(0, 256, (config["batch_size"], config["seq_len"] + 1), generator=g)
    batch = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    rows = [("fp32", torch.float32), ("bf16", torch.bfloat16)]
    steppers: dict[str, Callable[[], None]] = {}
    for name, dtype in rows:
        for compiled in (False, True) if compile else (False,):
            tag = f"{name}{'-compiled' if compiled else ''}"
            module = NanoGPT(config)
            _copy_bytelm_params(module, params)
            steppers[f"nanogpt-{tag}"] = _peer_step(module, batch, dtype, compiled)
            copy = mt.tree.map(torch.clone, params)
            steppers[f"minitrain-{tag}"] = _functional_step(
                bytelm, copy, batch, config["n_heads"], name, compiled
            )
    if fp8:
        copy = mt.tree.map(torch.clone, params)
        steppers["minitrain-fp8"] = _functional_step(
            bytelm, copy, batch, config["n_heads"], "fp8", False
        )
    times = time_rounds(steppers, rounds=rounds, inner=inner, device="cpu")
    seconds = best_rounds(times)
    pairs = {
        tag: (f"minitrain-{tag}", f"nanogpt-{tag}")
        for tag in (k.removeprefix("nanogpt-") for k in seconds if k.startswith("nanogpt-"))
    }
    if fp8:
        pairs["fp8/fp32"] = ("minitrain-fp8", "minitrain-fp32")
    ratios = {tag: seconds[a] / seconds[b] for tag, (a, b) in pairs.items()}
    # Each round runs the two sides of a pair back to back: the median of the per-round ratios
    # is the estimate least moved by other jobs (the best rounds' ratio can pair a lucky round
    # of one side with an ordinary round of the other).
    paired = {tag: paired_median_ratio(times, a, b) for tag, (a, b) in pairs.items()}
    flops = bytelm.flops_per_step(config)
    return {
        "config": config,
        "seconds": seconds,
        "ratios": ratios,
        "paired_median_ratios": paired,
        "gflops_per_step": flops / 1e9,
        "achieved_gflops": {k: flops / v / 1e9 for k, v in seconds.items() if math.isfinite(v)},
    }
