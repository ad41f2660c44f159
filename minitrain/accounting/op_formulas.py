"""FLOP formulas of aten ops whose cost depends on more than an element count.

:data:`FORMULA_OPS` maps an op's base name to ``f(arguments by schema name) -> FLOPs`` (the
op's output under ``"result"``) for ops ``torch.utils.flop_counter`` has no formula for: CPU
attention (its CUDA twins' formulas), normalization, pooling, losses, embedding gradients and
torch's fused optimizer kernels (counted as the elementary ops they replace).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from minitrain._torch import pytree
from minitrain.accounting.flops import optimizer_flops_per_element
from minitrain.tree import size

__all__ = ["FORMULA_OPS", "arguments", "tensors"]


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of ``tree`` (an op's arguments or outputs)."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def arguments(func: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    """An aten call's arguments by their schema names, defaults filled in."""
    named = {}
    for position, argument in enumerate(func._schema.arguments):
        if argument.name in kwargs:
            named[argument.name] = kwargs[argument.name]
        elif not argument.kwarg_only and position < len(args):
            named[argument.name] = args[position]
        else:
            named[argument.name] = (argument.default_value if argument.has_default_value()
                                    else None)
    return named


def _layer_norm_backward_flops(a: dict[str, Any]) -> int:
    # Per input element, for each gradient asked for in output_mask (ATen's
    # cpu/layer_norm_kernel.cpp): dx = rstd·(g·γ - mean(g·γ) - x̂·mean(g·γ·x̂)) with
    # x̂ = (x - μ)·rstd: g·γ (1, none without γ), x̂ (2), the two row sums (3), the
    # combination (4); dγ = Σ g·x̂ (2, x̂ shared); dβ = Σ g (1).
    dx, dweight, dbias = a["output_mask"]
    per_element = (9 + (a["weight"] is not None)) * dx + 2 * dweight + dbias
    return per_element * a["grad_out"].numel()


def _nll_loss_flops(a: dict[str, Any]) -> int:
    # -Σ w[t]·x[i, t] / Σ w[t]: the gather moves data; one add per target, plus a multiply and
    # an add into the total weight per target when class weights are given.
    return (1 + 2 * (a["weight"] is not None)) * a["target"].numel()


def _batch_norm_flops(a: dict[str, Any]) -> int:
    # N elements of C channels (ATen's Normalization.cpp, batch_norm_cpu). Training: the
    # batch's variance and mean (3 per element, as var_mean), (x - μ)·rstd (2), then ·γ and
    # +β (1 each); per channel rstd = 1/√(var + eps) (2) and, with running statistics,
    # r_μ·(1 - m) + m·μ (2) and r_σ²·(1 - m) + m·var·n/(n - 1) (3). Eval: (x - r_μ)·rstd (2)
    # and the affine (1 each) per element, rstd from the running variance (2) per channel.
    # Only _native_batch_norm_legit_no_training has no ``training`` argument.
    x = a["input"]
    affine = (a["weight"] is not None) + (a["bias"] is not None)
    channels = x.shape[1] if x.dim() > 1 else 1
    if a.get("training"):
        running = a.get("running_mean") is not None
        return (5 + affine) * x.numel() + (2 + 5 * running) * channels
    return (2 + affine) * x.numel() + 2 * channels


def _batch_norm_backward_flops(a: dict[str, Any]) -> int:
    # Training (ATen's batch_norm_backward_cpu): x̂ = (x - μ)·rstd (2 per element) and
    # Σ g·x̂ (2) for dx or dγ, Σ g (1) for dx or dβ, dx = (g - Σg/n - x̂·Σg·x̂/n)·γ·rstd (4;
    # per channel the two means and γ·rstd, 3, or 2 without γ). Eval: dx = g·γ·rstd (1 per
    # element; per channel rstd from the running variance, 2, and γ·rstd, 1), dγ = Σ g·x̂
    # (4, x̂ from the running statistics), dβ = Σ g (1).
    dx, dweight, dbias = a["output_mask"]
    has_weight, x = a["weight"] is not None, a["input"]
    channels = x.shape[1] if x.dim() > 1 else 1
    if a["train"]:
        per_element = 4 * (dx or dweight) + (dx or dbias) + 4 * dx
        per_channel = dx * (2 + has_weight)
    else:
        per_element = dx + 4 * dweight + dbias
        per_channel = 2 * (dx or dweight) + dx * has_weight
    return per_element * x.numel() + per_channel * channels


