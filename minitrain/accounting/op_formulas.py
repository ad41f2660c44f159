"""FLOP formulas of aten ops whose cost depends on more than an element count.

:data:`FORMULA_OPS` maps an op's base name to ``f(func, args, kwargs) -> FLOPs``, read from
the op's arguments by their schema names, for ops ``torch.utils.flop_counter`` has no formula
for: CPU attention (its CUDA twins' formulas), normalization, pooling, losses, embedding
gradients and torch's fused optimizer kernels (counted as the elementary ops they replace).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from minitrain._torch import aten_native_batch_norm_legit_no_training, pytree
from minitrain.accounting.flops import optimizer_flops_per_element

__all__ = ["FORMULA_OPS", "elements", "tensors"]


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of ``tree`` (an op's arguments or outputs)."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def elements(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


_REQUIRED = object()


def _argument(func: Any, args: Any, kwargs: Any, name: str, missing: Any = _REQUIRED) -> Any:
    """The value of argument ``name`` of an aten call; its schema default when not passed, and
    ``missing`` (if given) when this overload has no such argument."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name != name:
            continue
        if name in kwargs:
            return kwargs[name]
        if not argument.kwarg_only and position < len(args):
            return args[position]
        return argument.default_value if argument.has_default_value() else None
    if missing is _REQUIRED:
        raise KeyError(f"{func} has no argument {name!r}")
    return missing


def _shapes_into(count: Callable[..., int], *names: str) -> Callable[[Any, Any, Any], int]:
    def flops(func: Any, args: Any, kwargs: Any) -> int:
        return count(*[_argument(func, args, kwargs, n).shape for n in names])

    return flops


def _layer_norm_backward_flops(func: Any, args: Any, kwargs: Any) -> int:
    # Per input element, for each gradient asked for in output_mask (ATen's
    # cpu/layer_norm_kernel.cpp): dx = rstd·(g·γ - mean(g·γ) - x̂·mean(g·γ·x̂)) with
    # x̂ = (x - μ)·rstd: g·γ (1, none without γ), x̂ (2), the two row sums (3), the
    # combination (4); dγ = Σ g·x̂ (2, x̂ shared); dβ = Σ g (1).
    dx, dweight, dbias = _argument(func, args, kwargs, "output_mask")
    has_weight = _argument(func, args, kwargs, "weight") is not None
    per_element = (9 + has_weight) * dx + 2 * dweight + dbias
    return per_element * _argument(func, args, kwargs, "grad_out").numel()


def _nll_loss_flops(func: Any, args: Any, kwargs: Any) -> int:
    # -Σ w[t]·x[i, t] / Σ w[t]: the gather moves data; one add per target, plus a multiply and
    # an add into the total weight per target when class weights are given.
    weighted = _argument(func, args, kwargs, "weight") is not None
    return (1 + 2 * weighted) * _argument(func, args, kwargs, "target").numel()


def _embedding_backward_flops(func: Any, args: Any, kwargs: Any) -> int:
    # Each gradient row is added into its token's row: one add per element, and a divide by
    # the token's count with scale_grad_by_freq.
    per_element = 1 + bool(_argument(func, args, kwargs, "scale_grad_by_freq"))
    return per_element * _argument(func, args, kwargs, "grad_output").numel()


def _index_put_flops(func: Any, args: Any, kwargs: Any) -> int:
    # accumulate=True adds each value into its slot (the backward of indexing); else a copy.
    accumulate = bool(_argument(func, args, kwargs, "accumulate"))
    return accumulate * _argument(func, args, kwargs, "values").numel()


def _batch_norm_flops(func: Any, args: Any, kwargs: Any) -> int:
    # N elements of C channels (ATen's Normalization.cpp, batch_norm_cpu). Training: the
    # batch's variance and mean (3 per element, as var_mean), (x - μ)·rstd (2), then ·γ and
    # +β (1 each); per channel rstd = 1/√(var + eps) (2) and, with running statistics,
    # r_μ·(1 - m) + m·μ (2) and r_σ²·(1 - m) + m·var·n/(n - 1) (3). Eval: (x - r_μ)·rstd (2)
    # and the affine (1 each) per element, rstd from the running variance (2) per channel.
    x = _argument(func, args, kwargs, "input")
    training = _argument(func, args, kwargs, "training", None)
    training = bool(training) if training is not None else func._overloadpacket is not (
        aten_native_batch_norm_legit_no_training)
    affine = sum(_argument(func, args, kwargs, n) is not None for n in ("weight", "bias"))
    running = _argument(func, args, kwargs, "running_mean", None) is not None
    channels = x.shape[1] if x.dim() > 1 else 1
    if training:
        return (5 + affine) * x.numel() + (2 + 5 * running) * channels
    return (2 + affine) * x.numel() + 2 * channels


