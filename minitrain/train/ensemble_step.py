"""The vmapped ensemble step: every member's train step at once, diverged members frozen."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from minitrain import rng
from minitrain._torch import pytree as _pytree
from minitrain.errors import ExperimentError
from minitrain.precision import Backend
from minitrain.train.experiment import Experiment
from minitrain.train.members import Ensemble, Member, MemberMismatch, member_label
from minitrain.train.script_errors import raised_at
from minitrain.train.step import Carry, StepOutput, fp8_recipe_of, loss_scale_of, make_train_step
from minitrain.tree import OptState, Params, PyTree, leaves, named_leaves, unstack

__all__ = [
    "EnsembleStepOutput", "batches_ignore_swept_values", "check_members", "draw_batches",
    "make_ensemble_step", "make_member_step", "shared_by_seed", "single_run_steps",
]

class EnsembleStepOutput(NamedTuple):
    """One ensemble step: stacked params and state, per-member ``(K,)`` losses and norms."""

    params: Params
    opt_state: OptState
    loss: torch.Tensor
    grad_norm: torch.Tensor
    aux: dict[str, torch.Tensor]
    diverged_at: torch.Tensor
    fp8_history: torch.Tensor | None = None  # (K, matmuls, 3, history_len): delayed fp8


def make_member_step(experiment: Experiment, backend: Backend) -> Callable[..., StepOutput]:
    """One member's train step: :func:`~minitrain.train.step.make_train_step`, whose ops all
    batch under vmap (clipping by a swept ``max_grad_norm`` too), for a run that carries no
    model state or loss scale (sweeps carry neither)."""
    if getattr(experiment, "init_state", None) is not None:
        raise ExperimentError(
            "minitrain sweep does not carry model state (init_state) yet; train each config "
            "with minitrain run --set ..."
        )
    if loss_scale_of(experiment, backend) is not None:
        raise ExperimentError(
            f"minitrain sweep does not carry a loss scale yet ({backend.name} scales the loss); "
            "sweep on cpu-bf16, or train each config with minitrain run --backend "
            f"{backend.name}"
        )
    return make_train_step(experiment, backend)


def batches_ignore_swept_values(ensemble: Ensemble) -> bool:
    """Whether ``next_batch`` never reads a swept value (probed on one draw of the template)."""
    binding = ensemble.binding
    before = binding.reads
    ensemble.template.next_batch(rng.generator(0))
    return binding.reads == before


def shared_by_seed(
    members: Sequence[Member], generators: list[torch.Generator]
) -> list[torch.Generator]:
    """One data generator per seed: members with one seed draw the same batches anyway."""
    by_seed: dict[int, torch.Generator] = {}
    return [
        by_seed.setdefault(member.seed, generator)
        for member, generator in zip(members, generators, strict=True)
    ]


def draw_batches(
    experiments: Sequence[Experiment], generators: list[torch.Generator]
) -> list[PyTree]:
    """Each member's next batch; members sharing a generator object share one draw."""
    drawn: dict[int, PyTree] = {}
    batches = []
    for experiment, generator in zip(experiments, generators, strict=True):
        if id(generator) not in drawn:
            drawn[id(generator)] = experiment.next_batch(generator)
        batches.append(drawn[id(generator)])
    return batches


