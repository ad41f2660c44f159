"""DP-SGD's aggregation (Abadi et al. 2016, "Deep Learning with Differential Privacy"), as optax
``contrib.differentially_private_aggregate``: per-example grads in (a leading batch dim on every
leaf), each example clipped to global L2 norm ``l2_norm_clip``, summed, Gaussian noise of std
``l2_norm_clip * noise_multiplier`` added, divided by the batch size. Put it first in a chain;
the noise key is in the state, split once per update into the next key and one key whose single
normal draw, sliced in leaf order, noises every leaf (optax splits one key per leaf)."""

from __future__ import annotations

import array
import functools
import itertools
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _native, _torch, random, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import check_state_type, checked, f32_tensor, one_lr
from minitrain.optim.base import (
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    apply_updates,
    chain,
    spec,
    tagged,
)
from minitrain.optim.kernels import streaming
from minitrain.optim.kernels.checks import pointers
from minitrain.optim.transforms import ScaleByLearningRateState, scale_by_learning_rate, trace

__all__ = ["differentially_private_aggregate", "DifferentiallyPrivateAggregateState", "dpsgd"]


class DifferentiallyPrivateAggregateState(NamedTuple):
    """``rng_key``, the :mod:`minitrain.random` key of the next update's noise."""

    rng_key: Tensor


def differentially_private_aggregate(l2_norm_clip: float | Tensor, noise_multiplier: float | Tensor,
                                     key: int | Tensor) -> GradientTransformation:
    """Clip each example's grads, sum, add noise, average (``key``: a seed or a
    ``mt.random.key``).

    >>> tx = differentially_private_aggregate(1.0, 0.0, key=0)
    >>> per_example = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
    >>> tx.update(per_example, tx.init({"w": torch.zeros(2)}))[0]
    {'w': tensor([0.4500, 0.6000])}
    """
    l2_norm_clip = checked("l2_norm_clip", l2_norm_clip, 0.0, low_open=True)
    noise_std = checked("noise_multiplier", noise_multiplier, 0.0) * l2_norm_clip
    first_key = random.key(key) if isinstance(key, int) and not isinstance(key, bool) else key
    random.split(first_key, 0)  # refuses, in one line, what is no key

    def init(params):
        return DifferentiallyPrivateAggregateState(first_key.clone())

    def update(updates, state, params=None):
        check_state_type("differentially_private_aggregate",
                         DifferentiallyPrivateAggregateState, state)
        leaves, structure = _pytree.tree_flatten(updates)
        if not leaves:
            return updates, state
        out, new_key = _private_mean(leaves, state.rng_key, l2_norm_clip, noise_std)
        return tree.unflatten(structure, out), DifferentiallyPrivateAggregateState(new_key)

    return tagged("differentially_private_aggregate", GradientTransformation(init, update),
                  l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier, noise_std=noise_std)


def _private_mean(leaves: list[Tensor], rng_key: Tensor, l2_norm_clip: Any, noise_std: Any,
                  scale: float = 1.0, base: list[Tensor] | None = None) -> tuple[list, Tensor]:
    """``scale`` times the per-example ``leaves`` clipped, summed, noised and averaged (added to
    the ``base`` leaves where given: one ``addmv`` a leaf), and the next key."""
    size = leaves[0].shape[0] if leaves[0].dim() else 0
    if size == 0 or any(g.dim() == 0 or g.shape[0] != size for g in leaves):
        raise ValueError("differentially_private_aggregate takes per-example grads: every "
                         "leaf with the same leading batch dim, of at least one example")
    # optax per_example_global_norm_clip: divide example i by max(||g_i|| / clip, 1); the
    # sum over examples, the division by the batch size and the noise as one addmv a leaf
    rows = [g.reshape(size, math.prod(g.shape[1:])) for g in leaves]
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in leaves))
    wide = torch.promote_types(dtype, torch.float32)
    sizes = [r.shape[1] for r in rows]
    new_key, noise = random._split_normal(rng_key, sum(sizes), dtype)
    if (out := _native_private_sum(leaves, rows, noise, base, l2_norm_clip, scale / size,
                                   scale * noise_std / size)) is not None:
        return out, new_key
    noise.mul_(scale * noise_std / size)
    norms = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(r, 2, dim=1, dtype=wide) for r in rows]), 2, dim=0)
    weights = (scale * l2_norm_clip / size) / torch.clamp(norms, min=l2_norm_clip)
    noise = noise.split(sizes) if base is None else [
        b.reshape(-1) + z for b, z in zip(base, noise.split(sizes), strict=True)]
    weights = {kind: weights.to(kind) for kind in {wide, *(g.dtype for g in leaves)}}
    return [torch.addmv(z if z.dtype == r.dtype else z.to(r.dtype), r.t(), weights[r.dtype])
            .view(g.shape[1:]) for g, r, z in zip(leaves, rows, noise, strict=True)], new_key


