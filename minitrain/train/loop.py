"""The fit loop: the one impure shell around every pure train step.

One loop serves single runs, vmapped sweeps and data parallel; what differs sits behind a
:class:`~minitrain.train.stepper.Stepper`. The loop owns the run directory, stops, finiteness
checks, errors, metrics, progress, the summary and the resource report.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from minitrain import checkpoint, rundir
from minitrain.atomic_io import write_atomic
from minitrain.errors import Interrupted, NonFiniteLoss, ResumeError, StorageError, UserError
from minitrain.metrics import MetricsWriter
from minitrain.train.signals import stop_requests
from minitrain.train.stepper import (
    FitResult,
    Stepper,
    StepTimer,
    after_last_step,
    progress_bar,
    to_stderr,
)

__all__ = ["FitResult", "Stepper", "dumps_finite", "finite_json", "is_due", "run_loop"]

SUMMARY_FILE = "summary.json"


def is_due(step: int, every: int) -> bool:
    """Whether ``step`` is a multiple of ``every`` (never when ``every`` is 0)."""
    return every > 0 and step % every == 0


def finite_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None.

    >>> finite_json({"loss": float("nan"), "steps": [1, float("inf")]})
    {'loss': None, 'steps': [1, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    return value


def dumps_finite(value: Any, **options: Any) -> str:
    """``json.dumps`` that writes null for NaN and infinities.

    >>> dumps_finite({"loss": float("nan")})
    '{"loss": null}'
    """
    return json.dumps(finite_json(value), allow_nan=False, **options)


def run_loop(stepper: Stepper, *, out_dir: str | Path | None = None, log_every: int = 1,
             checkpoint_every: int = 0, keep: int = 3, resume: bool = False,
             overwrite: bool = False, progress: bool = True, tensorboard: bool = False,
             report: bool = False, say: Callable[[str], None] | None = None) -> FitResult:
    """Train ``stepper`` to its last step; return its :class:`FitResult`.

    Raises :class:`NonFiniteLoss`, :class:`Interrupted` (after saving the last finished step),
    :class:`ResumeError`, :class:`ScriptError` and :class:`StorageError`.
    """
    say = say or to_stderr
    main = stepper.parallel is None or stepper.parallel.is_main
    if not main:
        say, progress = (lambda message: None), False
    if log_every < 1 or checkpoint_every < 0 or keep < 1:
        raise ValueError(
            f"need log_every >= 1, checkpoint_every >= 0 and keep >= 1; got {log_every}, "
            f"{checkpoint_every} and {keep}"
        )
    if (checkpoint_every or resume) and out_dir is None:
        raise ResumeError("--checkpoint-every and --resume need a run directory: pass --out DIR")
    if tensorboard and out_dir is None:
        raise UserError("--tensorboard logs to --out/tensorboard: pass --out DIR")
    run_dir = Path(out_dir) if out_dir is not None else None
    owner: rundir.RunOwner | None = None
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(stop_requests())
        if run_dir is not None and main:
            owner = rundir.claim(run_dir, resume=resume, overwrite=overwrite)
            stack.callback(owner.release)
        stepper.init()
        start = _resume(stepper, run_dir, say) if resume else 0
        finished = _finished_summary(stepper, run_dir, start) if resume else None
        if finished is not None:
            say(f"{run_dir} already finished all {start} steps; nothing to do "
                "(pass a larger --steps to train on)")
            return _result(stepper, finished)
        loop = _Loop(stepper, run_dir, start, log_every, checkpoint_every, keep, say, stop,
                     owner)
        loop.train(progress, tensorboard)
        return loop.finish(report)


def _result(stepper: Stepper, summary: dict[str, Any]) -> FitResult:
    return FitResult(getattr(stepper, "params", None), getattr(stepper, "opt_state", None),
                     summary, getattr(stepper, "carry", None))


def _resume(stepper: Stepper, run_dir: Path, say: Callable[[str], None]) -> int:
    """Load the latest valid checkpoint of ``run_dir`` into ``stepper``; its step (0: none)."""
    found = checkpoint.latest_verified(
        run_dir, on_skip=lambda p, reason: say(f"skipping checkpoint {p.name}: {reason}"))
    if found is None:
        if checkpoint.list_checkpoints(run_dir):
            raise ResumeError(
                f"every checkpoint in {run_dir / checkpoint.CHECKPOINTS} failed its checks (see "
                "above); nothing was changed. Move them away to start over, or pass --overwrite"
            )
        say(f"no checkpoint in {run_dir}; starting from step 0")
        return 0
    start = stepper.resume(found, run_dir)  # loads the bytes latest_verified read and checked
    say(f"resuming from {found.path} (step {start})")
    steps = stepper.experiment.steps
    if start > steps:
        raise ResumeError(
            f"the checkpoint in {run_dir} is at step {start}, past --steps {steps}; "
            "pass --steps of at least that, or a new --out"
        )
    return start


def _finished_summary(stepper: Stepper, run_dir: Path, start: int) -> dict[str, Any] | None:
    """The saved summary of a run that already finished every step, else None."""
    if start == 0 or start < stepper.experiment.steps:
        return None
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("steps") == start else None


class _Loop:
    """The state of one pass of the step loop (kept in one place so every exit saves)."""

    def __init__(self, stepper: Stepper, run_dir: Path | None, start: int, log_every: int,
                 checkpoint_every: int, keep: int, say: Callable[[str], None], stop: Any,
                 owner: rundir.RunOwner | None = None) -> None:
        self.stepper, self.run_dir, self.start, self.owner = stepper, run_dir, start, owner
        self.log_every, self.checkpoint_every, self.keep = log_every, checkpoint_every, keep
        self.say, self.stop = say, stop
        self.done = start  # the last finished, finiteness-checked step
        self.saved: int | None = None  # the step of the last checkpoint (rank 0's, on a worker)
        self.timer = StepTimer(stepper.backend.synchronize)
        self.main = stepper.parallel is None or stepper.parallel.is_main
        self.writes = run_dir is not None and self.main

    def train(self, progress: bool, tensorboard: bool) -> None:
        stepper = self.stepper
        steps, parallel = stepper.experiment.steps, stepper.parallel
        with contextlib.ExitStack() as stack:
            metrics = None
            if self.writes:
                with self._storage_errors():
                    metrics = stack.enter_context(
                        MetricsWriter(self.run_dir, self.start, tensorboard))
            advance = stack.enter_context(
                progress_bar(stepper.experiment.name, steps, self.start, enabled=progress)
            )
            try:
                for step in range(self.start + 1, steps + 1):
                    requested = self.stop.requested
                    if requested if parallel is None else parallel.any(requested):
                        break
                    stepper.step(step)
                    self.timer.tick(step - self.start)
                    self._after_step(step, metrics, advance)
            except (NonFiniteLoss, StorageError):
                raise
            except KeyboardInterrupt:  # raised in the script, or outside our handlers
                self._save_on_error()
                raise Interrupted(self._stop_message(self.stepper.current_step)) from None
            except BaseException:
                self._save_on_error()
                raise

    def _after_step(self, step: int, metrics: Any, advance: Any) -> None:
        stepper, experiment = self.stepper, self.stepper.experiment
        is_checkpoint = is_due(step, self.checkpoint_every) and step < experiment.steps
        is_eval = (self.main and experiment.evaluate is not None
                   and is_due(step, experiment.eval_every))
        if is_due(step, self.log_every) or step == experiment.steps or is_checkpoint or is_eval:
            stepper.check_finite()
            self.done = step
            records = stepper.records(step, self.timer.rates(stepper.examples), is_eval)
            if metrics is not None:
                self._check_run_dir(step)
                with self._storage_errors(step):
                    for record in records:
                        metrics.write(step, **record)
            advance(step, stepper.loss)
        if is_checkpoint:
            self._save(step)

    def _path(self, step: int) -> Path:
        return checkpoint.checkpoint_path(self.run_dir, step)

    def _save(self, step: int) -> None:
        if step <= self.start or step == self.saved:
            return
        if self.writes:
            self._check_run_dir(step)
            with self._storage_errors(step):
                self.stepper.save(self.run_dir, step, self.keep)
        if self.run_dir is not None:
            self.saved = step

    def _finite_step(self) -> int:
        """The last step taken, checked finite (:class:`NonFiniteLoss` otherwise)."""
        step = self.stepper.current_step
        if step > self.done:
            self.stepper.check_finite()
        return step

    def _save_on_error(self) -> None:
        """An exception stopped the loop: save the last good step (never a bad one)."""
        if self.run_dir is None:
            return
        try:
            self._save(self._finite_step())
        except Exception as inner:  # the original error is what the user must see
            self.say(f"could not save a checkpoint after the error: {inner}")
            return
        if self.saved is not None and self.writes:
            self.say(f"saved the last good step ({self.saved}) to {self._path(self.saved)}")

    def finish(self, report: bool) -> FitResult:
        stepper = self.stepper
        last = self._finite_step()
        stopped = last < stepper.experiment.steps
        if self.run_dir is not None and last > self.start:
            self._save(last)
        if stopped:
            raise Interrupted(self._stop_message(last))
        with self._storage_errors(last):
            summary = after_last_step("the summary", lambda: stepper.summary(self.timer),
                                      None, self.say)
            report = report and summary is not None  # the report reads the summary's timing
            summary = summary or _bare_summary(stepper)
            summary["resumed_from"] = self.start or None
            if report and not self.stop.requested and self.main:
                resources = after_last_step("the resource report",
                                            lambda: stepper.report(summary), None, self.say)
                if resources is not None:
                    summary["resources"] = resources
            if self.writes:
                self._check_run_dir(last)
                _write_summary(self.run_dir / SUMMARY_FILE, summary)
        if self.stop.requested:
            where = f"is in {self._path(last)}" if self.saved else "was not written (no --out)"
            raise Interrupted(
                f"stopped by {self.stop.first} after the last step ({last}); the checkpoint "
                + where + (" and summary.json is written" if self.writes else "")
            )
        return _result(stepper, summary)

    def _check_run_dir(self, step: int) -> None:
        """Raise :class:`StorageError` if the claimed run directory was removed or moved."""
        gone = self.owner.gone() if self.owner is not None else None
        if gone is None:
            return
        run_dir, moved, last = self.run_dir, gone.moved_to, self.saved or self.start or None
        path = self._path(last) if last is not None else None
        if path is not None and moved is not None:
            with contextlib.suppress(ValueError):
                path = moved / path.relative_to(run_dir)
        kept = path is not None and path.is_dir()
        if kept and moved is None:  # perhaps an `rm -rf` still at work: let it finish
            kept = _survives(path)
        what = (f"moved to {moved}" if moved is not None
                else "removed in part" if kept  # its lock file is gone
                else "removed")
        what = f"the run directory {run_dir} was {what} while the run trained"
        if last is None:
            where = "no checkpoint had been saved; rerun it"
        elif kept:
            where = (f"the last checkpoint (step {last}) is {'in' if moved else 'still in'} "
                     f"{path}; continue with --resume --out {moved or run_dir}")
        else:
            where = (f"its checkpoints went with it (the last was step {last}), so "
                     "nothing of this run is kept; rerun it")
        raise StorageError(f"{what} (noticed at step {step}); {where}", run_dir)

    def _stop_message(self, step: int) -> str:
        if self.saved == step:
            return (f"stopped at step {step}; checkpoint saved to {self._path(step)}; continue "
                    "with --resume")
        where = "no --out was given" if self.run_dir is None else "no step finished"
        return f"stopped at step {step}; {where}, so no checkpoint was saved"

    @contextlib.contextmanager
    def _storage_errors(self, step: int | None = None) -> Iterator[None]:
        """An OSError is a :class:`StorageError`, or says the run directory went away at ``step``.
        """
        try:
            yield
        except (OSError, StorageError) as exc:
            if step is not None:
                self._check_run_dir(step)
            if isinstance(exc, StorageError):
                raise
            raise StorageError.from_os_error(exc, exc.filename, "write") from None


def _survives(path: Path, settle: float = 0.5) -> bool:
    """Whether ``path`` is still a directory after ``settle`` seconds (a removal takes it sooner).
    """
    deadline = time.monotonic() + settle
    while path.is_dir():
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.02)
    return False


def _bare_summary(stepper: Stepper) -> dict[str, Any]:
    """What a summary holds when the full one could not be computed."""
    experiment, loss = stepper.experiment, stepper.loss
    return {"name": experiment.name, "backend": stepper.backend.name, "steps": experiment.steps,
            "final_loss": loss if math.isfinite(loss) else None}


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, written aside and renamed into place."""
    if path.is_dir():
        raise StorageError(
            f"cannot write {path}: it is a directory; move it away and rerun with --resume", path
        )
    write_atomic(path, dumps_finite(summary, indent=2) + "\n")
