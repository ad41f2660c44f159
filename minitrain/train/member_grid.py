"""The members of a sweep: the grid of ``--set`` lists and ``--seeds``.

See :mod:`minitrain.train.sweep` for how a sweep trains its members.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from minitrain.train.experiment import (
    ExperimentError,
    apply_overrides,
    coerce_value,
    parse_overrides,
)

__all__ = ["Member", "member_grid", "member_label", "parse_seeds", "parse_sweep"]


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
