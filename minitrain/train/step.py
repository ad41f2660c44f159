"""The pure train step: ``(params, opt_state, batch[, carry]) -> StepOutput``.

Forward and backward run under the backend's autocast; the update runs on the fp32 master
params outside it. A :class:`Carry` holds what a run carries besides params and optimizer state:
model state (BatchNorm statistics; haiku's ``transform_with_state``), fp16's dynamic loss scale
(as ``torch.amp.GradScaler``) and delayed fp8 scaling's amax histories (as Transformer Engine's
``DelayedScaling``; the updated histories come back as their gradient).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from minitrain import precision
from minitrain import random as mt_random
from minitrain._torch import pytree
from minitrain.errors import ExperimentError, ResumeError
from minitrain.func import value_and_grad
from minitrain.precision import Backend, DynamicLossScale, LossScaleState
from minitrain.train.experiment import check_loss_output
from minitrain.train.script_errors import script_call
from minitrain.train.setup import init_params, probe_batch, run_generators, to_backend
from minitrain.tree import Grads, OptState, Params, PyTree, global_norm

__all__ = [
    "Carry", "StepOutput", "can_donate", "carry_metrics", "check_fp8_history", "checked_values",
    "first_step_inputs", "fp8_context", "fp8_recipe_of", "init_carry", "init_fp8_history",
    "keyed_loss", "loss_and_grads", "loss_scale_of", "make_train_step", "pack_checkpoint_state",
    "probe_fp8_history", "stateful_loss", "step_key", "unpack_checkpoint_state", "with_fixed_key",
]


class Carry(NamedTuple):
    """What a step carries besides params and optimizer state (None where a run has none)."""

    model_state: PyTree = None  # buffers a forward pass updates (BatchNorm statistics)
    loss_scale: LossScaleState | None = None  # fp16's dynamic loss scale
    skipped: torch.Tensor | None = None  # 0-d int64: steps skipped for overflow so far
    fp8_history: torch.Tensor | None = None  # (matmuls, 3, history_len) amaxes, delayed fp8


class StepOutput(NamedTuple):
    """What one training step returns."""

    params: Params
    opt_state: OptState
    loss: torch.Tensor
    grad_norm: torch.Tensor
    aux: dict[str, torch.Tensor]
    carry: Carry | None = None
    applied: torch.Tensor | None = None  # 0-d bool under loss scaling: the update was applied


def can_donate(optimizer: Any) -> bool:
    """Whether ``optimizer.update`` takes ``donate=True`` (every mt.optim optimizer does)."""
    from minitrain.optim import Optimizer

    return isinstance(optimizer, Optimizer)


def _pair(value: Any, message: str) -> tuple[Any, Any]:
    """``value`` if it is a pair, else an :class:`ExperimentError` (``message`` names its type)."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ExperimentError(message.format(type(value).__name__))
    return value


