"""The interface between the fit loop and one kind of run, and what every kind reports alike.

The loop owns the run directory, signals and when to check, log, evaluate and save; a
:class:`Stepper` (:class:`~minitrain.train.single.SingleRun`,
:class:`~minitrain.train.sweep.SweepRun`) owns what a step is and what its state holds.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

from minitrain.checkpoint import Verified
from minitrain.errors import MinitrainError, ResumeError
from minitrain.train.experiment import one_line
from minitrain.train.script_errors import script_call

__all__ = ["RESUMABLE_CHANGES", "FitResult", "StepTimer", "Stepper", "after_last_step",
           "changed_keys", "check_same", "evaluated", "evaluation", "fp8_scaling", "progress_bar",
           "resident_bytes", "run_summary", "step_report", "to_stderr"]

# Config keys that may change between a run and its resumption.
RESUMABLE_CHANGES = frozenset({"steps"})


class FitResult(NamedTuple):
    """What a fit returns: params, optimizer state, summary and the carried state, if any."""

    params: Any
    opt_state: Any
    summary: dict[str, Any]
    state: Any = None


class StepTimer:
    """Steady-state step time: from the end of the first step to the end of the last."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self.synchronize = synchronize
        self.start = self.last = time.perf_counter()
        self.steady_start: float | None = None
        self.steady_steps = 0
        self.step_time = 0.0

    def tick(self, steps_this_run: int) -> None:
        now = time.perf_counter()
        self.step_time, self.last = now - self.last, now
        if steps_this_run == 1:
            self.synchronize()
            self.steady_start = self.last = time.perf_counter()
        else:
            self.steady_steps = steps_this_run - 1

    def seconds(self) -> float:
        return self.last - self.start

    def step_seconds(self) -> float:
        if self.steady_steps and self.steady_start is not None:
            return (self.last - self.steady_start) / self.steady_steps
        return self.seconds()

    def rates(self, examples: int | None) -> dict[str, float]:
        rates = {"step_time": self.step_time}
        if examples:
            rates["examples_per_s"] = examples / self.step_time if self.step_time else 0.0
        return rates


@runtime_checkable  # beartype checks run_loop's argument against it
class Stepper(Protocol):
    """What the loop needs from one kind of run (it reads ``params``, ``opt_state``, ``carry``)."""

    experiment: Any  # name, steps, evaluate and eval_every (a sweep's shared template)
    backend: Any
    parallel: Any  # a DataParallel (rank 0 alone writes and prints), or None
    current_step: int  # the last step taken
    loss: float  # what the progress bar shows
    examples: int | None  # examples (or tokens) per step

    # params, optimizer state and data generators of step 0
    def init(self) -> None: ...
    # refuse a checkpoint of another run (its ``meta``, before loading), load it; its step
    def resume(self, found: Verified, run_dir: Path) -> int: ...
    def save(self, run_dir: Path, step: int, keep: int) -> Path: ...
    def step(self, step: int) -> None: ...
    # raise NonFiniteLoss for a step since the last check that was not finite
    def check_finite(self) -> None: ...
    # the metrics lines of a logged step (with the evaluation when ``evaluate``)
    def records(self, step: int, rates: dict[str, float], evaluate: bool) -> list[dict]: ...
    # the final evaluation, then the summary
    def summary(self, timer: StepTimer) -> dict[str, Any]: ...
    # the resource report: predicted against measured memory, FLOPs, MFU
    def report(self, summary: dict[str, Any]) -> dict[str, Any]: ...


T = TypeVar("T")


def after_last_step(what: str, compute: Callable[[], T], default: T,
                    say: Callable[[str], None] | None = None) -> T:
    """``compute()``, or ``default`` and one warning line naming ``what`` if it fails: nothing
    computed after the last step (evaluation, summary, report, plot) fails a finished run.

    >>> after_last_step("the answer", lambda: 1 / 0, None, say=print)
    warning: could not compute the answer: ZeroDivisionError: division by zero
    """
    try:
        return compute()
    except Exception as exc:
        reason = str(exc) if isinstance(exc, MinitrainError) else one_line(exc)
        (say or to_stderr)(f"warning: could not compute {what}: {reason}")
        return default


