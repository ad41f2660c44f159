"""The members of a sweep: the grid of ``--set`` lists and ``--seeds``, and their ensemble."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
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
from minitrain.train.script_errors import is_user_file, one_line, script_line
from minitrain.train.swept import SIZES_FIX, MemberMismatch, SweepBinding, SweptValue

__all__ = [
    "Ensemble", "Member", "MemberMismatch", "build_ensemble", "load_sweep", "member_grid",
    "check_same_sizes", "member_label", "parse_seeds", "parse_sweep",
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
    """``"0,1,2" -> [0, 1, 2]``; each seed a distinct non-negative int."""
    try:  # the command line's one number parser: 1e3, 1_000; whole, in [0, 2**63)
        seeds = [parse_number(part, "", whole=True, low=0, high=2**63 - 1)
                 for part in text.split(",")]
    except ValueError as exc:
        raise ExperimentError(
            f"--seeds {text}: expected comma-separated integers in [0, 2**63), e.g. --seeds "
            f"0,1,2 ({exc})") from None
    _check_distinct("--seeds", seeds)
    return seeds


def member_grid(config: Mapping[str, Any], fixed: Mapping[str, Any],
                swept: Mapping[str, Sequence[Any]], seeds: Sequence[int] = (0,)) -> list[Member]:
    """Every combination of the swept values (last key fastest) and the seeds (fastest).

    >>> grid = member_grid({"lr": 0.01, "dim": 4}, {"dim": 8}, {"lr": ["0.1", 0.3]}, [0, 1])
    >>> [(m.index, m.seed, m.config) for m in grid[:2]]
    [(0, 0, {'lr': 0.1, 'dim': 8}), (1, 1, {'lr': 0.1, 'dim': 8})]
    """
    if not seeds:
        raise ExperimentError("a sweep needs at least one seed; pass --seeds 0")
    _check_distinct("seeds", list(seeds))
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
        check_same_sizes([_parts(e) for e in experiments],
                         [member_label(member) for member in members],
                         lambda: _parts(_built(build, members[0].config)))
    return Ensemble(members, experiments, template, binding, swept)


def _template_failed(swept: tuple[str, ...], exc: Exception) -> MemberMismatch:
    """Why the template experiment, built with per-member tensors, failed."""
    cause = exc.__cause__ if isinstance(exc, ExperimentError) and exc.__cause__ else exc
    if isinstance(cause, TypeError) and "JSON serializable" in str(cause):
        return MemberMismatch(
            f"experiment(config) writes {', '.join(swept)} to JSON{script_line(cause)} while "
            "the shared step is built, where they are per-member tensors; write "
            "json.dumps(config, default=float), which writes member 0's values there"
        )
    return MemberMismatch(
        f"experiment(config) with {', '.join(swept)} as per-member tensors failed "
        f"({one_line(exc)}); pass swept keys only to arguments that "
        "accept 0-d tensors (max_grad_norm, mt.optim's lr, weight_decay, eps, momentum, "
        "dampening, alpha and the like; both betas or neither) or use them in tensor "
        "arithmetic"
    )


def _parts(experiment: Experiment) -> dict[str, Any]:
    """What :func:`check_same_sizes` compares between members: the run's counts and switches,
    and what init, loss and optimizer hold."""
    run = {name: getattr(experiment, name) for name in _RUN_FIELDS}
    run |= {"evaluates": experiment.evaluate is not None,
            "clips": experiment.max_grad_norm is not None}
    return {"run": run, "init": experiment.init, "loss": experiment.loss,
            "optimizer": experiment.optimizer}


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


def check_same_sizes(parts: Sequence[dict[str, Any]], labels: Sequence[str],
                     rebuild_first: Callable[[], dict[str, Any]] | None = None) -> None:
    """Refuse members whose ``parts`` hold a different int, bool or tensor shape.

    ``rebuild_first`` builds member 0's parts again: a value that differs between two builds of
    one member (a timestamp) comes from no swept value, and passes.

    >>> labels = ["x=2 seed=0", "x=3 seed=0"]
    >>> def schedule(n):
    ...     return lambda count: count / n
    >>> try:
    ...     check_same_sizes([{"optimizer": schedule(10)}, {"optimizer": schedule(15)}], labels)
    ... except MemberMismatch as exc:
    ...     print(str(exc)[:78])
    member 1 (x=3 seed=0) builds an optimizer whose n is 15 where member 0's is 10
    """
    first = [_sizes(part) for part in parts[0].values()]
    again: list[list[tuple[str, str, Any]]] | None = None
    for k, member_parts in enumerate(parts[1:], start=1):
        for index, (what, want, got) in enumerate(
                zip(parts[0], first, map(_sizes, member_parts.values()), strict=True)):
            for at, ((path, where, value), (_, _, expected)) in enumerate(
                    zip(got, want, strict=False)):
                if _STRUCTURE in (value[0] if isinstance(value, tuple) else None,
                                  expected[0] if isinstance(expected, tuple) else None):
                    if value != expected:  # other code (weight_decay=0 leaves a step out): the
                        break  # state layout and first-step checks tell what differs
                elif value != expected:
                    if rebuild_first is not None and again is None:
                        again = [_sizes(part) for part in rebuild_first().values()]
                    if again is not None and _unstable(again[index], want, at):
                        continue
                    raise MemberMismatch(
                        f"member {k} ({labels[k]}) builds {_article(what)} whose {path}"
                        f"{where} is {_shown(value)} where member 0's is {_shown(expected)}; "
                        f"{SIZES_FIX}"
                    )


def _unstable(again: list[tuple[str, str, Any]], first: list[tuple[str, str, Any]],
              at: int) -> bool:
    """Whether entry ``at`` of member 0's sizes differs between two builds that walk alike."""
    if len(again) != len(first) or any(
            (path, where) != (path_0, where_0)
            for (path, where, _), (path_0, where_0, _) in zip(again, first, strict=True)):
        return False
    return again[at][2] != first[at][2]


