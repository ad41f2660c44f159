"""Mixed-precision policies and functional dynamic loss scaling.

A :class:`Policy` says which dtype params are stored in, which the math runs in, and which the
outputs come back in (jmp's ``Policy``), plus an optional simulated low-precision matmul format
(:mod:`minitrain.lowp`) and whether fp16's loss scaling is needed. :func:`compute_context` is
the one context manager a train step wraps its forward and backward pass in (nanoGPT's
``nullcontext()`` or ``torch.amp.autocast(...)``, and the simulated fp8 / MX / NVFP4 matmuls).

Loss scaling is ``torch.amp.GradScaler`` rewritten as pure functions over a
:class:`LossScaleState` of 0-d tensors, equal to it step for step (same scale trajectory, same
skipped steps), and vmappable: each member of a sweep carries its own scale.

>>> import torch
>>> p = policy("bf16")
>>> p.cast_to_compute({"w": torch.ones(2), "step": torch.tensor(3)})
{'w': tensor([1., 1.], dtype=torch.bfloat16), 'step': tensor(3)}
>>> with compute_context(p, "cpu"):
...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
torch.bfloat16
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from minitrain import lowp
from minitrain.tree import Grads, Params, PyTree

__all__ = [
    "Policy",
    "POLICIES",
    "policy",
    "compute_context",
    "delayed_scaling",
    "without_matmul_format",
    "LossScaleState",
    "DynamicLossScale",
    "dynamic_loss_scale",
    "all_finite",
    "select_tree",
    "scaled_value_and_grad",
]


def _cast_floats(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Cast the floating-point tensor leaves of ``tree`` to ``dtype``; leave the rest."""

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.to(dtype)
        return leaf

    return torch.utils._pytree.tree_map(cast, tree)