def check_same(saved: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...],
               run_dir: Path, what: str, advice: str = "use the same value") -> None:
    """Refuse to resume ``run_dir`` when one of ``keys`` of its checkpoint's meta differs.

    >>> check_same({"seed": 1}, {"seed": 2}, ("seed",), Path("out"), "run")
    Traceback (most recent call last):
    ...
    minitrain.errors.ResumeError: out was trained with seed=1, this run has seed=2; use the same value to resume, or a new --out
    """  # noqa: E501
    for key in keys:
        if saved.get(key) != current.get(key):
            raise ResumeError(
                f"{run_dir} was trained with {key}={saved.get(key)!r}, this {what} has "
                f"{key}={current.get(key)!r}; {advice} to resume, or a new --out"
            )


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The config keys whose values differ, but for those a resumed run may change.

    >>> changed_keys({"lr": 0.1, "steps": 5}, {"lr": 0.2, "steps": 9})
    ['lr']
    """
    return [key for key in sorted(set(old) | set(new))
            if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key)]


def evaluated(evaluate: Callable[..., Any], *args: Any, step: int | None = None
              ) -> dict[str, float]:
    """``evaluate(*args)`` as a dict of floats; anything else is a :class:`ScriptError`."""
    with script_call("evaluate(params)", step):
        return {str(key): float(value) for key, value in evaluate(*args).items()}


def evaluation(evaluate: Callable[..., Any], *args: Any, step: int | None, steps: int,
               what: str = "the final evaluation", say: Callable[[str], None] | None = None
               ) -> dict[str, float]:
    """:func:`evaluated` at ``step``; the final one (``step`` None or ``steps``), if it fails, is
    one warning line naming ``what`` and no metrics."""
    def compute() -> dict[str, float]:
        return evaluated(evaluate, *args, step=step)

    if step is not None and step < steps:
        return compute()
    return after_last_step(what, compute, {}, say)


def run_summary(stepper: Stepper, timer: StepTimer, head: dict[str, Any],
                params: dict[str, int], members: int = 1) -> dict[str, Any]:
    """The summary's common part: name, backend, ``head``, timing, ``params`` and FLOPs per step.

    FLOPs follow the chapter (3.5.6): 2·B·P forward + 4·B·P backward, for each of ``members``.
    """
    experiment, backend = stepper.experiment, stepper.backend
    backend.synchronize()
    examples, step_seconds = stepper.examples or 0, timer.step_seconds()
    exact = experiment.flops_per_step
    return {
        "name": experiment.name, "backend": backend.name, **head, "steps": experiment.steps,
        "seconds": timer.seconds(), "step_seconds": step_seconds, **params,
        "examples_per_step": examples * members,
        "flops_per_step": 6 * examples * params["params"],
        "flops_per_step_exact": exact * members if exact is not None else None,
        "examples_per_second": examples * members / step_seconds if step_seconds > 0 else None,
    }


def fp8_scaling(history: Any) -> dict[str, Any]:
    """The summary's record of delayed fp8 scaling: amax history length and matmul count."""
    if history is None:
        return {}
    return {"fp8_scaling": {"amax_history": history.shape[-1], "matmuls": history.shape[-3]}}


def step_report(stepper: Any, step: Callable[..., Any], summary: dict[str, Any], *,
                examples_scale: float = 1.0, flops_scale: float | int = 1,
                **prediction: Any) -> dict[str, Any]:
    """The resource report of ``step`` on the stepper's last batch (predicted vs measured)."""
    from minitrain.accounting import backend_peak_flops, resource_report

    experiment, exact = stepper.experiment, stepper.experiment.flops_per_step
    return resource_report(
        step, stepper.params, stepper.opt_state, stepper.batch, **prediction,
        examples_per_step=round((stepper.examples or 0) * examples_scale) or None,
        exact_flops_per_step=round(exact * flops_scale) if exact is not None else None,
        peak_flops=backend_peak_flops(stepper.backend), step_seconds=summary["step_seconds"],
        steps_total=experiment.steps, steps_done=experiment.steps,
    )


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@contextlib.contextmanager
def progress_bar(
    name: str, total: int, start: int, enabled: bool
) -> Iterator[Callable[[int, float], None]]:
    """A rich progress bar on stderr (steps, elapsed, ETA, live loss); yields
    ``advance(step, loss)``. Disabled, it yields a function that does nothing."""
    if not enabled:
        yield lambda step, loss: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        TextColumn("loss {task.fields[loss]}"), console=Console(stderr=True), refresh_per_second=4,
    )
    with progress:
        task = progress.add_task(name, total=total, completed=start, loss="-")

        def advance(step: int, loss: float) -> None:
            progress.update(task, completed=step, loss=f"{loss:.4g}")

        yield advance


def to_stderr(message: str) -> None:
    """Print a progress message on stderr (stdout stays clean for ``--json``)."""
    print(message, file=sys.stderr, flush=True)


def resident_bytes() -> int | None:
    """This process's resident memory (RSS) from ``/proc/self/statm``; None where unavailable."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None
