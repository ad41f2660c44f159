"""The members of a sweep: the grid of ``--set`` lists and ``--seeds``, and their ensemble."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from minitrain.accounting.units import parse_number
from minitrain.train.experiment import (
    Experiment,
    ExperimentError,
    apply_overrides,
    build_experiment,
    check_seed,
    coerce_value,
    load_script,
    parse_overrides,
    script_folder,
)
from minitrain.train.script_errors import one_line, script_line
from minitrain.train.swept import SIZES_FIX, MemberMismatch, SweepBinding, SweptValue

__all__ = [
    "Ensemble", "Member", "MemberMismatch", "build_ensemble", "load_sweep", "member_grid",
    "check_same_run", "member_label", "parse_seeds", "parse_sweep",
]


class Member(NamedTuple):
    """One run of a sweep: its position, seed, full config and the swept values among it."""

    index: int
    seed: int
    config: dict[str, Any]
    swept: dict[str, Any]


def member_label(member: Member) -> str:
    """``"lr=0.01 seed=0"``: what tells a member apart."""
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
        values = [value.strip() for value in text.split(",")]  # an empty one fails to parse
        fixed.pop(key, None)
        swept.pop(key, None)
        if len(values) == 1:
            fixed[key] = values[0]
        else:
            swept[key] = values
    return fixed, swept


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2" -> [0, 1, 2]``; each a non-negative int (:func:`member_grid` refuses one listed
    twice)."""
    try:  # the command line's one number parser: 1e3, 1_000; whole, in [0, 2**63)
        seeds = [parse_number(part, "", whole=True, low=0, high=2**63 - 1)
                 for part in text.split(",")]
    except ValueError as exc:
        raise ExperimentError(
            f"--seeds {text}: expected comma-separated integers in [0, 2**63), e.g. --seeds "
            f"0,1,2 ({exc})") from None
    return seeds


def member_grid(config: Mapping[str, Any], fixed: Mapping[str, Any],
                swept: Mapping[str, Sequence[Any]], seeds: Sequence[int] = (0,)) -> list[Member]:
    """Every combination of the swept values (last key fastest) and the seeds (fastest).

    >>> grid = member_grid({"lr": 0.01, "dim": 4}, {"dim": 8}, {"lr": ["0.1", 0.3]}, [0, 1])
    >>> [(m.index, m.seed, m.config) for m in grid[:2]]
    [(0, 0, {'lr': 0.1, 'dim': 8}), (1, 1, {'lr': 0.1, 'dim': 8})]
    """
    _check_distinct("--seeds", list(seeds))
    for seed in seeds:
        check_seed(seed, "each seed")
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


@dataclass(frozen=True)
class Ensemble:
    """K members, their experiments, and the template experiment whose step they share."""

    members: tuple[Member, ...]
    experiments: tuple[Experiment, ...]
    template: Experiment
    binding: SweepBinding
    swept: tuple[str, ...]

    @property
    def size(self) -> int:
        """K, the number of members."""
        return len(self.members)

    def hyperparameters(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Each swept key's per-member values as a float64 tensor of shape ``(K,)``."""
        return {
            key: torch.tensor([m.swept[key] for m in self.members], dtype=torch.float64).to(device)
            for key in self.swept
        }


def build_ensemble(
    build: Callable[[dict[str, Any]], Experiment], members: Sequence[Member]
) -> Ensemble:
    """Build each member's experiment and the shared template; check they can share a step."""
    members = tuple(members)
    if not members:
        raise ExperimentError("a sweep needs at least one member")
    experiments = tuple(_built(build, member.config) for member in members)
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
            with binding.building([(member_label(m), m.swept) for m in members]):
                template = _built(build, config)
        except MemberMismatch as exc:  # refused by a swept value: name the script's line
            raise MemberMismatch(f"{exc}{script_line(exc)}") from exc
        except Exception as exc:  # e.g. an argument annotated float that refuses a tensor
            raise _template_failed(swept, exc) from exc
        template = dataclasses.replace(template, name=experiments[0].name)
        check_same_run(experiments, [member_label(member) for member in members])
    return Ensemble(members, experiments, template, binding, swept)


def _template_failed(swept: tuple[str, ...], exc: Exception) -> MemberMismatch:
    """Why the template experiment, built with per-member tensors, failed."""
    cause = exc.__cause__ if isinstance(exc, ExperimentError) and exc.__cause__ else exc
    return MemberMismatch(
        f"experiment(config) with {', '.join(swept)} as per-member tensors failed "
        f"({one_line(cause)}{script_line(cause)}); pass swept keys only to arguments that "
        "accept 0-d tensors (max_grad_norm, mt.optim's lr, weight_decay, eps, momentum, "
        "dampening, alpha and the like; both betas or neither) or use them in tensor "
        "arithmetic"
    )


def check_same_run(experiments: Sequence[Experiment], labels: Sequence[str]) -> None:
    """Refuse members whose runs differ in a count or switch that the loop reads once, from the
    template (member 0's): e.g. an ``eval_every`` taken through ``float()`` of a swept value.

    Shapes are compared where the members' params, states and batches are stacked; a swept value
    reaches sizes only through ``int()``, refused by :class:`SweptValue` where it differs
    (``float()`` of it is member 0's value, as the sweeps tutorial says).
    """
    first = _run(experiments[0])
    for k, experiment in enumerate(experiments[1:], start=1):
        for name, value in _run(experiment).items():
            if value != first[name]:
                raise MemberMismatch(
                    f"member {k} ({labels[k]}) builds a run whose {name} is {value!r} where "
                    f"member 0's is {first[name]!r}; {SIZES_FIX}"
                )


def _run(experiment: Experiment) -> dict[str, Any]:
    """The counts and switches of ``experiment`` that the members share."""
    run = {name: getattr(experiment, name) for name in _RUN_FIELDS}
    return run | {"evaluates": experiment.evaluate is not None,
                  "clips": experiment.max_grad_norm is not None}


# Fields of the template experiment that the members share (the loop reads them once).
_RUN_FIELDS = ("steps", "has_aux", "eval_every", "tokens_per_batch", "flops_per_step",
               "uses_key")


def _built(build: Callable[[dict[str, Any]], Experiment], config: dict[str, Any]) -> Experiment:
    experiment = build(dict(config))
    if not isinstance(experiment, Experiment):
        raise ExperimentError(
            f"experiment(config) must return a minitrain.Experiment, got "
            f"{type(experiment).__name__}"
        )
    return experiment


def load_sweep(path: str | Path, items: Sequence[str] = (), seeds: Sequence[int] = (0,),
               steps: int | None = None) -> Ensemble:
    """Import an experiment script and build the ensemble of its ``--set``/``--seeds`` grid."""
    with script_folder(path):
        config, script_build = load_script(path)
        fixed, swept = parse_sweep(items)
        if steps is not None and "steps" in config:
            fixed["steps"] = str(steps)
            swept.pop("steps", None)
        members = member_grid(config, fixed, swept, seeds)

        def build(member_config: dict[str, Any]) -> Experiment:
            return build_experiment(script_build, member_config, path, steps)

        return build_ensemble(build, members)