class Policy(NamedTuple):
    """Where params live, what the math runs in, what outputs come back as (jmp's Policy)."""

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    matmul_format: str | None = None  # a minitrain.lowp recipe: fp8, mxfp8, mxfp4, nvfp4
    loss_scaling: bool = False  # fp16: scale the loss so small grads do not flush to zero

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating-point leaves of ``tree`` in ``compute_dtype``."""
        return _cast_floats(tree, self.compute_dtype)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Floating-point leaves of ``tree`` in ``param_dtype``."""
        return _cast_floats(tree, self.param_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Floating-point leaves of ``tree`` in ``output_dtype``."""
        return _cast_floats(tree, self.output_dtype)


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
POLICIES = {
    "fp32": Policy(),
    "bf16": Policy(_F32, _BF16, _F32),  # the chapter's 3.5.9 recipe: no loss scaling needed
    "fp16": Policy(_F32, _F16, _F32, loss_scaling=True),  # Micikevicius et al. 2018
    "fp8": Policy(matmul_format="fp8"),  # Transformer Engine: e4m3 forward, e5m2 backward
    "mxfp8": Policy(matmul_format="mxfp8"),
    "mxfp4": Policy(matmul_format="mxfp4"),
    "nvfp4": Policy(matmul_format="nvfp4"),
}


def policy(name: str | Policy) -> Policy:
    """A preset policy by name: ``fp32``, ``bf16``, ``fp16``, ``fp8``, ``mxfp8``, ``mxfp4``,
    ``nvfp4`` (fp32 master params in every one).

    >>> policy("fp16").loss_scaling, policy("fp8").matmul_format
    (True, 'fp8')
    """
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown precision policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name]


@contextlib.contextmanager
def compute_context(
    p: Policy | str, device: torch.device | str = "cpu", fp8_state: torch.Tensor | None = None
) -> Iterator[None]:
    """The context for forward and backward: autocast to ``compute_dtype`` where it differs from
    ``param_dtype``, and simulated low-precision matmuls where the policy names a format
    (``fp8_state``: amax histories for delayed fp8 scaling, see :func:`minitrain.lowp.simulate`).

    >>> with compute_context("fp8"):
    ...     (torch.tensor([[1.0, 3.3]]) @ torch.eye(2)).tolist()
    [[0.9428570866584778, 3.299999713897705]]
    """
    p = policy(p)
    device_type = torch.device(device).type
    with contextlib.ExitStack() as stack:
        if p.compute_dtype != p.param_dtype:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=p.compute_dtype))
        if p.matmul_format is not None:
            stack.enter_context(lowp.simulate(p.matmul_format, fp8_state))
        yield


def delayed_scaling(p: Policy | str) -> lowp.Recipe | None:
    """The fp8 recipe whose per-tensor scales a training run takes from an amax history
    (Transformer Engine's ``DelayedScaling``), or None: block formats scale from their blocks,
    and a policy without a matmul format has nothing to scale.

    >>> delayed_scaling("fp8").history_len, delayed_scaling("mxfp8"), delayed_scaling("bf16")
    (16, None, None)
    """
    p = policy(p)
    if p.matmul_format is None:
        return None
    r = lowp.recipe(p.matmul_format)
    return r if r.forward in lowp.PER_TENSOR else None


def without_matmul_format(p: Policy | str) -> Policy:
    """The policy with its matmuls left at the compute dtype: the context a train step enters
    around a forward pass that runs its own :func:`minitrain.lowp.simulate` (delayed scaling
    needs the amax history as an argument of the differentiated function)."""
    return policy(p)._replace(matmul_format=None)


# ---------------------------------------------------------------------------------------------
# Dynamic loss scaling, functional (torch.amp.GradScaler's arithmetic)


class LossScaleState(NamedTuple):
    """GradScaler's two counters as 0-d tensors: the scale (fp32) and the number of finite steps
    since the last change (int32)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor


class DynamicLossScale(NamedTuple):
    """``init() -> state``; ``scale_loss(loss, state)``; ``unscale_and_check(grads, state) ->
    (grads, finite, new_state)``."""

    init: Callable[[], LossScaleState]
    scale_loss: Callable[[torch.Tensor, LossScaleState], torch.Tensor]
    unscale_and_check: Callable[[Grads, LossScaleState], tuple[Grads, torch.Tensor, LossScaleState]]


def all_finite(tree: PyTree) -> torch.Tensor:
    """0-d bool: whether every element of every tensor leaf is finite.

    >>> all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])})
    tensor(False)
    """
    leaves = [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    if not leaves:
        return torch.tensor(True)
    return torch.stack([torch.isfinite(t).all() for t in leaves]).all()


def select_tree(pred: torch.Tensor, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leaf by leaf ``torch.where(pred, on_true, on_false)``: a branch that works under vmap.

    >>> select_tree(torch.tensor(False), {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    {'w': tensor([0., 0.])}
    """

    def pick(a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.where(pred, a, b)
        return a

    return torch.utils._pytree.tree_map(pick, on_true, on_false)


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> DynamicLossScale:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s defaults and arithmetic.

    The loss is multiplied by the scale; grads are multiplied by ``1 / scale`` (computed in
    float64, then rounded to fp32, as GradScaler does); a step whose scaled grads hold an inf or
    NaN is skipped and the scale is multiplied by ``backoff_factor``; after ``growth_interval``
    finite steps in a row it is multiplied by ``growth_factor`` if the result stays finite
    (``torch._amp_update_scale_``).

    >>> ls = dynamic_loss_scale(init_scale=8.0, growth_interval=2)
    >>> state = ls.init()
    >>> grads, finite, state = ls.unscale_and_check({"w": torch.tensor([16.0])}, state)
    >>> grads, finite, state.scale
    ({'w': tensor([2.])}, tensor(True), tensor(8.))
    >>> _, finite, state = ls.unscale_and_check({"w": torch.tensor([float("inf")])}, state)
    >>> finite, state.scale, state.growth_tracker
    (tensor(False), tensor(4.), tensor(0, dtype=torch.int32))
    """
    if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
        raise ValueError(
            f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor} and "
            f"{backoff_factor}"
        )
    if growth_interval < 1 or init_scale <= 0:
        raise ValueError("growth_interval must be >= 1 and init_scale > 0")

    def init() -> LossScaleState:
        return LossScaleState(
            torch.tensor(init_scale, dtype=torch.float32), torch.tensor(0, dtype=torch.int32)
        )

    def scale_loss(loss: torch.Tensor, state: LossScaleState) -> torch.Tensor:
        return loss * state.scale.to(loss.device)  # GradScaler.scale: outputs * self._scale

    def unscale_and_check(
        grads: Grads, state: LossScaleState
    ) -> tuple[Grads, torch.Tensor, LossScaleState]:
        finite = all_finite(grads)  # _amp_foreach_non_finite_check_and_unscale_
        inv_scale = state.scale.double().reciprocal().float()  # GradScaler.unscale_
        grads = torch.utils._pytree.tree_map(lambda g: g * inv_scale, grads)
        # _amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp)
        successful = state.growth_tracker + 1
        grown = (state.scale.double() * growth_factor).float()
        grow = successful == growth_interval
        scale = torch.where(
            finite,
            torch.where(grow & torch.isfinite(grown), grown, state.scale),
            (state.scale.double() * backoff_factor).float(),
        )
        tracker = torch.where(finite & ~grow, successful, torch.zeros_like(successful))
        return grads, finite, LossScaleState(scale, tracker)

    return DynamicLossScale(init, scale_loss, unscale_and_check)


def scaled_value_and_grad(
    loss_fn: Callable[..., Any], loss_scale: DynamicLossScale, has_aux: bool = False
) -> Callable[..., tuple[Any, Grads, torch.Tensor, LossScaleState]]:
    """``f(params, scale_state, *args) -> (value, grads, finite, new_scale_state)``.

    ``value`` is the unscaled loss (``(loss, aux)`` with ``has_aux``); grads are unscaled. The
    caller applies its update only where ``finite`` (use :func:`select_tree` to stay pure and
    vmappable), as ``GradScaler.step`` skips ``optimizer.step()``.

    >>> ls = dynamic_loss_scale(init_scale=4.0)
    >>> f = scaled_value_and_grad(lambda p, x: (p["w"] * x).sum(), ls)
    >>> loss, grads, finite, state = f({"w": torch.ones(2)}, ls.init(), torch.tensor([1.0, 2.0]))
    >>> loss, grads, finite
    (tensor(3.), {'w': tensor([1., 2.])}, tensor(True))
    """

    def scaled(params: Params, state: LossScaleState, *args: Any, **kwargs: Any):
        out = loss_fn(params, *args, **kwargs)
        loss, aux = out if has_aux else (out, {})
        return loss_scale.scale_loss(loss, state), (loss.detach(), aux)

    grad_and_value = torch.func.grad_and_value(scaled, has_aux=True)

    def wrapped(params: Params, state: LossScaleState, *args: Any, **kwargs: Any):
        grads, (_, (loss, aux)) = grad_and_value(params, state, *args, **kwargs)
        grads, finite, state = loss_scale.unscale_and_check(grads, state)
        return ((loss, aux) if has_aux else loss), grads, finite, state

    return wrapped
