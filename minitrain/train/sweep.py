"""Ensembles and hyperparameter sweeps: K models trained by one vmapped step.

An ensemble of K members is one params pytree whose leaves carry a leading K axis
(:func:`minitrain.tree.stack`), with the optimizer state stacked the same way. One
``torch.func.vmap`` of the pure train step over params, optimizer state, batch and the members'
hyperparameters trains all K at once: the chapter compares lr 0.01 with lr 0.1 by training
twice; here both (or fifty) run in one step.

**Members and their data.** ``minitrain sweep SCRIPT --set lr=0.01,0.1 --seeds 0,1`` trains the
grid of every listed value (2 × 2 = 4 members; the last key varies fastest, seeds fastest of
all). Member k is the run ``minitrain run SCRIPT --set lr=... --seed s`` would make: its init
and data generators come from :func:`~minitrain.train.loop.run_generators` of its seed, its
batch is drawn by its own experiment's ``next_batch`` with its own data generator, and the K
batches are stacked. So a member sees the same batches as its single run, and members with
different seeds see different batches. When ``next_batch`` does not read a swept value (checked
on one probe draw of the template experiment), members with the same seed would draw identical
batches, so one draw per seed serves them all.

**Swept hyperparameters.** Only float ``CONFIG`` keys may differ between members (members must
share shapes and code paths). The script's ``experiment(config)`` is called once per member
(for init, data, evaluation and the first-step check) and once more with each swept key given
as a :class:`SweptValue`: a 0-d float64 tensor that holds member 0's value outside the step
and, inside the vmapped step, each member's own value. The optimizer built from it therefore
applies per-member lr, weight decay or clipping norm, provided the script only does tensor
arithmetic with the value or passes it to an ``mt.optim`` optimizer or schedule (no
``float()``, ``int()`` or ``if`` on it). The first step checks every member against the step its
single run would take and stops with a one-line error if they differ. Arguments annotated as
plain ``float`` (``mt.optim.cosine_schedule``'s ``peak_value``, SGD's ``momentum``) work with
the swept tensor at run time but refuse it wherever annotations are enforced (jaxtyping's
import hook in the test suite).

**Randomness.** Random ops inside the step draw different numbers for each member (``vmap(...,
randomness="different")``) from the global RNG, seeded with the first member's seed and saved in
checkpoints: a sweep is reproducible and resumes bit-identically on CPU, though a member's
dropout masks differ from its single run's.

**Divergence.** A member whose loss or gradient norm becomes NaN or infinite keeps the params
and optimizer state it had before that step (it is frozen); it is reported, logged once with
``diverged_at``, ranked last, and the others train on. The sweep fails only if all diverge.

>>> import torch, minitrain as mt
>>> CONFIG = {"lr": 0.1, "steps": 3}
>>> def experiment(config):
...     return mt.Experiment(
...         init=lambda g: {"w": torch.zeros(2)},
...         loss=lambda p, x: ((x @ p["w"] - 1) ** 2).mean(),
...         next_batch=lambda g: torch.randn(4, 2, generator=g),
...         optimizer=mt.optim.sgd(lr=config["lr"]), steps=config["steps"])
>>> members = member_grid(CONFIG, {}, {"lr": [0.01, 0.1]}, seeds=[0])
>>> result = fit_sweep(build_ensemble(experiment, members), mt.get_backend("cpu"), progress=False)
>>> result.params["w"].shape, [row["config"] for row in result.summary["ranking"]]
(torch.Size([2, 2]), [{'lr': 0.1}, {'lr': 0.01}])
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as _pytree

from minitrain import checkpoint, rng
from minitrain.backend import Backend
from minitrain.func import value_and_grad
from minitrain.metrics import METRICS_FILE, MetricsWriter, MissingExtra, read_metrics
from minitrain.train.experiment import (
    Experiment,
    ExperimentError,
    apply_overrides,
    coerce_value,
    describe_failure,
    load_script,
    parse_overrides,
)
from minitrain.train.loop import (
    NonFiniteLoss,
    ResumeError,
    StepTimer,
    batch_examples,
    graceful_stop,
    is_due,
    progress_bar,
    resident_bytes,
    run_generators,
    save_final_or_interrupt,
    to_backend,
    to_stderr,
)
from minitrain.train.step import StepOutput, loss_with_aux, make_train_step
from minitrain.tree import (
    OptState,
    Params,
    PyTree,
    global_norm,
    leaves,
    named_leaves,
    size,
    stack,
    unstack,
)
from minitrain.tree import map as tree_map

__all__ = [
    "Ensemble",
    "EnsembleStepOutput",
    "Member",
    "MemberMismatch",
    "SweepBinding",
    "SweepResult",
    "SweptValue",
    "build_ensemble",
    "check_members",
    "fit_sweep",
    "load_sweep",
    "make_ensemble_step",
    "make_member_step",
    "member_grid",
    "member_label",
    "parse_seeds",
    "parse_sweep",
    "plot_sweep",
]

PLOT_FILE = "sweep.png"
SUMMARY_FILE = "summary.json"
RECENT_LOSSES = 10  # the ranking's smoothed loss: the mean of this many last logged losses


# --------------------------------------------------------------------------- swept values


class SweepBinding:
    """Where one ensemble's per-member hyperparameter values live while its step runs."""

    def __init__(self) -> None:
        self.values: Mapping[str, torch.Tensor] | None = None
        self.reads = 0  # how many times a SweptValue of this binding was used, ever

    @contextlib.contextmanager
    def bind(self, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Make every :class:`SweptValue` of this binding stand for ``values[name]``."""
        previous, self.values = self.values, values
        try:
            yield
        finally:
            self.values = previous


class SweptValue(torch.Tensor):
    """A 0-d float64 tensor standing for the per-member values of one swept hyperparameter.

    Outside its binding it is a plain tensor holding ``value`` (member 0's). While
    ``binding.bind({name: values})`` is active, every torch op that receives it uses
    ``values[name]`` instead (through ``__torch_function__``); inside ``vmap`` that is each
    member's own value. Scripts receive these in ``config`` for swept keys.

    >>> binding = SweptValue.binding_type()
    >>> lr = SweptValue(0.1, "lr", binding)
    >>> float(lr * 2)
    0.2
    >>> def doubled(values):
    ...     with binding.bind({"lr": values}):
    ...         return lr * 2
    >>> torch.func.vmap(doubled)(torch.tensor([0.1, 0.3], dtype=torch.float64))
    tensor([0.2000, 0.6000], dtype=torch.float64)
    """

    binding_type = SweepBinding

    @staticmethod
    def __new__(cls, value: float, name: str, binding: SweepBinding) -> SweptValue:
        plain = torch.tensor(float(value), dtype=torch.float64)
        swept = torch.Tensor._make_subclass(cls, plain)
        swept.swept_name = name
        swept.swept_binding = binding
        swept.swept_plain = plain
        return swept

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = {key: _resolve(value) for key, value in kwargs.items()} if kwargs else {}
        return func(*(_resolve(arg) for arg in args), **kwargs)


def _resolve(value: Any) -> Any:
    """A swept value's current tensor; lists and tuples (``torch.stack([...])``) are searched."""
    if isinstance(value, SweptValue):
        value.swept_binding.reads += 1
        bound = value.swept_binding.values
        if bound is not None and value.swept_name in bound:
            return bound[value.swept_name]
        return value.swept_plain
    if isinstance(value, list | tuple) and any(isinstance(v, SweptValue) for v in value):
        return type(value)(_resolve(v) for v in value)
    return value


# --------------------------------------------------------------------------- the grid


class Member(NamedTuple):
    """One run of a sweep: its position, seed, full config and the swept values among it."""

    index: int
    seed: int
    config: dict[str, Any]
    swept: dict[str, Any]


def member_label(member: Member) -> str:
    """``"lr=0.01 seed=0"``: what tells a member apart.

    >>> member_label(Member(0, 1, {"lr": 0.01, "dim": 4}, {"lr": 0.01}))
    'lr=0.01 seed=1'
    """
    return " ".join([*(f"{k}={v:g}" for k, v in member.swept.items()), f"seed={member.seed}"])


def parse_sweep(items: Sequence[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Split ``--set`` items into fixed overrides and swept keys (comma-separated values).

    >>> parse_sweep(["lr=0.01,0.1", "dim=8", "weight_decay=0, 0.01"])
    ({'dim': '8'}, {'lr': ['0.01', '0.1'], 'weight_decay': ['0', '0.01']})
    """
    fixed: dict[str, str] = {}
    swept: dict[str, list[str]] = {}
    for item in items:
        ((key, text),) = parse_overrides([item]).items()
        values = [value.strip() for value in text.split(",")]
        if len(values) > 1 and not all(values):
            raise ExperimentError(
                f"--set {item}: an empty value in the list; write values like key=0.01,0.1"
            )
        fixed.pop(key, None)
        swept.pop(key, None)
        if len(values) == 1:
            fixed[key] = values[0]
        else:
            swept[key] = values
    return fixed, swept


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2" -> [0, 1, 2]``; each seed a distinct non-negative int.

    >>> parse_seeds("0, 3")
    [0, 3]
    """
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ExperimentError(
            f"--seeds {text}: expected comma-separated integers, e.g. --seeds 0,1,2"
        ) from None
    _check_distinct("--seeds", seeds)
    if any(seed < 0 for seed in seeds):
        raise ExperimentError(f"--seeds {text}: seeds must be non-negative integers")
    return seeds


def member_grid(
    config: Mapping[str, Any],
    fixed: Mapping[str, Any],
    swept: Mapping[str, Sequence[Any]],
    seeds: Sequence[int] = (0,),
) -> list[Member]:
    """Every combination of the swept values (last key fastest) and the seeds (fastest).

    ``fixed`` overrides apply to every member; values may be strings (from the command line)
    or numbers, parsed as the type of the ``config`` default. Only float keys may be swept.

    >>> grid = member_grid({"lr": 0.01, "dim": 4}, {"dim": 8}, {"lr": ["0.1", 0.3]}, [0, 1])
    >>> [(m.index, m.seed, m.config) for m in grid[:2]]
    [(0, 0, {'lr': 0.1, 'dim': 8}), (1, 1, {'lr': 0.1, 'dim': 8})]
    >>> [m.swept for m in grid[2:]]
    [{'lr': 0.3}, {'lr': 0.3}]
    """
    if not seeds:
        raise ExperimentError("a sweep needs at least one seed; pass --seeds 0")
    _check_distinct("seeds", list(seeds))
    base = apply_overrides(config, {key: str(value) for key, value in fixed.items()})
    apply_overrides(config, {key: str(values[0]) for key, values in swept.items() if values})
    grids = {}
    for key, texts in swept.items():
        default = config[key]
        if type(default) is not float:
            raise ExperimentError(
                f"--set {key}={','.join(map(str, texts))}: only float CONFIG keys can take "
                f"several values (members must share shapes and code); {key}'s default "
                f"{default!r} is a {type(default).__name__}, so run one sweep per value"
            )
        if not texts:
            raise ExperimentError(f"--set {key}=: give at least one value")
        values = [coerce_value(key, str(text), default) for text in texts]
        _check_distinct(f"--set {key}", values)
        grids[key] = values
    keys = list(grids)
    members = []
    for combo, seed in itertools.product(itertools.product(*grids.values()), seeds):
        values = dict(zip(keys, combo, strict=True))
        members.append(Member(len(members), int(seed), {**base, **values}, values))
    return members


def _check_distinct(what: str, values: list[Any]) -> None:
    seen = set()
    for value in values:
        if value in seen:
            raise ExperimentError(f"{what}: {value!r} is listed twice; list each value once")
        seen.add(value)


# --------------------------------------------------------------------------- the ensemble


class MemberMismatch(ExperimentError):
    """The members cannot share one vmapped step (their runs differ in more than values)."""


@dataclass(frozen=True)
class Ensemble:
    """K members, their experiments, and the one experiment whose step they share.

    ``template`` is ``experiment(config)`` built with every swept key as a :class:`SweptValue`
    of ``binding``; its loss, optimizer and clipping norm make the vmapped step.
    """

    members: tuple[Member, ...]
    experiments: tuple[Experiment, ...]
    template: Experiment
    binding: SweepBinding
    swept: tuple[str, ...]

    @property
    def size(self) -> int:
        """K, the number of members."""
        return len(self.members)

    @property
    def steps(self) -> int:
        return self.template.steps

    def hyperparameters(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Each swept key's per-member values as a float64 tensor of shape ``(K,)``."""
        return {
            key: torch.tensor([m.swept[key] for m in self.members], dtype=torch.float64).to(device)
            for key in self.swept
        }


def build_ensemble(
    build: Callable[[dict[str, Any]], Experiment], members: Sequence[Member]
) -> Ensemble:
    """Build each member's experiment and the shared template; check they can share a step.

    ``build`` is an experiment script's ``experiment(config)`` function.
    """
    members = tuple(members)
    if not members:
        raise ExperimentError("a sweep needs at least one member")
    experiments = tuple(_built(build, member.config) for member in members)
    _check_same_run_shape(members, experiments)
    binding = SweepBinding()
    swept = tuple(members[0].swept)
    template = experiments[0]
    if swept:
        first = members[0]
        config = {
            **first.config,
            **{key: SweptValue(first.swept[key], key, binding) for key in swept},
        }
        try:
            template = _built(build, config)
        except Exception as exc:  # e.g. an argument annotated float that refuses a tensor
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise MemberMismatch(
                f"experiment(config) with {', '.join(swept)} as per-member tensors failed "
                f"({type(exc).__name__}: {reason}); pass swept keys only to arguments that "
                "accept tensors (mt.optim's lr and weight_decay, max_grad_norm) or use them in "
                "tensor arithmetic"
            ) from exc
        template = dataclasses.replace(template, name=experiments[0].name)
    return Ensemble(members, experiments, template, binding, swept)


def _built(build: Callable[[dict[str, Any]], Experiment], config: dict[str, Any]) -> Experiment:
    experiment = build(dict(config))
    if not isinstance(experiment, Experiment):
        raise ExperimentError(
            f"experiment(config) must return a minitrain.Experiment, got "
            f"{type(experiment).__name__}"
        )
    return experiment


_SHARED_FIELDS = ("steps", "has_aux", "eval_every", "tokens_per_batch", "flops_per_step")


def _check_same_run_shape(members: Sequence[Member], experiments: Sequence[Experiment]) -> None:
    first = experiments[0]
    for member, experiment in zip(members[1:], experiments[1:], strict=True):
        differing = [
            (field, getattr(experiment, field), getattr(first, field))
            for field in _SHARED_FIELDS
            if getattr(experiment, field) != getattr(first, field)
        ]
        for field in ("evaluate", "max_grad_norm"):
            if (getattr(experiment, field) is None) != (getattr(first, field) is None):
                differing.append((field, getattr(experiment, field), getattr(first, field)))
        if differing:
            field, value, first_value = differing[0]
            raise MemberMismatch(
                f"member {member.index} ({member_label(member)}) has {field}={value!r} but "
                f"member 0 has {first_value!r}; members of one vmapped step may differ only in "
                "float hyperparameters such as lr or weight_decay"
            )


def load_sweep(
    path: str | Path,
    items: Sequence[str] = (),
    seeds: Sequence[int] = (0,),
    steps: int | None = None,
) -> Ensemble:
    """Import an experiment script and build the ensemble of its ``--set``/``--seeds`` grid.

    ``items`` are ``--set`` values (``"lr=0.01,0.1"`` sweeps, ``"dim=8"`` fixes); ``steps``
    overrides the step count as ``minitrain run --steps`` does. Mistakes raise
    :class:`~minitrain.train.ExperimentError` with a one-line message.
    """
    config, script_build = load_script(path)
    fixed, swept = parse_sweep(items)
    if steps is not None and "steps" in config:
        fixed["steps"] = str(steps)
        swept.pop("steps", None)
    members = member_grid(config, fixed, swept, seeds)

    def build(member_config: dict[str, Any]) -> Experiment:
        try:
            experiment = script_build(member_config)
        except ExperimentError:
            raise
        except Exception as exc:  # the user's script failed: report where, in one line
            raise ExperimentError(
                f"{path}: experiment(config) failed: {describe_failure(exc, path)}"
            ) from exc
        if steps is not None and isinstance(experiment, Experiment):
            experiment = dataclasses.replace(experiment, steps=steps)
        return experiment

    return build_ensemble(build, members)


# --------------------------------------------------------------------------- the steps


class EnsembleStepOutput(NamedTuple):
    """One ensemble step: stacked params and state, per-member ``(K,)`` losses and norms."""

    params: Params
    opt_state: OptState
    loss: torch.Tensor
    grad_norm: torch.Tensor
    aux: dict[str, torch.Tensor]
    diverged_at: torch.Tensor


def make_member_step(
    experiment: Experiment, backend: Backend
) -> Callable[[Params, OptState, PyTree], StepOutput]:
    """The single-member train step, in ops that ``vmap`` supports.

    Same math as :func:`~minitrain.train.make_train_step`: the global gradient norm is the norm
    of the per-leaf norms, and clipping scales by ``min(1, max_norm / (norm + 1e-6))``
    (``torch.nn.utils.clip_grad_norm_``), so a swept ``max_grad_norm`` works too.

    >>> import torch, minitrain as mt
    >>> exp = mt.Experiment(init=lambda g: {"w": torch.zeros(2)},
    ...     loss=lambda p, x: ((x @ p["w"] - 1) ** 2).mean(),
    ...     next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1), steps=1)
    >>> step = make_member_step(exp, mt.get_backend("cpu"))
    >>> params = {"w": torch.zeros(2)}
    >>> step(params, exp.optimizer.init(params), torch.ones(4, 2)).params
    {'w': tensor([0.2000, 0.2000])}
    """
    loss_and_grads = value_and_grad(loss_with_aux(experiment), has_aux=True)
    optimizer = experiment.optimizer
    max_grad_norm = experiment.max_grad_norm

    def member_step(params: Params, opt_state: OptState, batch: PyTree) -> StepOutput:
        with backend.autocast():
            (loss, aux), grads = loss_and_grads(params, batch)
        grad_norm = global_norm(grads)
        if max_grad_norm is not None:
            scale = torch.clamp(max_grad_norm / (grad_norm + 1e-6), max=1.0)
            grads = tree_map(lambda g: g * scale.to(g.dtype), grads)
        params, opt_state = optimizer.update(grads, opt_state, params)
        return StepOutput(params, opt_state, loss.detach(), grad_norm, aux)

    return member_step


def batches_ignore_swept_values(ensemble: Ensemble) -> bool:
    """Whether the script's ``next_batch`` never reads a swept value (probed on one draw of the
    template experiment, whose config holds the swept keys as :class:`SweptValue`)."""
    binding = ensemble.binding
    before = binding.reads
    ensemble.template.next_batch(rng.generator(0))
    return binding.reads == before


def shared_by_seed(
    members: Sequence[Member], generators: list[torch.Generator]
) -> list[torch.Generator]:
    """One data generator per seed: members with the same seed draw the same batches anyway
    (their configs differ only in swept values their ``next_batch`` does not read), so
    :func:`draw_batches` draws once per seed instead of once per member."""
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
    """``step(params, opt_state, batch, hyperparameters, diverged_at, step_number)``: one
    vmapped train step of every member.

    ``hyperparameters`` maps each swept key to its ``(K,)`` values; ``diverged_at`` is a
    ``(K,)`` int64 tensor, 0 for healthy members and the step of divergence otherwise. A
    member whose loss or gradient norm is not finite, or that diverged before, keeps its params
    and optimizer state; newly diverged members get ``diverged_at = step_number``.
    """
    member_step = make_member_step(ensemble.template, backend)
    binding = ensemble.binding

    def bound_step(
        params: Params, opt_state: OptState, batch: PyTree, values: dict[str, torch.Tensor]
    ) -> StepOutput:
        with binding.bind(values):
            return member_step(params, opt_state, batch)

    vmapped = torch.func.vmap(bound_step, randomness="different")
    attention = _batchable_attention(backend)

    def ensemble_step(
        params: Params,
        opt_state: OptState,
        batch: PyTree,
        hyperparameters: dict[str, torch.Tensor],
        diverged_at: torch.Tensor,
        step_number: int,
    ) -> EnsembleStepOutput:
        with attention():
            out = vmapped(params, opt_state, batch, hyperparameters)
        alive = diverged_at == 0
        healthy = alive & torch.isfinite(out.loss) & torch.isfinite(out.grad_norm)
        diverged_at = torch.where(alive & ~healthy, step_number, diverged_at)
        return EnsembleStepOutput(
            _keep_where(healthy, out.params, params),
            _keep_where(healthy, out.opt_state, opt_state),
            out.loss,
            out.grad_norm,
            out.aux,
            diverged_at,
        )

    return ensemble_step


def _batchable_attention(backend: Backend) -> Callable[[], contextlib.AbstractContextManager]:
    """On CPU, ``scaled_dot_product_attention`` takes the math path under vmap: torch 2.x has
    no batching rule for the CPU flash kernel (it falls back to a slow per-member loop and
    warns), while the math path is made of batchable matmuls and a softmax."""
    if backend.device.type != "cpu":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return lambda: sdpa_kernel([SDPBackend.MATH])


def _keep_where(healthy: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """Leaf by leaf: member k's new value where ``healthy[k]``, else its old value."""

    def choose(new_leaf: Any, old_leaf: Any) -> Any:
        if not isinstance(new_leaf, torch.Tensor):
            return new_leaf
        mask = healthy.view(-1, *([1] * (new_leaf.dim() - 1)))
        return torch.where(mask, new_leaf, old_leaf)

    # The step returns trees shaped like its inputs, so no structure check is needed here.
    return _pytree.tree_map(choose, new, old)


def check_members(
    ensemble: Ensemble,
    backend: Backend,
    params: Params,
    opt_state: OptState,
    batch: PyTree,
    out: EnsembleStepOutput,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> None:
    """Check each healthy member's new params against the step its own single run would take.

    ``params``, ``opt_state`` and ``batch`` are the stacked inputs of the ensemble step that
    returned ``out``. Raises :class:`MemberMismatch` naming the first member and leaf that
    differ (e.g. a script that turned a swept value into a Python float).
    """
    singles = zip(unstack(params), unstack(opt_state), unstack(batch), strict=True)
    new_params = unstack(out.params)
    for k, (member_params, member_state, member_batch) in enumerate(singles):
        if int(out.diverged_at[k]) != 0:
            continue
        member, experiment = ensemble.members[k], ensemble.experiments[k]
        reference = make_train_step(experiment, backend)(member_params, member_state, member_batch)
        pairs = zip(named_leaves(reference.params), leaves(new_params[k]), strict=True)
        for name, (expected, got) in ((n, (e, g)) for (n, e), g in pairs):
            if not torch.allclose(got, expected, rtol=rtol, atol=atol):
                worst = float((got - expected).abs().max())
                raise MemberMismatch(
                    f"member {k} ({member_label(member)}) after one vmapped step differs from "
                    f"its own run at param {name!r} (max |difference| {worst:.3g}); use swept "
                    f"keys ({', '.join(ensemble.swept) or 'none'}) only in tensor arithmetic "
                    "or as mt.optim arguments (no float(), int() or if on them)"
                )


# --------------------------------------------------------------------------- the loop


class SweepResult(NamedTuple):
    """What :func:`fit_sweep` returns: stacked params and optimizer state, and the summary."""

    params: Params
    opt_state: OptState
    summary: dict[str, Any]


@dataclass
class _MemberLog:
    """Per-member bookkeeping of the loop: recent losses, last eval, divergence reported."""

    recent: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_LOSSES)
    )
    final_loss: float | None = None
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    diverged_at: int = 0
    reported: bool = False


def fit_sweep(
    ensemble: Ensemble,
    backend: Backend,
    *,
    out_dir: str | Path | None = None,
    log_every: int = 1,
    checkpoint_every: int = 0,
    keep: int = 3,
    resume: bool = False,
    progress: bool = True,
    report: bool = False,
    check: bool = True,
    say: Callable[[str], None] | None = None,
) -> SweepResult:
    """Train every member of ``ensemble`` with one vmapped step per step; return the result.

    Arguments are :func:`~minitrain.train.fit`'s. ``out_dir`` receives ``metrics.jsonl`` (one
    line per logged step per member, with ``member``, ``seed`` and the swept ``config``),
    checkpoints of the whole ensemble and ``summary.json`` (the ranking). ``check`` compares
    the first step with each member's own single-run step (:func:`check_members`).

    Raises :class:`~minitrain.train.NonFiniteLoss` when every member has diverged,
    :class:`~minitrain.train.Interrupted` after Ctrl-C (a checkpoint is written first) and
    :class:`~minitrain.train.ResumeError`.
    """
    say = say or to_stderr
    if log_every < 1 or checkpoint_every < 0 or keep < 1:
        raise ValueError(
            f"need log_every >= 1, checkpoint_every >= 0 and keep >= 1; got {log_every}, "
            f"{checkpoint_every} and {keep}"
        )
    if (checkpoint_every or resume) and out_dir is None:
        raise ResumeError("--checkpoint-every and --resume need a run directory: pass --out DIR")
    run_dir = Path(out_dir) if out_dir is not None else None
    members, experiments, template = ensemble.members, ensemble.experiments, ensemble.template
    meta = _sweep_meta(ensemble, backend)

    rng.seed_everything(members[0].seed)
    generators = [run_generators(member.seed) for member in members]
    data_generators = [data for _, data in generators]
    if batches_ignore_swept_values(ensemble):
        data_generators = shared_by_seed(members, data_generators)
    member_params = [
        to_backend(experiment.init(init), backend)
        for experiment, (init, _) in zip(experiments, generators, strict=True)
    ]
    params = _stacked(member_params, "params")
    opt_state = _stacked(
        [exp.optimizer.init(p) for exp, p in zip(experiments, member_params, strict=True)],
        "optimizer states",
    )
    diverged_at = torch.zeros(ensemble.size, dtype=torch.int64, device=backend.device)
    logs = [_MemberLog() for _ in members]
    start = 0
    if resume:
        params, opt_state, diverged_at, start = _resume(
            run_dir, params, opt_state, diverged_at, data_generators, meta, say
        )
        _reload_logs(run_dir, start, logs, diverged_at)
    if start > template.steps:
        raise ResumeError(
            f"the checkpoint in {run_dir} is at step {start}, past --steps {template.steps}; "
            "pass --steps of at least that, or a new --out"
        )
    hyperparameters = ensemble.hyperparameters(backend.device)
    step_fn = make_ensemble_step(ensemble, backend)

    def save(step: int) -> Path:
        state = {"optimizer": opt_state, "diverged_at": diverged_at}
        generator_states = [rng.generator_state(g) for g in data_generators]
        saved_meta = {**meta, "data_generators": generator_states}
        return checkpoint.save(run_dir, step, params, state, saved_meta, keep=keep)

    examples = template.tokens_per_batch
    batch = None
    step = start
    timer = StepTimer(backend)
    with contextlib.ExitStack() as stack_:
        metrics = stack_.enter_context(MetricsWriter(run_dir, start)) if run_dir else None
        stop_requested = stack_.enter_context(graceful_stop())
        advance = stack_.enter_context(progress_bar(template, start, enabled=progress))
        for step in range(start + 1, template.steps + 1):
            if stop_requested():
                step -= 1  # the last finished step
                break
            member_batches = draw_batches(experiments, data_generators)
            if examples is None:
                examples = batch_examples(member_batches[0])
            batch = backend.to_device(_stacked(member_batches, "batches"))
            out = step_fn(params, opt_state, batch, hyperparameters, diverged_at, step)
            timer.tick(step - start)
            if check and step == start + 1:
                check_members(ensemble, backend, params, opt_state, batch, out)
            is_checkpoint = is_due(step, checkpoint_every) and step < template.steps
            is_eval = template.evaluate is not None and is_due(step, template.eval_every)
            params, opt_state, diverged_at = out.params, out.opt_state, out.diverged_at
            if is_due(step, log_every) or step == template.steps or is_checkpoint or is_eval:
                _log_step(ensemble, out, step, logs, metrics, timer.rates(examples), is_eval, say)
                _stop_if_all_diverged(logs, step)
                alive = [log.final_loss for log in logs if not log.diverged_at]
                advance(step, min(alive))
            if is_checkpoint:
                save(step)
    save_final_or_interrupt(step, start, template.steps, run_dir, save)
    _final_evals(ensemble, params, logs)
    summary = _summary(ensemble, backend, params, logs, examples or 0, timer)
    summary["resumed_from"] = start or None
    if report and batch is not None:
        summary["resources"] = _resources(
            ensemble,
            backend,
            step_fn,
            params,
            opt_state,
            batch,
            hyperparameters,
            diverged_at,
            summary,
        )
    if run_dir is not None:
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return SweepResult(params, opt_state, summary)


def _stacked(trees: list[PyTree], what: str) -> PyTree:
    try:
        return stack(trees)
    except ValueError as exc:
        raise MemberMismatch(
            f"the members' {what} cannot be stacked ({exc}); members of one vmapped step may "
            "differ only in float hyperparameters such as lr or weight_decay"
        ) from None


def _log_step(
    ensemble: Ensemble,
    out: EnsembleStepOutput,
    step: int,
    logs: list[_MemberLog],
    metrics: MetricsWriter | None,
    rates: dict[str, float],
    is_eval: bool,
    say: Callable[[str], None],
) -> None:
    """Write one metrics line per member still training (or diverged since the last log)."""
    losses, norms = out.loss.tolist(), out.grad_norm.tolist()
    diverged = out.diverged_at.tolist()
    lrs = out.opt_state.lr.tolist() if hasattr(out.opt_state, "lr") else [None] * len(losses)
    aux = {key: value.tolist() for key, value in out.aux.items()}
    rss = resident_bytes()
    member_params = unstack(out.params) if is_eval else None
    for k, member in enumerate(ensemble.members):
        log = logs[k]
        if log.reported:
            continue
        record: dict[str, Any] = {"member": k, "seed": member.seed, "config": member.swept}
        if diverged[k]:
            log.diverged_at, log.reported = diverged[k], True
            say(
                f"member {k} ({member_label(member)}) diverged at step {diverged[k]} (loss "
                f"{losses[k]}, grad norm {norms[k]}); its params stay as they were before it"
            )
            record.update(loss=losses[k], diverged_at=diverged[k])
        else:
            log.final_loss = losses[k]
            log.recent.append(losses[k])
            record.update(
                loss=losses[k],
                lr=lrs[k],
                grad_norm=norms[k],
                **{key: values[k] for key, values in aux.items()},
                **rates,
                rss_bytes=rss,
            )
            if is_eval:
                evaluate = ensemble.experiments[k].evaluate
                log.last_eval = {key: float(v) for key, v in evaluate(member_params[k]).items()}
                record.update(log.last_eval)
        if metrics is not None:
            metrics.write(step, **record)


def _stop_if_all_diverged(logs: list[_MemberLog], step: int) -> None:
    if all(log.diverged_at for log in logs):
        raise NonFiniteLoss(
            f"every member diverged (the last at step {max(log.diverged_at for log in logs)}, "
            f"seen at step {step}); the last checkpoint is kept; lower the learning rates"
        )


def _final_evals(ensemble: Ensemble, params: Params, logs: list[_MemberLog]) -> None:
    member_params = None
    for k, experiment in enumerate(ensemble.experiments):
        if experiment.evaluate is None or logs[k].last_eval:
            continue
        member_params = member_params or unstack(params)
        logs[k].last_eval = {
            key: float(value) for key, value in experiment.evaluate(member_params[k]).items()
        }


def _sweep_meta(ensemble: Ensemble, backend: Backend) -> dict[str, Any]:
    return {
        "experiment": ensemble.template.name,
        "backend": backend.name,
        "sweep": list(ensemble.swept),
        "members": [{"seed": m.seed, "config": m.config} for m in ensemble.members],
    }


def _resume(
    run_dir: Path,
    params: Params,
    opt_state: OptState,
    diverged_at: torch.Tensor,
    data_generators: list[torch.Generator],
    meta: dict[str, Any],
    say: Callable[[str], None],
) -> tuple[Params, OptState, torch.Tensor, int]:
    path = checkpoint.latest_valid(
        run_dir, on_skip=lambda p, reason: say(f"skipping checkpoint {p.name}: {reason}")
    )
    if path is None:
        say(f"no valid checkpoint in {run_dir}; starting from step 0")
        return params, opt_state, diverged_at, 0
    template = {"optimizer": opt_state, "diverged_at": diverged_at}
    saved = checkpoint.load(path, params, template)
    _check_same_sweep(saved.meta, meta, run_dir)
    checkpoint.restore_rng(saved)
    for generator, state in zip(data_generators, saved.meta["data_generators"], strict=True):
        rng.set_generator_state(generator, state)
    say(f"resuming from {path} (step {saved.step})")
    state = saved.opt_state
    return saved.params, state["optimizer"], state["diverged_at"], saved.step


def _check_same_sweep(saved: dict[str, Any], current: dict[str, Any], run_dir: Path) -> None:
    for key in ("experiment", "backend", "sweep"):
        if saved.get(key) != current[key]:
            raise ResumeError(
                f"{run_dir} was trained with {key}={saved.get(key)!r}, this sweep has "
                f"{key}={current[key]!r}; use the same value to resume, or a new --out"
            )
    old, new = saved.get("members", []), current["members"]
    if len(old) != len(new) or len(saved.get("data_generators", [])) != len(new):
        raise ResumeError(
            f"{run_dir} holds a sweep of {len(old)} members, this one has {len(new)}; pass the "
            "same --set lists and --seeds to resume, or a new --out"
        )
    for index, (was, now) in enumerate(zip(old, new, strict=True)):
        changed = [
            key
            for key in sorted(set(was["config"]) | set(now["config"]))
            if key != "steps" and was["config"].get(key) != now["config"].get(key)
        ]
        if was["seed"] != now["seed"] or changed:
            what = (
                f"{changed[0]}={was['config'].get(changed[0])!r}"
                if changed
                else (f"seed {was['seed']}")
            )
            raise ResumeError(
                f"{run_dir}: member {index} was trained with {what}; pass the same --set lists "
                "and --seeds to resume, or a new --out"
            )


def _reload_logs(
    run_dir: Path, start: int, logs: list[_MemberLog], diverged_at: torch.Tensor
) -> None:
    """Recent losses, last evals and divergences of the steps before ``start``, from the log."""
    for k, step in enumerate(diverged_at.tolist()):
        logs[k].diverged_at = step
    if not start or not (run_dir / METRICS_FILE).exists():
        return
    for record in read_metrics(run_dir):
        k = record.get("member")
        if record["step"] > start or not isinstance(k, int) or not 0 <= k < len(logs):
            continue
        log = logs[k]
        if "diverged_at" in record:
            log.reported = True
        elif isinstance(record.get("loss"), int | float):
            log.final_loss = record["loss"]
            log.recent.append(record["loss"])
            evals = {key: v for key, v in record.items() if key.startswith(("val", "eval"))}
            log.last_eval = evals or log.last_eval


def _summary(
    ensemble: Ensemble,
    backend: Backend,
    params: Params,
    logs: list[_MemberLog],
    examples: int,
    timer: StepTimer,
) -> dict[str, Any]:
    backend.synchronize()
    k = ensemble.size
    per_member = size(params) // k
    step_seconds = timer.step_seconds()
    exact = ensemble.template.flops_per_step
    return {
        "name": ensemble.template.name,
        "backend": backend.name,
        "members": k,
        "swept": list(ensemble.swept),
        "seeds": sorted({m.seed for m in ensemble.members}),
        "steps": ensemble.steps,
        "seconds": timer.seconds(),
        "step_seconds": step_seconds,
        "params_per_member": per_member,
        "params": per_member * k,
        "examples_per_step": examples * k,
        # The chapter's rule (3.5.6), for all K members: 6·B·P each.
        "flops_per_step": 6 * examples * per_member * k,
        "flops_per_step_exact": exact * k if exact is not None else None,
        "examples_per_second": examples * k / step_seconds if step_seconds > 0 else None,
        "ranking": _ranking(ensemble, logs),
        "diverged": [
            m.index for m, log in zip(ensemble.members, logs, strict=True) if log.diverged_at
        ],
        "configs": [m.config for m in ensemble.members],
    }


def _ranking(ensemble: Ensemble, logs: list[_MemberLog]) -> list[dict[str, Any]]:
    """Members best first: by held-out ``val_loss`` when every healthy member has one, else by
    the mean of their last logged train losses; diverged members last, earliest first."""
    healthy = [log for log in logs if not log.diverged_at]
    by_val = bool(healthy) and all("val_loss" in log.last_eval for log in healthy)
    rows = []
    for member, log in zip(ensemble.members, logs, strict=True):
        smoothed = sum(log.recent) / len(log.recent) if log.recent else None
        row = {
            "member": member.index,
            "seed": member.seed,
            "config": member.swept,
            "final_loss": None if log.diverged_at else log.final_loss,
            "smoothed_loss": None if log.diverged_at else smoothed,
            "eval": log.last_eval,
            "diverged_at": log.diverged_at or None,
            "ranked_by": "val_loss" if by_val else "smoothed_loss",
        }
        rows.append(row)

    def key(row: dict[str, Any]) -> tuple:
        if row["diverged_at"] is not None:
            return (1, row["diverged_at"], row["member"])
        value = row["eval"]["val_loss"] if by_val else row["smoothed_loss"]
        value = value if value is not None and math.isfinite(value) else math.inf
        return (0, value, row["member"])

    rows.sort(key=key)
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    return rows


def _resources(
    ensemble: Ensemble,
    backend: Backend,
    step_fn: Callable[..., EnsembleStepOutput],
    params: Params,
    opt_state: OptState,
    batch: PyTree,
    hyperparameters: dict[str, torch.Tensor],
    diverged_at: torch.Tensor,
    summary: dict[str, Any],
) -> dict[str, Any]:
    """The resource report of one whole ensemble step: K × params, grads, state, activations."""
    from minitrain.accounting import resource_report

    def step(p: Params, s: OptState, b: PyTree) -> EnsembleStepOutput:
        return step_fn(p, s, b, hyperparameters, diverged_at, ensemble.steps)

    # The 6·B·P rule with P = K·(params per member) and B per member gives K × 6·B·P.
    report = resource_report(
        step,
        params,
        opt_state,
        batch,
        examples_per_step=summary["examples_per_step"] // ensemble.size or None,
        exact_flops_per_step=summary["flops_per_step_exact"],
        peak_flops=backend.peak_flops(),
        step_seconds=summary["step_seconds"],
        steps_total=ensemble.steps,
        steps_done=ensemble.steps,
    )
    report["members"] = ensemble.size
    return report


# --------------------------------------------------------------------------- the plot


def plot_sweep(run_dir: str | Path, out_png: str | Path | None = None) -> Path:
    """Draw every member's loss curve, and the ranking beside it, to a PNG; return its path.

    Reads ``run_dir/metrics.jsonl`` and ``summary.json``; writes ``run_dir/sweep.png`` unless
    ``out_png`` is given. Needs matplotlib (the ``plot`` extra), imported here only.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.is_file():
        raise ExperimentError(f"no {SUMMARY_FILE} in {run_dir}; plot a finished sweep's --out")
    ranking = json.loads(summary_path.read_text())["ranking"]
    figure = _sweep_figure(records, ranking, title=run_dir.resolve().name)
    out = Path(out_png) if out_png is not None else run_dir / PLOT_FILE
    if out.suffix.lower() != ".png":
        raise ExperimentError(f"the plot is written as PNG; give a path ending in .png, not {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    return out


def _sweep_figure(records: list[dict], ranking: list[dict], title: str) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtra(
            "the sweep plot needs matplotlib; pip install 'minitrain[plot]' or pass --no-plot"
        ) from None
    from minitrain.metrics import ema

    curves: dict[int, tuple[list[int], list[float]]] = {}
    for record in records:
        loss = record.get("loss")
        if isinstance(record.get("member"), int) and isinstance(loss, int | float):
            steps, values = curves.setdefault(record["member"], ([], []))
            steps.append(record["step"])
            values.append(loss)
    labels = {row["member"]: _row_label(row) for row in ranking}
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    curves_axes, ranks_axes = figure.subplots(1, 2, width_ratios=(3, 2))
    positive = all(v > 0 for _, values in curves.values() for v in values)
    healthy_top = []
    for row in ranking:
        steps, values = curves.get(row["member"], ([], []))
        if not steps:
            continue
        smooth = ema(values, 0.9) if len(steps) > 20 else values
        label = labels[row["member"]]
        if row["diverged_at"]:
            label += f" (diverged at {row['diverged_at']})"
        else:
            healthy_top.append(max(smooth))
        style = {"linestyle": ":"} if row["diverged_at"] else {}
        curves_axes.plot(steps, smooth, label=label, **style)
    if positive:
        curves_axes.set_yscale("log")
    if healthy_top and len(healthy_top) < len(ranking):  # keep diverged curves from the scale
        curves_axes.set_ylim(top=max(healthy_top) * (10 if positive else 1.2))
    curves_axes.set_xlabel("step")
    curves_axes.set_ylabel("train loss" + (" (EMA 0.9)" if len(records) > 20 else ""))
    curves_axes.set_title(f"{title}: {len(ranking)} members")
    curves_axes.grid(alpha=0.3)
    if len(ranking) <= 12:
        curves_axes.legend(fontsize=7)
    ranked = [row for row in ranking if not row["diverged_at"]]
    metric = ranked[0]["ranked_by"] if ranked else "smoothed_loss"
    values = [row["eval"]["val_loss"] if metric == "val_loss" else row[metric] for row in ranked]
    ranks_axes.barh([labels[row["member"]] for row in ranked], values)
    ranks_axes.invert_yaxis()
    if values and min(values) > 0 and max(values) > 100 * min(values):
        ranks_axes.set_xscale("log")
    ranks_axes.set_xlabel(metric.replace("_", " ") + " (best first)")
    ranks_axes.tick_params(axis="y", labelsize=7)
    diverged = len(ranking) - len(ranked)
    ranks_axes.set_title("ranking" + (f" ({diverged} diverged, not shown)" if diverged else ""))
    return figure


def _row_label(row: dict[str, Any]) -> str:
    swept = " ".join(f"{k}={v:g}" for k, v in row["config"].items())
    return f"#{row['member']} {swept} seed={row['seed']}".replace("  ", " ")
