"""The experiment-script contract and its loader.

A script defines ``CONFIG`` (a dict of defaults; ``--set key=value`` overrides a key, coerced to
the default's type) and ``experiment(config) -> Experiment``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import reprlib
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minitrain.accounting.units import parse_number
from minitrain.checkpoint import _MAX_STATE_BYTES
from minitrain.errors import ExperimentError, ResumeError
from minitrain.train.script_errors import one_line, raised_at
from minitrain.tree import Params, PyTree

__all__ = [
    "Experiment", "check_loss_output", "ExperimentError", "ResumeError", "apply_overrides",
    "as_recorded", "build_experiment", "check_config_size", "check_config_value", "check_seed",
    "coerce_value", "load_experiment", "load_script", "parse_overrides", "script_folder",
]


@dataclass(frozen=True)
class Experiment:
    """Everything a run needs, as plain functions and values.

    Attributes:
        init: ``init(generator) -> params``.
        loss: ``loss(params, batch) -> 0-d tensor`` (``(loss, aux dict)`` with ``has_aux``).
        next_batch: ``next_batch(generator) -> batch``, drawn with that generator only.
        optimizer: an ``mt.optim`` optimizer.
        steps: number of optimizer steps.
        evaluate: optional ``evaluate(params) -> {"name": float}``, every ``eval_every`` steps
            (0: only at the end).
        tokens_per_batch: examples per batch for the 6·B·P rule (default: the leading dimension).
        flops_per_step: exact FLOPs of one step by the model's own formula, if known.
        max_grad_norm: clip gradients to this global norm (None: no clipping).
        init_state: ``init_state(generator) -> state`` for buffers a forward updates; then
            ``loss(params, state, batch) -> (loss, new_state)`` and ``evaluate(params, state)``.
        loss_scale: the dynamic loss scale of an fp16 run (default: GradScaler's).
        uses_key: the loss draws its randomness from ``loss(..., key=key)``, ``key =
            mt.random.fold_in(mt.random.key(seed), step)``: a resumed run draws what an
            uninterrupted one would, ranks draw alike, sweep members from their own seeds.

    >>> import minitrain as mt
    >>> exp = Experiment(init=lambda g: {"w": torch.zeros(2)},
    ...     loss=lambda p, batch: ((batch @ p["w"] - 1) ** 2).mean(),
    ...     next_batch=lambda g: torch.randn(4, 2, generator=g),
    ...     optimizer=mt.optim.sgd(lr=0.1), steps=10)
    >>> exp.steps
    10
    """

    init: Callable[[torch.Generator], Params]
    loss: Callable[[Params, PyTree], Any]
    next_batch: Callable[[torch.Generator], PyTree]
    optimizer: Any
    steps: int
    has_aux: bool = False
    evaluate: Callable[[Params], Mapping[str, float]] | None = None
    eval_every: int = 0
    tokens_per_batch: int | None = None
    flops_per_step: int | float | None = None
    max_grad_norm: float | int | torch.Tensor | None = None  # a tensor: a swept value
    name: str = "experiment"
    extras: Mapping[str, Any] = field(default_factory=dict)
    init_state: Callable[[torch.Generator], PyTree] | None = None
    loss_scale: Any = None
    uses_key: bool = False

    def __post_init__(self) -> None:
        for name, expected, ok in _FIELDS:
            value = getattr(self, name)
            if not ok(value):
                shown = repr(value) if isinstance(value, _PLAIN) else type(value).__name__
                raise ExperimentError(f"Experiment.{name} must be {expected}, got {shown}")
        norm = self.max_grad_norm
        if isinstance(norm, torch.Tensor) and not norm > 0:  # a swept value: checked per member
            raise ExperimentError(f"Experiment.max_grad_norm must be positive, got {norm}")


_PLAIN = (int, float, str, type(None))
# How deep lists and dicts may nest in a config (checked without recursion).
MAX_CONFIG_DEPTH = 100
# JSON bytes a config may take: what a checkpoint's state.json may hold, less room for the rest.
MAX_CONFIG_BYTES = _MAX_STATE_BYTES - 4 * 2**20


def check_seed(seed: Any, what: str = "seed") -> None:
    """Refuse a seed that is not an int in ``[0, 2**63)`` (numpy's SeedSequence and torch)."""
    if not _int(seed, 0):
        raise ExperimentError(f"{what} must be an int in [0, 2**63), got {seed!r}")


def _int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**63


def _number(value: Any, positive: bool) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and (value > 0 if positive else value >= 0))


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


# Every field of an Experiment: what it must be (checked before any step runs).
_FIELDS: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("init", "a function: generator -> params", callable),
    ("loss", "a function: (params, batch) -> loss", callable),
    ("next_batch", "a function: generator -> batch", callable),
    ("optimizer", "an mt.optim optimizer (with init and update)",
     lambda o: hasattr(o, "init") and hasattr(o, "update")),
    ("steps", "an int in [0, 2**63)", lambda v: _int(v, 0)),
    ("has_aux", "True or False", lambda v: isinstance(v, bool)),
    ("evaluate", "None or a function: params -> {name: number}", _optional(callable)),
    ("eval_every", "an int >= 0 (0: evaluate at the end only)", lambda v: _int(v, 0)),
    ("tokens_per_batch", "None or an int >= 1", _optional(lambda v: _int(v, 1))),
    ("flops_per_step", "None or a finite number >= 0", _optional(lambda v: _number(v, False))),
    ("max_grad_norm", "None or a finite number > 0",
     _optional(lambda v: isinstance(v, torch.Tensor) or _number(v, True))),
    ("name", "a non-empty str", lambda v: isinstance(v, str) and bool(v.strip())),
    ("extras", "a dict", lambda v: isinstance(v, Mapping)),
    ("init_state", "None or a function: generator -> state", _optional(callable)),
    ("loss_scale", "None or a loss scale (mt.precision.dynamic_loss_scale())",
     _optional(lambda v: hasattr(v, "init"))),
    ("uses_key", "True or False", lambda v: isinstance(v, bool)),
)