def _article(what: str) -> str:
    return f"an {what}" if what[0] in "aeiou" else f"a {what}"


def _shown(value: Any) -> str:
    return f"of shape {value[1]}" if isinstance(value, tuple) else repr(value)


_STRUCTURE = "structure"  # the length of a container of code, not of numbers


@dataclasses.dataclass(frozen=True)
class _Length:
    value: int | tuple[str, int]

_DATA = (int, float, complex, str, bytes, type(None), torch.Tensor)


_MAX_NODES = 5000  # objects looked into, per member's loss or optimizer
_MAX_ITEMS = 256
_LEAVES = (float, complex, str, bytes, type(None), type, types.ModuleType, torch.Generator,
           torch.dtype, torch.device)


def _sizes(root: Any) -> list[tuple[str, str, Any]]:
    """``(name, where, value)`` of each int, bool, length and tensor shape reachable from ``root``.
    """
    found: list[tuple[str, str, Any]] = []
    seen: set[int] = set()
    pending: list[tuple[Any, str, str]] = [(root, "value", "")]
    while pending and len(seen) < _MAX_NODES:
        value, name, where = pending.pop()
        if isinstance(value, bool | int | _Length):
            found.append((name, where, value.value if isinstance(value, _Length) else value))
            continue
        if isinstance(value, torch.Tensor):
            found.append((name, where, ("shape", tuple(value.shape))))
            continue
        if isinstance(value, _LEAVES) or id(value) in seen:
            continue
        seen.add(id(value))
        children = _children(value, name, where)
        pending.extend(reversed(children))
    return found


@functools.lru_cache(maxsize=1024)
def _user_file(filename: str) -> bool:
    """:func:`is_user_file`, once per file (it resolves several paths per call)."""
    return is_user_file(filename)


def _children(value: Any, name: str, where: str) -> list[tuple[Any, str, str]]:
    if isinstance(value, types.FunctionType):
        code = value.__code__
        if _user_file(code.co_filename):
            where = f" (held by the function at {Path(code.co_filename).name} line " \
                    f"{code.co_firstlineno})"
        cells = [(var, cell) for var, cell in zip(code.co_freevars, value.__closure__ or (),
                                                 strict=True)]
        children = [(_contents(cell), var, where) for var, cell in cells]
        defaults = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
        return children + [(default, f"{value.__name__}'s default", where)
                           for default in defaults]
    if isinstance(value, functools.partial):
        return [(value.func, name, where), *((arg, name, where) for arg in value.args),
                *((arg, key, where) for key, arg in value.keywords.items())]
    if isinstance(value, types.MethodType):
        return [(value.__func__, name, where), (value.__self__, name, where)]
    if isinstance(value, list | tuple | dict):
        items = value.values() if isinstance(value, dict) else value
        numbers = all(isinstance(item, _DATA) for item in items)
        length = (_Length(len(value) if numbers else (_STRUCTURE, len(value))),
                  f"length of {name}", where)
        if len(value) > _MAX_ITEMS:  # data, not hyperparameters
            return [length]
        if isinstance(value, dict):
            return [length, *((item, str(key), where) for key, item in value.items())]
        fields = getattr(value, "_fields", None) or [name] * len(value)
        return [length, *((item, field, where) for field, item in zip(fields, value, strict=True))]
    if isinstance(value, torch.nn.Module):
        return [(tensor, key, where) for key, tensor in value.state_dict().items()]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return [(item, key, where) for key, item in attributes.items()]
    return []


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return None