def _native_private_sum(leaves: list[Tensor], rows: list[Tensor], noise: Tensor,
                        base: list[Tensor] | None, clip: Any, coef: float,
                        noise_coef: Any) -> list[Tensor] | None:
    """:func:`_private_mean`'s result as one C pass (``_streaming.c``'s minitrain_private_sum):
    each example's norm and weight ``coef * clip / max(norm, clip)``, then per leaf
    ``base + noise_coef * noise + rows.T @ weights``; None unless every tensor is a plain
    contiguous float32 CPU tensor, the numbers floats, and nothing traces or watches."""
    if type(clip) is not float or type(noise_coef) is not float or \
            noise.dtype is not torch.float32 or torch.compiler.is_compiling() or \
            not streaming.quiet() or _torch.forward_ad_active() or \
            (library := _native._library()) is None:
        return None
    found = pointers([rows], dtype=torch.float32)
    held = None if base is None else pointers([base], dtype=torch.float32)
    if found is None or base is not None and (held is None or any(
            b.numel() != r.shape[1] for b, r in zip(base, rows, strict=True))):
        return None
    out = [torch.empty(g.shape[1:], dtype=torch.float32, device="cpu") for g in leaves]
    offsets = itertools.accumulate([0, *(r.shape[1] for r in rows[:-1])])
    addresses = [array.array("Q", values) for values in (
        [r.shape[1] for r in rows], found[0], held[0] if held else [0] * len(rows),
        [noise.data_ptr() + 4 * offset for offset in offsets], [t.data_ptr() for t in out])]
    if library.minitrain_private_sum(len(rows), rows[0].shape[0],
                                     *(a.buffer_info()[0] for a in addresses), clip,
                                     coef * clip, noise_coef, torch.get_num_threads()):
        raise MemoryError("DP-SGD's private sum ran out of memory")
    return out


def dpsgd(learning_rate: ScalarOrSchedule, l2_norm_clip: float | Tensor,
          noise_multiplier: float | Tensor, key: int | Tensor, momentum: float | None = None,
          nesterov: bool = False) -> Optimizer:
    """DP-SGD, optax's ``contrib.dpsgd`` as an optimizer: :func:`differentially_private_aggregate`
    then SGD (``momentum``: :func:`trace`). Without momentum, at a constant learning rate, the
    update is one ``addmv`` a leaf into the params.

    >>> opt, params = dpsgd(0.5, 1.0, 0.0, key=0), {"w": torch.zeros(2)}
    >>> opt.update({"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}, opt.init(params), params)[0]
    {'w': tensor([-0.2250, -0.3000])}
    """
    if nesterov and not momentum:
        raise ValueError("dpsgd: nesterov needs a momentum; pass momentum=0.9, say")
    private = differentially_private_aggregate(l2_norm_clip, noise_multiplier, key)
    tx = chain(private, *([] if momentum is None else [trace(momentum, nesterov=nesterov)]),
               scale_by_learning_rate(one_lr(learning_rate, "learning_rate")))
    fused = momentum is None and type(learning_rate) is float
    clip, noise_std = (spec(private)[1][name] for name in ("l2_norm_clip", "noise_std"))

    def update(grads, state, params, donate=False):  # pure: nothing to donate to
        leaves, structure = _pytree.tree_flatten(grads)
        p_leaves, p_structure = _pytree.tree_flatten(params)
        if fused and p_structure == structure and leaves and isinstance(state, tuple) and \
                len(state) == 2 and type(state[0]) is DifferentiallyPrivateAggregateState and \
                type(state[1]) is ScaleByLearningRateState and \
                all(isinstance(p, Tensor) and isinstance(g, Tensor) and p.is_floating_point()
                    and g.dtype == p.dtype and g.shape[1:] == p.shape
                    for p, g in zip(p_leaves, leaves, strict=True)):
            out, new_key = _private_mean(leaves, state[0].rng_key, clip, noise_std,
                                         -learning_rate, p_leaves)
            lr_state = state[1]._replace(count=state[1].count + 1, lr=f32_tensor(learning_rate))
            return tree.unflatten(structure, out), (DifferentiallyPrivateAggregateState(new_key),
                                                    lr_state)
        updates, state = tx.update(grads, state, params)  # which names any fault
        return apply_updates(params, updates), state

    update.transformation = tx  # type: ignore[attr-defined]
    return Optimizer(tx.init, update)