def check_loss_output(loss: Any, aux: Any) -> None:
    """Refuse what a loss function should not return, naming it.

    >>> check_loss_output(torch.ones(3), {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    minitrain.errors.ExperimentError: the loss returned a tensor of shape (3,); return one ...
    """
    if not isinstance(loss, torch.Tensor):
        raise ExperimentError(
            f"the loss returned {type(loss).__name__}; return a 0-d float tensor (with "
            "has_aux=True: a (loss, aux dict) pair)"
        )
    if loss.ndim != 0:
        raise ExperimentError(
            f"the loss returned a tensor of shape {tuple(loss.shape)}; return one number "
            "(a 0-d float tensor), e.g. the batch mean"
        )
    if not loss.is_floating_point():
        raise ExperimentError(f"the loss returned a {loss.dtype} tensor; return a float tensor")
    if not isinstance(aux, Mapping):
        raise ExperimentError(
            f"the loss's aux is a {type(aux).__name__}; return a dict of name -> 0-d tensor"
        )
    for key, value in aux.items():
        if not isinstance(key, str):
            raise ExperimentError(f"the loss's aux has a key {key!r}; use str names")
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise ExperimentError(
                f"the loss's aux value {key!r} is {what}; log 0-d tensors (e.g. x.mean())"
            )


