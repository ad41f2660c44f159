"""The pure train step: ``(params, opt_state, batch) -> StepOutput``.

Forward and backward run under the backend's autocast context; the optimizer update runs on the
fp32 master params outside it. Nothing is mutated: the step returns new params and state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from minitrain.backend import Backend
from minitrain.func import value_and_grad
from minitrain.tree import Grads, OptState, Params, PyTree, global_norm

__all__ = ["StepOutput", "can_donate", "make_train_step", "loss_with_aux"]


class StepOutput(NamedTuple):
    """What one training step returns."""

    params: Params
    opt_state: OptState
    loss: torch.Tensor
    grad_norm: torch.Tensor
    aux: dict[str, torch.Tensor]


def can_donate(optimizer: Any) -> bool:
    """Whether ``optimizer.update`` takes ``donate=True`` (every mt.optim optimizer does)."""
    from minitrain.optim import Optimizer

    return isinstance(optimizer, Optimizer)


def loss_with_aux(experiment: Any) -> Callable[[Params, PyTree], tuple[torch.Tensor, dict]]:
    """The experiment's loss as ``(params, batch) -> (loss, aux)`` whether or not it has aux."""
    if experiment.has_aux:
        return experiment.loss
    return lambda params, batch: (experiment.loss(params, batch), {})


# (grads, loss, aux) -> (grads, loss, aux), applied between the backward pass and the update.
GradTransform = Callable[[Grads, torch.Tensor, dict], tuple[Grads, torch.Tensor, dict]]


def make_train_step(
    experiment: Any,
    backend: Backend,
    grad_transform: GradTransform | None = None,
    donate: bool = False,
    compile: bool = False,
) -> Callable[[Params, OptState, PyTree], StepOutput]:
    """Build the pure step for ``experiment`` on ``backend``.

    ``grad_transform(grads, loss, aux) -> (grads, loss, aux)`` runs between the backward pass
    and clipping/update: data parallelism passes its all-reduce here
    (:meth:`minitrain.distributed.DataParallel.reduce`). With ``donate=True`` (an mt.optim
    optimizer only) the update writes the new params and state into the buffers of the old
    ones, as ``torch.optim`` does: the caller must not use the params and state it passed in
    again. The fit loop donates; the step stays pure without it. ``compile=True`` runs the
    forward and backward pass through ``torch.compile``; the gradient transform, clipping and
    the update stay eager, where they run torch's fused kernels or minitrain's streaming ones
    (and can donate) instead of inductor's out-of-place loops.

    >>> import torch, minitrain as mt
    >>> from minitrain.train import Experiment
    >>> exp = Experiment(init=lambda g: {"w": torch.zeros(2)},
    ...     loss=lambda p, x: ((x @ p["w"] - 1) ** 2).mean(),
    ...     next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1), steps=1)
    >>> step = make_train_step(exp, mt.get_backend("cpu"))
    >>> params = {"w": torch.zeros(2)}
    >>> out = step(params, exp.optimizer.init(params), torch.ones(4, 2))
    >>> out.loss, out.params
    (tensor(1.), {'w': tensor([0.2000, 0.2000])})
    """
    gradients = value_and_grad(loss_with_aux(experiment), has_aux=True)

    def loss_and_grads(params: Params, batch: PyTree):
        with backend.autocast():
            return gradients(params, batch)

    if compile:
        loss_and_grads = torch.compile(loss_and_grads)
    optimizer = experiment.optimizer
    max_grad_norm = experiment.max_grad_norm
    update_options = {"donate": True} if donate else {}
    if donate and not can_donate(optimizer):
        raise ValueError("donate=True needs an mt.optim optimizer (its update takes donate=)")

    def train_step(params: Params, opt_state: OptState, batch: PyTree) -> StepOutput:
        (loss, aux), grads = loss_and_grads(params, batch)
        if grad_transform is not None:
            grads, loss, aux = grad_transform(grads, loss, aux)
        if max_grad_norm is not None:
            from minitrain.optim import clip_by_global_norm

            grads, grad_norm = clip_by_global_norm(grads, max_grad_norm)
        else:
            grad_norm = global_norm(grads)
        params, opt_state = optimizer.update(grads, opt_state, params, **update_options)
        return StepOutput(params, opt_state, loss.detach(), grad_norm, aux)

    return train_step