def make_ensemble_step(ensemble: Ensemble, backend: Backend) -> Callable[..., EnsembleStepOutput]:
    """``step(params, opt_state, batch, hyperparameters, diverged_at, step_number, fp8_history,
    keys)``, ``keys`` each member's :func:`~minitrain.train.step.step_key` (``uses_key``).

    One vmapped train step of every member; a member whose loss or grad norm is not finite, or
    that diverged before, keeps its params and state (``diverged_at`` records the step).
    """
    member_step = make_member_step(ensemble.template, backend)
    binding = ensemble.binding
    fp8, keyed = fp8_recipe_of(backend) is not None, ensemble.template.uses_key
    specs: dict[str, Any] = {}  # the inputs' and outputs' structures, set by each step

    # vmap walks its inputs' and outputs' trees several times per call: it gets flat lists, and
    # the step flattens and unflattens each tree once
    def flat_step(flat: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        (params, opt_state, history), (batch, values, key) = _pytree.tree_unflatten(
            flat, specs["in"])
        with binding.bind(values):
            out = member_step(params, opt_state, batch,
                              Carry(fp8_history=history) if fp8 else None, key if keyed else None)
        # vmap returns tensors only: sweeps carry no model state or loss scale (refuse_carry),
        # and the fp8 histories travel bare
        history = out.carry.fp8_history if fp8 else ()
        kept, _ = _pytree.tree_flatten((out.params, out.opt_state, history))
        rest, specs["rest"] = _pytree.tree_flatten((out.loss, out.grad_norm, out.aux))
        return kept, rest

    vmapped = torch.func.vmap(flat_step, randomness="different")
    attention = _batchable_attention(backend)

    def ensemble_step(params: Params, opt_state: OptState, batch: PyTree,
                      hyperparameters: dict[str, torch.Tensor], diverged_at: torch.Tensor,
                      step_number: int, fp8_history: torch.Tensor | None = None,
                      keys: torch.Tensor | None = None) -> EnsembleStepOutput:
        state = (params, opt_state, fp8_history if fp8 else ())
        flat, specs["in"] = _pytree.tree_flatten((state, (batch, hyperparameters,
                                                          keys if keyed else ())))
        with attention(), _vmap_errors(step_number):
            new, rest = vmapped(flat)
        loss, grad_norm, aux = _pytree.tree_unflatten(rest, specs["rest"])
        alive = diverged_at == 0
        healthy = alive & torch.isfinite(loss) & torch.isfinite(grad_norm)
        diverged_at = torch.where(alive & ~healthy, step_number, diverged_at)
        # the step returns the state's leaves in the order it took them
        new_params, new_state, history = _pytree.tree_unflatten(
            _keep_where(healthy, new, flat[:len(new)]), specs["in"].child(0))
        return EnsembleStepOutput(new_params, new_state, loss, grad_norm, aux, diverged_at,
                                  history if fp8 else None)

    return ensemble_step


# What torch.func says when the script does what one vmapped step cannot, and what to write
_UNBATCHABLE = (
    (("data-dependent control flow", "calling .item() on a Tensor"),
     "turns a tensor that differs between members (the step count, a batch value, a swept "
     "value) into a Python bool or number (an if, while, and/or, float() or .item()); one step "
     "runs every member at once, so compute with tensor ops instead: torch.where(step > 10, a, "
     "b) or a 0/1 mask, not if; tensors, not float() or .item()"),
    (("mutate a captured Tensor", "inplace arithmetic(self, *extra_args) is not possible"),
     "writes in place into a tensor the loss did not make (one made by experiment(config), or "
     "torch.as_tensor() of a swept value, which holds member 0's value there), which every "
     "member's step shares; compute a new tensor from the value itself instead (y = x * 2, not "
     "x.mul_(2); config[\"lr\"] * 2, not torch.as_tensor(config[\"lr\"]).mul_(2))"),
)


@contextlib.contextmanager
def _vmap_errors(step: int) -> Iterator[None]:
    """Refuse, in one line naming the script's line, what the vmapped step cannot run."""
    try:
        yield
    except RuntimeError as exc:
        for patterns, message in _UNBATCHABLE:
            if any(pattern in str(exc) for pattern in patterns):
                frame = raised_at(exc)
                where = "" if frame is None else (
                    f" ({Path(frame.filename).name} line {frame.lineno}, in {frame.name})")
                raise MemberMismatch(
                    f"the vmapped train step at step {step}{where} {message}"
                ) from exc
        raise


def _batchable_attention(backend: Backend) -> Callable[[], contextlib.AbstractContextManager]:
    """On CPU, attention takes the math path under vmap (the flash kernel has no batching rule)."""
    if backend.device.type != "cpu":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return lambda: sdpa_kernel([SDPBackend.MATH])


def _keep_where(healthy: torch.Tensor, new: list[torch.Tensor], old: list[torch.Tensor]
                ) -> list[torch.Tensor]:
    """Leaf by leaf: member k's new value where ``healthy[k]``, else its old value."""
    return [torch.where(healthy.view(-1, *([1] * (a.dim() - 1))), a, b)
            for a, b in zip(new, old, strict=True)]


def check_members(ensemble: Ensemble, backend: Backend, params: Params, opt_state: OptState,
                  batch: PyTree, out: EnsembleStepOutput, rtol: float = 5e-2,
                  fp8_history: torch.Tensor | None = None, keys: torch.Tensor | None = None
                  ) -> bool:
    """Check each healthy member's new params against its own single run's step.

    Returns whether the step moved any params. A leaf agrees when its update is within ``rtol``
    of the single run's in norm (plus two ulps); raises :class:`MemberMismatch` otherwise.
    """
    new_params, moved = unstack(out.params), False
    for k, member_params, reference in single_run_steps(
            ensemble, backend, params, opt_state, batch, out.diverged_at, fp8_history, keys):
        triples = zip(named_leaves(reference.params), leaves(new_params[k]),
                      leaves(member_params), strict=True)
        for (name, expected), got, before in triples:
            if expected.numel() == 0:
                continue
            update = float((expected.double() - before.double()).norm())
            eps = torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
            ulps = 2 * eps * float(expected.double().norm())
            off = float((got.double() - expected.double()).norm())
            moved = moved or update > 0
            if not off <= rtol * update + ulps:  # NaN-safe
                swept = ", ".join(ensemble.swept) or "none"
                raise MemberMismatch(
                    f"member {k} ({member_label(ensemble.members[k])}) after one vmapped step "
                    f"differs from its own run at param {name!r} (by {off:.3g} in norm, its "
                    f"update by {update:.3g}); use swept keys ({swept}) only in tensor "
                    "arithmetic or as mt.optim arguments (float(), .item(), torch.tensor() or "
                    "torch.as_tensor() with a dtype keep member 0's value)"
                )
    return moved


def single_run_steps(ensemble: Ensemble, backend: Backend, params: Params, opt_state: OptState,
                     batch: PyTree, diverged_at: torch.Tensor, fp8_history: Any, keys: Any
                     ) -> Iterator[tuple[int, Params, StepOutput]]:
    """``(k, params, its single run's step)`` of each member not diverged, in turn (a mistake
    in the script raises as in ``minitrain run``, where the vmapped step names batched shapes).
    """
    stacked = (params, opt_state, batch)
    singles = zip(*(unstack(tree) if any(isinstance(leaf, torch.Tensor) for leaf in leaves(tree))
                    else [tree] * ensemble.size for tree in stacked), strict=True)
    for k, (member_params, member_state, member_batch) in enumerate(singles):
        if int(diverged_at[k]) == 0:
            carry = None if fp8_history is None else Carry(fp8_history=fp8_history[k])
            yield k, member_params, make_train_step(ensemble.experiments[k], backend)(
                member_params, member_state, member_batch, carry,
                None if keys is None else keys[k])