def check_config_value(where: str, value: Any) -> None:
    """Refuse a config value a checkpoint cannot record (JSON data with finite numbers only,
    ints in ``[-2**63, 2**63)``, lists and dicts nested at most ``MAX_CONFIG_DEPTH`` deep).

    >>> check_config_value("CONFIG['lr']", float("nan"))
    Traceback (most recent call last):
    ...
    minitrain.errors.ExperimentError: CONFIG['lr'] is nan; config values must be finite numbers, ...
    """
    kind = "config values must be finite numbers, strings, booleans, None, or lists and dicts of "
    kind += "them (each checkpoint records the config); build other objects in experiment(config)"
    todo = [(where, value, 0, where)]
    while todo:  # depth first, without recursion; ``top``: the key of CONFIG it is under
        where, value, depth, top = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ExperimentError(f"{where} is {value}; {kind}")
        if isinstance(value, int) and not isinstance(value, bool) and not _int(value, -(2**63)):
            raise ExperimentError(f"{where} is an int outside [-2**63, 2**63); {kind}")
        if value is None or isinstance(value, bool | int | float | str):
            continue
        if not isinstance(value, list | tuple | dict):
            raise ExperimentError(f"{where} is a {type(value).__name__}; {kind}")
        if depth > MAX_CONFIG_DEPTH:
            raise ExperimentError(f"{top} nests lists and dicts deeper than {MAX_CONFIG_DEPTH} "
                                  f"levels; {kind}")
        for key in value if isinstance(value, dict) else ():
            if not isinstance(key, str):
                raise ExperimentError(f"{where} has the key {reprlib.repr(key)}; {kind} "
                                      "(with str keys)")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in reversed(list(items)):
            child = f"{where}[{key!r}]"
            todo.append((child, item, depth + 1, top if depth else child))


def check_config_size(where: str, config: Mapping[str, Any]) -> None:
    """Refuse a config larger than a checkpoint's ``state.json`` can hold beside the rest."""
    size = len(json.dumps({"meta": {"config": dict(config)}}, indent=1))  # as checkpoint.save
    if size > MAX_CONFIG_BYTES:
        raise ExperimentError(
            f"{where} takes {size} bytes as JSON, over the {MAX_CONFIG_BYTES} a checkpoint "
            "records; read large data from a file in experiment(config)"
        )