def _checked(value: Any, has_aux: bool, message: str) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` from what a loss returned (``loss`` or, with aux, ``(loss, aux)``)."""
    loss, aux = _pair(value, message) if has_aux else (value, {})
    check_loss_output(loss, aux)
    return loss, aux


def step_key(seed: int, step: int) -> torch.Tensor:
    """The key the loss of an experiment with ``uses_key`` gets at ``step``.

    ``fold_in(key(seed), step)``: a function of the seed and the step alone, so a resumed run
    draws what an uninterrupted one would.

    >>> bool((step_key(0, 3) == mt_random.fold_in(mt_random.key(0), 3)).all())
    True
    """
    return mt_random.fold_in(mt_random.key(seed), step)


def keyed_loss(experiment: Any) -> Callable[..., Any]:
    """``experiment.loss(*args, key=key)`` when it ``uses_key``, else ``experiment.loss(*args)``."""
    if not getattr(experiment, "uses_key", False):
        return lambda *args, key=None: experiment.loss(*args)

    def with_key(*args: Any, key: torch.Tensor | None = None) -> Any:
        if key is None:
            raise ValueError("this experiment has uses_key=True: pass the step its key, "
                             "step_key(seed, step)")
        return experiment.loss(*args, key=key)

    return with_key


def with_fixed_key(experiment: Any, seed: int = 0, step: int = 1) -> Any:
    """``experiment`` whose loss always gets ``step_key(seed, step)`` (a step measured or
    predicted on its own); one without ``uses_key`` as it is."""
    if not getattr(experiment, "uses_key", False):
        return experiment
    loss = functools.partial(experiment.loss, key=step_key(seed, step))
    return dataclasses.replace(experiment, loss=loss, uses_key=False)


def stateful_loss(experiment: Any
                  ) -> Callable[[Params, PyTree, PyTree], tuple[torch.Tensor, tuple[dict, PyTree]]]:
    """The experiment's loss as ``(params, model_state, batch, key=None) -> (loss, (aux,
    new_state))``.

    >>> import torch, minitrain as mt
    >>> exp = mt.Experiment(init=lambda g: {"w": torch.ones(2)},
    ...     init_state=lambda g: {"n": torch.tensor(0)},
    ...     loss=lambda p, s, x: ((x @ p["w"]).mean(), {"n": s["n"] + 1}),
    ...     next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1), steps=1)
    >>> stateful_loss(exp)({"w": torch.ones(2)}, {"n": torch.tensor(0)}, torch.ones(4, 2))
    (tensor(2.), ({}, {'n': tensor(1)}))
    """
    call = keyed_loss(experiment)
    if getattr(experiment, "init_state", None) is None:
        shape = "the loss returned {}; with has_aux=True return a (loss, aux dict) pair"

        def stateless(params: Params, model_state: PyTree, batch: PyTree, key: Any = None):
            loss, aux = _checked(call(params, batch, key=key), experiment.has_aux, shape)
            return loss, (aux, None)

        return stateless

    pair = ("the loss returned {}; an experiment with init_state has a loss(params, state, "
            "batch) that returns (loss, new_state)"
            + (" with loss a (loss, aux) pair" if experiment.has_aux else ""))
    inner = "with has_aux=True and init_state the loss returns ((loss, aux), new_state)"

    def with_state(params: Params, model_state: PyTree, batch: PyTree, key: Any = None):
        value, new_state = _pair(call(params, model_state, batch, key=key), pair)
        loss, aux = _checked(value, experiment.has_aux, inner)
        if pytree.tree_structure(model_state) != pytree.tree_structure(new_state):
            raise ExperimentError(
                "the loss's new state is not shaped like the state it was given (init_state's); "
                "return the new_state that apply(params, state, ...) returned"
            )
        return loss, (aux, new_state)

    return with_state


def loss_scale_of(experiment: Any, backend: Backend) -> DynamicLossScale | None:
    """The dynamic loss scale of a run on ``backend`` (None unless its policy scales the loss)."""
    if not backend.policy.loss_scaling:
        return None
    return getattr(experiment, "loss_scale", None) or precision.dynamic_loss_scale()


def fp8_recipe_of(backend: Backend) -> precision.Recipe | None:
    """The fp8 recipe of a backend that scales its matmuls from amax histories, else None.

    >>> import minitrain as mt
    >>> fp8_recipe_of(mt.get_backend("cpu-fp8")).forward, fp8_recipe_of(mt.get_backend("cpu"))
    ('fp8_e4m3', None)
    """
    return precision.delayed_scaling(backend.policy)


def fp8_context(backend: Backend) -> Callable[[], contextlib.AbstractContextManager]:
    """The context of a forward that simulates its own fp8 matmuls: autocast without matmul mode."""
    policy = precision.without_matmul_format(backend.policy)
    return lambda: precision.compute_context(policy, backend.device)


def init_fp8_history(experiment: Any, backend: Backend, params: Params, model_state: PyTree,
                     batch: PyTree, key: torch.Tensor | None = None) -> torch.Tensor:
    """Empty amax histories for every matmul one forward pass (with ``key``) runs on ``batch``."""
    recipe = fp8_recipe_of(backend)
    loss = functools.partial(stateful_loss(experiment), key=key)
    with fp8_context(backend)():
        count = precision.count_matmuls(loss, params, model_state, batch)
    return precision.init_state(recipe, count).to(backend.device)


def probe_fp8_history(experiment: Any, backend: Backend, params: Params, model_state: PyTree,
                      generator: torch.Generator, shard: Callable | None = None,
                      seed: int = 0) -> torch.Tensor:
    """:func:`init_fp8_history` on the first step's batch, drawn from a copy of ``generator``."""
    batch = probe_batch(experiment, generator)
    batch = backend.to_device(batch if shard is None else shard(batch))
    key = step_key(seed, 1).to(backend.device)
    with script_call("the train step (loss)", 1):
        return init_fp8_history(experiment, backend, params, model_state, batch, key)


def init_carry(experiment: Any, backend: Backend, generator: torch.Generator) -> Carry | None:
    """The step's first :class:`Carry` (None when the run carries nothing).

    >>> import torch, minitrain as mt
    >>> exp = mt.Experiment(init=lambda g: {"w": torch.ones(2)}, loss=lambda p, x: p["w"].sum(),
    ...     next_batch=lambda g: None, optimizer=mt.optim.sgd(lr=0.1), steps=1)
    >>> init_carry(exp, mt.get_backend("cpu-fp16"), torch.Generator()).loss_scale.scale
    tensor(65536.)
    """
    init_state = getattr(experiment, "init_state", None)
    loss_scale = loss_scale_of(experiment, backend)
    if init_state is None and loss_scale is None:
        return None
    model_state = None if init_state is None else to_backend(init_state(generator), backend)
    if loss_scale is None:
        return Carry(model_state)
    scale = backend.to_device(loss_scale.init())
    return Carry(model_state, LossScaleState(*scale), backend.to_device(torch.tensor(0)))


def first_step_inputs(experiment: Any, backend: Backend, seed: int = 0
                      ) -> tuple[Params, OptState, PyTree, Carry | None]:
    """``(params, opt_state, batch, carry)`` of a run's first step, drawn from ``seed`` as
    ``minitrain run`` draws them: the inputs of a step measured on its own."""
    init_generator, data_generator = run_generators(seed)
    params = init_params(experiment, init_generator, backend)
    opt_state = experiment.optimizer.init(params)
    carry = init_carry(experiment, backend, init_generator)
    return params, opt_state, backend.to_device(experiment.next_batch(data_generator)), carry


def checked_values(out: StepOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(loss, grad_norm)`` the finiteness check reads (a step skipped for overflow reads 0).
    """
    loss, norm = out.loss.detach(), out.grad_norm.detach()
    if out.applied is None:
        return loss, norm
    expected = ~out.applied & (out.carry.loss_scale.scale > 0)
    zero = torch.zeros((), device=loss.device)
    return torch.where(expected, zero, loss.float()), torch.where(expected, zero, norm.float())


def carry_metrics(carry: Carry | None) -> dict[str, float]:
    """What a step's carry adds to ``metrics.jsonl``: ``loss_scale`` and ``skipped``."""
    if carry is None or carry.loss_scale is None:
        return {}
    return {"loss_scale": float(carry.loss_scale.scale), "skipped": int(carry.skipped)}


def pack_checkpoint_state(opt_state: OptState, carry: Carry | None) -> PyTree:
    """The tree a checkpoint's ``opt_state`` file holds (the optimizer state alone without carry).
    """
    if carry is None:
        return opt_state
    packed = {"optimizer": opt_state}
    if carry.model_state is not None:
        packed["model_state"] = carry.model_state
    if carry.loss_scale is not None:
        packed["loss_scale"] = carry.loss_scale._asdict()
        packed["skipped"] = carry.skipped
    if carry.fp8_history is not None:
        packed["fp8_history"] = carry.fp8_history
    return packed


def unpack_checkpoint_state(packed: PyTree, carry: Carry | None) -> tuple[OptState, Carry | None]:
    """Inverse of :func:`pack_checkpoint_state` (``carry`` tells which parts are there)."""
    if carry is None:
        return packed, None
    scale = None if carry.loss_scale is None else LossScaleState(**packed["loss_scale"])
    carry = Carry(packed.get("model_state"), scale, packed.get("skipped"),
                  packed.get("fp8_history"))
    return packed["optimizer"], carry


def check_fp8_history(history: torch.Tensor | None, where: str) -> None:
    """Refuse amax histories with NaN, inf or negative entries, naming ``where`` they came from."""
    if history is None:
        return
    bad = ~torch.isfinite(history) | (history < 0)
    if bool(bad.any()):
        raise ResumeError(
            f"{where}: its fp8_history holds {int(bad.sum())} entries that are not amaxes (NaN, "
            "inf or negative: edited by hand?); move that checkpoint away to resume from an "
            "earlier one, or pass --overwrite"
        )


# (grads, loss, aux) -> (grads, loss, aux), applied between the backward pass and the update.
GradTransform = Callable[[Grads, torch.Tensor, dict], tuple[Grads, torch.Tensor, dict]]


def make_train_step(experiment: Any, backend: Backend, grad_transform: GradTransform | None = None,
                    donate: bool = False, compile: bool = False,
                    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> Callable[..., StepOutput]:
    """Build the pure step ``(params, opt_state, batch, carry=None, key=None) -> StepOutput``.

    ``grad_transform(grads, loss, aux)`` runs before clipping (data parallel's all-reduce),
    ``amax_reduce`` on the fp8 histories. ``donate=True`` lets the update write into its inputs;
    ``compile=True`` compiles forward and backward; ``key`` goes to a ``uses_key`` loss. Under
    loss scaling a step with non-finite grads changes nothing (``applied`` is False).

    >>> import torch, minitrain as mt
    >>> exp = mt.Experiment(init=lambda g: {"w": torch.zeros(2)},
    ...     loss=lambda p, x: ((x @ p["w"] - 1) ** 2).mean(),
    ...     next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1), steps=1)
    >>> step = make_train_step(exp, mt.get_backend("cpu"))
    >>> params = {"w": torch.zeros(2)}
    >>> out = step(params, exp.optimizer.init(params), torch.ones(4, 2))
    >>> out.loss, out.params
    (tensor(1.), {'w': tensor([0.2000, 0.2000])})
    """
    loss_scale = loss_scale_of(experiment, backend)
    needs_state = getattr(experiment, "init_state", None) is not None
    recipe = fp8_recipe_of(backend)
    gradients = loss_and_grads(experiment, backend, loss_scale, compile)
    clip, update = _clip(experiment.max_grad_norm), _update(experiment.optimizer, donate)

    def train_step(params: Params, opt_state: OptState, batch: PyTree,
                   carry: Carry | None = None, key: torch.Tensor | None = None) -> StepOutput:
        if carry is None and needs_state:
            raise ValueError(
                "this experiment has model state (init_state): pass the step its carry, "
                "init_carry(experiment, backend, generator) at the start"
            )
        if carry is None and (loss_scale is not None or recipe is not None):
            carry = Carry(None, *((loss_scale.init(), torch.tensor(0)) if loss_scale else ()))
        model_state, scale, _, history = carry if carry is not None else (None,) * 4
        if recipe is not None and history is None:  # the first step counts its matmuls
            history = init_fp8_history(experiment, backend, params, model_state, batch, key)
        (_, (loss, aux, model_state, forward_history)), grads = gradients(
            params, model_state, scale, history, batch, key
        )
        if recipe is not None:
            grads, new_history = grads  # a matmul whose backward did not run keeps its forward's
            ran = new_history.flatten(1).ne(0).any(dim=1).view(-1, 1, 1)
            history = torch.where(ran, new_history, forward_history)
            if amax_reduce is not None:
                history = amax_reduce(history)
        if grad_transform is not None:
            grads, loss, aux = grad_transform(grads, loss, aux)
        finite = None
        if scale is not None:  # GradScaler.unscale_ (after any all-reduce), before clipping
            grads, finite, scale = loss_scale.unscale_and_check(grads, scale)
        grads, grad_norm = clip(grads)  # the unclipped grads are freed before the update
        params, opt_state = update(grads, opt_state, params, finite)
        if carry is not None:
            skipped = carry.skipped
            if finite is not None:
                skipped = skipped + (~finite).to(skipped.dtype)
            carry = Carry(model_state if needs_state else None, scale, skipped, history)
        return StepOutput(params, opt_state, loss, grad_norm, aux, carry, finite)

    return train_step


def loss_and_grads(experiment: Any, backend: Backend, loss_scale: DynamicLossScale | None = None,
                   compile: bool = False) -> Callable[..., Any]:
    """``(params, model_state, scale, history, batch, key) -> ((scaled, aux tuple), grads)``.

    On a delayed-fp8 backend ``grads`` is ``(grads, new_history)``.
    """
    loss_fn, recipe = stateful_loss(experiment), fp8_recipe_of(backend)

    def objective(params: Params, model_state: PyTree, scale: Any, history: Any, batch: PyTree,
                  key: Any = None):
        fp8 = contextlib.nullcontext() if recipe is None else precision.simulate(recipe, history)
        with fp8 as simulation:
            loss, (aux, new_state) = loss_fn(params, model_state, batch, key)
        scaled = loss if scale is None else loss_scale.scale_loss(loss, scale)
        forward = None if simulation is None else simulation.forward_history()
        # torch.func's aux holds tensors only: a stateless run's None travels as ()
        return scaled, (loss.detach(), aux, () if new_state is None else new_state,
                        () if forward is None else forward)

    simulates = backend.policy.matmul_format is not None
    if compile and not simulates:  # nanoGPT's torch.compile(model): AOTAutograd, and no functorch
        objective = torch.compile(objective)
    gradients = value_and_grad(objective, argnums=0 if recipe is None else (0, 3), has_aux=True)
    context = backend.autocast if recipe is None else fp8_context(backend)

    def loss_and_grads(params: Params, model_state: PyTree, scale: Any, history: Any,
                       batch: PyTree, key: Any = None):
        with context():
            return gradients(params, model_state, scale, history, batch, key)

    if compile and simulates:  # the simulated matmuls run eager, between compiled regions
        loss_and_grads = torch.compile(loss_and_grads)
    return loss_and_grads


def _clip(max_grad_norm: Any) -> Callable[[Grads], tuple[Grads, torch.Tensor]]:
    """``grads -> (grads, global norm)``, clipped to ``max_grad_norm`` unless it is None."""
    if max_grad_norm is None:
        return lambda grads: (grads, global_norm(grads))
    from minitrain.optim import clip_by_global_norm

    return lambda grads: clip_by_global_norm(grads, max_grad_norm)


def _update(optimizer: Any, donate: bool) -> Callable[..., tuple[Params, OptState]]:
    """``(grads, opt_state, params, finite) -> (params, opt_state)``, applied only where ``finite``.
    """
    options = {"donate": True} if donate else {}  # mt.optim's update takes donate=

    def update(grads: Grads, opt_state: OptState, params: Params, finite: Any) -> tuple:
        if finite is None or donate and bool(finite):  # a donated update overwrites its inputs:
            return optimizer.update(grads, opt_state, params, **options)  # decide before it
        if donate:
            return params, opt_state
        new_params, new_state = optimizer.update(grads, opt_state, params)
        select = precision.select_tree
        return select(finite, new_params, params), select(finite, new_state, opt_state)
    return update