def _max_pool_flops(dims: int) -> Callable[[dict[str, Any]], int]:
    # One comparison per element of each window (as amax over the unfolded windows counts).
    def flops(a: dict[str, Any]) -> int:
        kernel = list(a["kernel_size"])
        window = math.prod(kernel * dims if len(kernel) == 1 else kernel)
        return window * a["result"][0].numel()

    return flops


# GeLU's gradient per element (ATen's cpu/Activation.cpp GeluBackwardKernelImpl). Exact:
# g·(Φ(x) + x·φ(x)), Φ(x) = (1 + erf(x/√2))/2 (4), φ(x) = exp(-x²/2)/√(2π) (4), then 3.
# tanh: inner = √(2/π)·(x + 0.044715·x³) and its tanh (6), the left and right factors
# 0.5·x·(1 + t) (3) and their derivatives (3 and 3), g·(l' + r'·inner') (3).
_GELU_BACKWARD_FLOPS = {"none": 11, "tanh": 18}


def _fused_optimizer_flops(optimizer: str) -> Callable[[dict[str, Any]], int]:
    # torch's fused kernels by their own hyperparameters; arguments a kernel does not take
    # (aten::_fused_adamw_(..., float weight_decay, ..., bool amsgrad, ...)) count as off.
    def flops(a: dict[str, Any]) -> int:
        per_element = optimizer_flops_per_element(
            optimizer, maximize=bool(a.get("maximize")),
            weight_decay=float(a.get("weight_decay") or 0.0),
            momentum=float(a.get("momentum") or 0.0), nesterov=bool(a.get("nesterov")),
            first_step=bool(a.get("is_first_step")), amsgrad=bool(a.get("amsgrad")),
            grad_scale=a.get("grad_scale") is not None,
        )
        return per_element * size(a["self"])

    return flops


def _numel(name: str) -> Callable[[dict[str, Any]], int]:
    return lambda a: a[name].numel()


# Ops whose FLOPs depend on more than an element count: base name -> f(arguments by name).
FORMULA_OPS: dict[str, Callable[[dict[str, Any]], int]] = {
    # torch.utils.flop_counter's formulas for the CUDA SDPA kernels (FlashAttention, Dao et al.
    # 2022): QKᵀ and scores·V, 4·B·H·S_q·S_k·D, a causal mask counted in full; the backward
    # recomputes the scores, then five bmms, 2.5 times the forward's FLOPs.
    "_scaled_dot_product_flash_attention_for_cpu": lambda a: sdpa_flop_count(
        a["query"].shape, a["key"].shape, a["value"].shape),
    "_scaled_dot_product_flash_attention_for_cpu_backward": lambda a: sdpa_backward_flop_count(
        a["grad_out"].shape, a["query"].shape, a["key"].shape, a["value"].shape),
    "native_layer_norm_backward": _layer_norm_backward_flops,
    "nll_loss_forward": _nll_loss_flops,
    "nll_loss2d_forward": _nll_loss_flops,
    # zeros with -g·w[t]/Σw written at each target (ATen's LossNLL.cpp): one per target
    "nll_loss_backward": _numel("target"),
    "nll_loss2d_backward": _numel("target"),
    # each gradient row added into its token's row, and divided by the token's count with
    # scale_grad_by_freq
    "embedding_dense_backward": lambda a: (
        (1 + bool(a["scale_grad_by_freq"])) * a["grad_output"].numel()),
    # accumulate=True adds each value into its slot (the backward of indexing); else a copy
    "index_put": lambda a: bool(a["accumulate"]) * a["values"].numel(),
    "_index_put_impl": lambda a: bool(a["accumulate"]) * a["values"].numel(),
    "gelu_backward": lambda a: _GELU_BACKWARD_FLOPS[a["approximate"]] * a["self"].numel(),
    "native_batch_norm": _batch_norm_flops,
    "_native_batch_norm_legit": _batch_norm_flops,
    "_native_batch_norm_legit_no_training": _batch_norm_flops,
    "_native_batch_norm_legit_functional": _batch_norm_flops,
    "native_batch_norm_backward": _batch_norm_backward_flops,
    "max_pool2d_with_indices": _max_pool_flops(2),
    "max_pool3d_with_indices": _max_pool_flops(3),
    # zeros of the input's shape, each output gradient added at its argmax
    "max_pool2d_with_indices_backward": _numel("grad_output"),
    "max_pool3d_with_indices_backward": _numel("grad_output"),
    "_fused_sgd": _fused_optimizer_flops("sgd"),
    "_fused_adam": _fused_optimizer_flops("adam"),
    "_fused_adamw": _fused_optimizer_flops("adamw"),
    "_fused_adagrad": _fused_optimizer_flops("adagrad"),
}