def as_recorded(value: Any) -> Any:
    """``value`` as a checkpoint records it (JSON: tuples become lists)."""
    return json.loads(json.dumps(value))


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["lr=0.1", "dim=8"] -> {"lr": "0.1", "dim": "8"}``; a key given two values is refused.

    >>> parse_overrides(["lr=0.1", "name=a=b"])
    {'lr': '0.1', 'name': 'a=b'}
    """
    overrides: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ExperimentError(f"--set expects key=value, got {item!r} (e.g. --set lr=0.1)")
        key, value = key.strip(), value.strip()
        if overrides.get(key, value) != value:
            raise ExperimentError(
                f"--set {key} is given twice ({overrides[key]}, then {value}); pass it once"
            )
        overrides[key] = value
    return overrides


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def coerce_value(key: str, text: str, default: Any) -> Any:
    """Parse ``text`` as the type of ``default`` (int, float, bool, str or None).

    >>> coerce_value("lr", "1e-3", 0.01), coerce_value("dim", "8", 16)
    (0.001, 8)
    >>> coerce_value("dim", "8.5", 16)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    minitrain.errors.ExperimentError: --set dim=8.5: expected an int ...: '8.5' is not a whole ...
    """
    kind = type(default)
    expected = f"--set {key}={text}: expected {{}} (the default is {default!r})"
    if default is None or kind is str:
        return text
    if kind is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise ExperimentError(expected.format("a bool"))
        return text.lower() in _TRUE
    if kind not in (int, float):
        raise ExperimentError(
            f"config key {key!r} has a default of type {kind.__name__}, which --set cannot "
            "override; use an int, float, bool or str default"
        )
    whole = kind is int  # the command line's one number parser: 1e-3, 4k, 1_000; finite
    try:
        value = parse_number(text, "", whole=whole, low=-(2**63) if whole else None,
                             high=2**63 - 1 if whole else None)
    except ValueError as exc:
        what = "an int in [-2**63, 2**63)" if whole else "a float"
        raise ExperimentError(expected.format(f"{what}: {exc}")) from None
    return kind(value)


def apply_overrides(config: Mapping[str, Any], overrides: Mapping[str, str]) -> dict[str, Any]:
    """A copy of ``config`` with each override parsed to the default's type.

    >>> apply_overrides({"lr": 0.01, "steps": 10}, {"lr": "0.1"})
    {'lr': 0.1, 'steps': 10}
    """
    merged = dict(config)
    for key, text in overrides.items():
        if key not in config:
            raise ExperimentError(
                f"unknown config key {key!r}; known keys: {', '.join(sorted(config)) or '(none)'}"
            )
        merged[key] = coerce_value(key, text, config[key])
    return merged


def load_experiment(path: str | Path, overrides: Mapping[str, str] | None = None,
                    steps: int | None = None) -> tuple[Experiment, dict[str, Any]]:
    """Import a script; return ``(experiment, config)`` built from the overridden config.

    ``steps`` overrides CONFIG's ``steps`` (so schedules see it) and the step count. Every mistake
    is an :class:`ExperimentError` with a one-line message.
    """
    with script_folder(path):
        config, build = load_script(path)
        overrides = dict(overrides or {})
        if steps is not None and "steps" in config:
            overrides["steps"] = str(steps)
        config = apply_overrides(config, overrides)
        return build_experiment(build, config, path, steps), config


@contextlib.contextmanager
def script_folder(path: str | Path) -> Iterator[None]:
    """The script's folder first on ``sys.path`` (as ``python script.py`` has it), so that a
    module beside the script imports; ``sys.path`` is as it was afterwards."""
    folder = str(Path(path).resolve().parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # the script may have removed it itself
            sys.path.remove(folder)


def build_experiment(build: Callable[[dict], Any], config: Mapping[str, Any], path: str | Path,
                     steps: int | None = None) -> Experiment:
    """``build(config)``; every failure is an :class:`ExperimentError` naming where."""
    try:
        experiment = build(dict(config))
    except (ExperimentError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # the script failed (sys.exit too): report where, in one line
        raise ExperimentError(
            f"{path}: experiment(config) failed: {describe_failure(exc, path)}"
        ) from exc
    if not isinstance(experiment, Experiment):
        raise ExperimentError(
            f"{path}: experiment(config) must return a minitrain.Experiment, "
            f"got {type(experiment).__name__}"
        )
    if steps is not None:
        experiment = dataclasses.replace(experiment, steps=steps)
    return experiment


def load_script(path: str | Path) -> tuple[Mapping[str, Any], Callable[[dict], Any]]:
    """Import an experiment script; return its ``CONFIG`` and its ``experiment`` function."""
    with script_folder(path):
        module = import_script(Path(path))
    config = getattr(module, "CONFIG", {})
    if not isinstance(config, Mapping):
        raise ExperimentError(f"{path}: CONFIG must be a dict, got {type(config).__name__}")
    check_config_value(f"{path}: CONFIG", dict(config))
    check_config_size(f"{path}: CONFIG", config)
    build = getattr(module, "experiment", None)
    if not callable(build):
        raise ExperimentError(
            f"{path} has no experiment(config) function; define "
            "'def experiment(config) -> minitrain.Experiment' (see examples/linreg.py)"
        )
    return config, build


def import_script(path: Path) -> Any:
    """Import the Python file ``path`` as a module; every failure is an ExperimentError."""
    if not path.exists():
        raise ExperimentError(f"no such experiment script: {path}")
    if path.is_dir() or path.suffix != ".py":
        raise ExperimentError(
            f"{path} is not a Python file; pass a script such as examples/linreg.py"
        )
    module_name = f"minitrain_experiment_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ExperimentError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # sys.exit() at import too: one line, not a silent exit
        del sys.modules[module_name]
        raise ExperimentError(f"{path} failed to import: {describe_failure(exc, path)}") from exc
    return module


def describe_failure(exc: BaseException, path: str | Path) -> str:
    """``"NameError: name 'x' is not defined (line 12)"``, the line taken in ``path``."""
    resolved = str(Path(path).resolve())
    frames = traceback.extract_tb(exc.__traceback__)
    lines = [frame.lineno for frame in frames if str(Path(frame.filename).resolve()) == resolved]
    if isinstance(exc, SyntaxError) and exc.lineno:
        lines.append(exc.lineno)
    where = f"line {lines[-1]}" if lines else ""
    frame = None if isinstance(exc, SyntaxError) else raised_at(exc)
    if frame is not None and str(Path(frame.filename).resolve()) != resolved:
        raised = f"{Path(frame.filename).name} line {frame.lineno}"
        where = f"{raised}, called from {where}" if where else raised
    return f"{one_line(exc)} ({where})" if where else one_line(exc)