def _batch_norm_backward_flops(func: Any, args: Any, kwargs: Any) -> int:
    # Training (ATen's batch_norm_backward_cpu): x̂ = (x - μ)·rstd (2 per element) and
    # Σ g·x̂ (2) for dx or dγ, Σ g (1) for dx or dβ, dx = (g - Σg/n - x̂·Σg·x̂/n)·γ·rstd (4;
    # per channel the two means and γ·rstd, 3, or 2 without γ). Eval: dx = g·γ·rstd (1 per
    # element; per channel rstd from the running variance, 2, and γ·rstd, 1), dγ = Σ g·x̂
    # (4, x̂ from the running statistics), dβ = Σ g (1).
    dx, dweight, dbias = _argument(func, args, kwargs, "output_mask")
    has_weight = _argument(func, args, kwargs, "weight") is not None
    x = _argument(func, args, kwargs, "input")
    channels = x.shape[1] if x.dim() > 1 else 1
    if _argument(func, args, kwargs, "train"):
        per_element = 4 * (dx or dweight) + (dx or dbias) + 4 * dx
        per_channel = dx * (2 + has_weight)
    else:
        per_element = dx + 4 * dweight + dbias
        per_channel = 2 * (dx or dweight) + dx * has_weight
    return per_element * x.numel() + per_channel * channels


def _max_pool_flops(dims: int) -> Callable[[Any, Any, Any], int]:
    # One comparison per element of each window (as amax over the unfolded windows counts), the
    # output's size from the arguments as PyTorch's pooling_output_shape computes it.
    def flops(func: Any, args: Any, kwargs: Any) -> int:
        def expand(name: str, default: list[int]) -> list[int]:
            value = list(_argument(func, args, kwargs, name) or default)
            return value * dims if len(value) == 1 else value

        x = _argument(func, args, kwargs, "self")
        kernel = expand("kernel_size", [1])
        stride = expand("stride", kernel)
        padding, dilation = expand("padding", [0]), expand("dilation", [1])
        ceil = bool(_argument(func, args, kwargs, "ceil_mode"))
        out = math.prod(x.shape[:-dims])
        for size, k, s, p, d in zip(x.shape[-dims:], kernel, stride, padding, dilation,
                                    strict=True):
            n = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)) // s + 1
            out *= n - 1 if ceil and (n - 1) * s >= size + p else n
        return math.prod(kernel) * out

    return flops


def _numel(name: str) -> Callable[[Any, Any, Any], int]:
    # One FLOP per element of argument ``name``.
    return lambda func, args, kwargs: _argument(func, args, kwargs, name).numel()


# GeLU's gradient per element (ATen's cpu/Activation.cpp GeluBackwardKernelImpl). Exact:
# g·(Φ(x) + x·φ(x)), Φ(x) = (1 + erf(x/√2))/2 (4), φ(x) = exp(-x²/2)/√(2π) (4), then 3.
# tanh: inner = √(2/π)·(x + 0.044715·x³) and its tanh (6), the left and right factors
# 0.5·x·(1 + t) (3) and their derivatives (3 and 3), g·(l' + r'·inner') (3).
_GELU_BACKWARD_FLOPS = {"none": 11, "tanh": 18}


def _gelu_backward_flops(func: Any, args: Any, kwargs: Any) -> int:
    approximate = _argument(func, args, kwargs, "approximate")
    return _GELU_BACKWARD_FLOPS[approximate] * _argument(func, args, kwargs, "self").numel()


def _fused_optimizer_flops(optimizer: str) -> Callable[[Any, Any, Any], int]:
    # torch's fused kernels by their own hyperparameters; arguments a kernel does not take
    # (aten::_fused_adamw_(..., float weight_decay, ..., bool amsgrad, ...)) count as off.
    def flops(func: Any, args: Any, kwargs: Any) -> int:
        named = {a.name: _argument(func, args, kwargs, a.name) for a in func._schema.arguments}
        per_element = optimizer_flops_per_element(
            optimizer, maximize=bool(named.get("maximize")),
            weight_decay=float(named.get("weight_decay") or 0.0),
            momentum=float(named.get("momentum") or 0.0), nesterov=bool(named.get("nesterov")),
            first_step=bool(named.get("is_first_step")), amsgrad=bool(named.get("amsgrad")),
            grad_scale=named.get("grad_scale") is not None,
        )
        return per_element * elements(tensors(named["self"]))

    return flops


# Ops whose FLOPs depend on more than an element count: base name -> f(func, args, kwargs).
FORMULA_OPS: dict[str, Callable[[Any, Any, Any], int]] = {
    # torch.utils.flop_counter's formulas for the CUDA SDPA kernels (FlashAttention, Dao et al.
    # 2022): QKᵀ and scores·V, 4·B·H·S_q·S_k·D, a causal mask counted in full; the backward
    # recomputes the scores, then five bmms, 2.5 times the forward's FLOPs.
    "_scaled_dot_product_flash_attention_for_cpu": _shapes_into(
        sdpa_flop_count, "query", "key", "value"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": _shapes_into(
        sdpa_backward_flop_count, "grad_out", "query", "key", "value"),
    "native_layer_norm_backward": _layer_norm_backward_flops,
    "nll_loss_forward": _nll_loss_flops,
    "nll_loss2d_forward": _nll_loss_flops,
    # zeros with -g·w[t]/Σw written at each target (ATen's LossNLL.cpp): one per target
    "nll_loss_backward": _numel("target"),
    "nll_loss2d_backward": _numel("target"),
    "embedding_dense_backward": _embedding_backward_flops,
    "index_put": _index_put_flops,
    "_index_put_impl": _index_put_flops,
    "gelu_backward": _gelu_backward_flops,
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
