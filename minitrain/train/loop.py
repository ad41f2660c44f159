"""The fit loop: the impure shell around the pure train step.

It is the one place in training that touches clocks, devices, files, signals and global RNG
state: seed, init (or resume from the latest valid checkpoint), loop over steps
(batch -> device -> step), log, checkpoint, and summarize.

A run directory holds ``metrics.jsonl``, ``checkpoints/step-NNNNNNNN/`` and ``summary.json``.
A checkpoint holds everything the next step depends on (params, optimizer state, the data
generator and the global RNGs), so a run resumed with ``resume=True`` ends bit-identical to an
uninterrupted one on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from minitrain import checkpoint, rng
from minitrain.backend import Backend
from minitrain.metrics import MetricsWriter
from minitrain.optim import learning_rate
from minitrain.train.experiment import Experiment, ExperimentError, one_line
from minitrain.train.step import can_donate, make_train_step
from minitrain.tree import OptState, Params, leaves, size
from minitrain.tree import map as tree_map

__all__ = [
    "FitResult",
    "Interrupted",
    "NonFiniteLoss",
    "ResumeError",
    "StepTimer",
    "batch_examples",
    "fit",
    "graceful_stop",
    "is_due",
    "progress_bar",
    "resident_bytes",
    "run_generators",
    "save_final_or_interrupt",
    "to_backend",
    "to_stderr",
]

# Config keys that may change between a run and its resumption.
RESUMABLE_CHANGES = frozenset({"steps"})


class FitResult(NamedTuple):
    """What :func:`fit` returns: the trained params, the optimizer state and the summary."""

    params: Params
    opt_state: OptState
    summary: dict[str, Any]


class NonFiniteLoss(RuntimeError):
    """The loss (or the gradient norm) became NaN or infinite; the run stopped."""


class Interrupted(RuntimeError):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run after a checkpoint was written."""


class ResumeError(ExperimentError):
    """``resume=True`` cannot continue this run (no run directory, a different config, ...)."""


def run_generators(seed: int) -> tuple[torch.Generator, torch.Generator]:
    """Independent ``(init, data)`` generators derived from one seed (numpy SeedSequence).

    >>> a, _ = run_generators(0); b, _ = run_generators(0)
    >>> torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))
    True
    """
    init_seq, data_seq = np.random.SeedSequence(seed).spawn(2)
    return (
        rng.generator(int(init_seq.generate_state(1, np.uint64)[0])),
        rng.generator(int(data_seq.generate_state(1, np.uint64)[0])),
    )


def to_backend(params: Params, backend: Backend) -> Params:
    """Params on the backend's device; floating leaves in its ``param_dtype``."""

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        dtype = backend.param_dtype if leaf.is_floating_point() else leaf.dtype
        return leaf.to(device=backend.device, dtype=dtype)

    return tree_map(move, params)


def batch_examples(batch: Any) -> int:
    """Examples in a batch: the leading dimension of its first tensor (1 for a 0-d tensor).

    >>> batch_examples((torch.zeros(4, 16), torch.zeros(4)))
    4
    """
    tensors = [leaf for leaf in leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        return 1
    return int(tensors[0].shape[0])


@functools.cache
def _statm() -> int | None:
    try:
        return os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None


def resident_bytes() -> int | None:
    """This process's resident memory (RSS) from ``/proc/self/statm``; None where unavailable.

    >>> resident_bytes() is None or resident_bytes() > 0
    True
    """
    fd = _statm()
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def fit(
    experiment: Experiment,
    backend: Backend,
    *,
    seed: int = 0,
    out_dir: str | Path | None = None,
    log_every: int = 1,
    checkpoint_every: int = 0,
    keep: int = 3,
    resume: bool = False,
    progress: bool = True,
    compile: bool = False,
    tensorboard: bool = False,
    report: bool = False,
    config: dict[str, Any] | None = None,
    say: Callable[[str], None] | None = None,
    parallel: Any = None,
) -> FitResult:
    """Train ``experiment`` on ``backend``; return params, optimizer state and the summary.

    Args:
        out_dir: run directory for ``metrics.jsonl``, checkpoints and ``summary.json``.
        log_every: log (and check the loss is finite) every this many steps.
        checkpoint_every: also checkpoint every this many steps (0: only at the end, on
            Ctrl-C and on SIGTERM). Needs ``out_dir``.
        keep: how many checkpoints to keep.
        resume: continue from the latest valid checkpoint in ``out_dir`` (if there is one).
        report: add the resource report (predicted vs measured memory, FLOPs, MFU).
        say: where progress messages go (default: stderr).
        parallel: a :class:`minitrain.distributed.DataParallel` for data-parallel training:
            each rank draws the global batch and trains on its shard, gradients are
            all-reduced in the step, and rank 0 alone logs, evaluates and writes checkpoints.

    Raises :class:`NonFiniteLoss` (the last good checkpoint stays as it was),
    :class:`Interrupted` after Ctrl-C (a checkpoint of the last finished step is written first)
    and :class:`ResumeError`.
    """
    say = say or to_stderr
    main = parallel is None or parallel.is_main  # the rank that writes and reports
    if not main:
        say, progress = (lambda message: None), False
    if log_every < 1 or checkpoint_every < 0 or keep < 1:
        raise ValueError(
            f"need log_every >= 1, checkpoint_every >= 0 and keep >= 1; got {log_every}, "
            f"{checkpoint_every} and {keep}"
        )
    if (checkpoint_every or resume) and out_dir is None:
        raise ResumeError("--checkpoint-every and --resume need a run directory: pass --out DIR")
    run_dir = Path(out_dir) if out_dir is not None else None
    meta = _run_meta(experiment, backend, seed, config)

    params, opt_state, start, data_generator = _initial_state(
        experiment, backend, seed, run_dir if resume else None, meta, say
    )
    if parallel is not None:
        parallel.check_same(start, "the step to resume from")
    # The loop never reads the params and state it passes in again, so the update may write
    # into their buffers (torch.optim's in-place speed).
    compiled = make_train_step(
        experiment, backend, parallel.reduce if parallel else None,
        donate=can_donate(experiment.optimizer), compile=compile,
    )

    def save(step: int) -> Path:
        if not main:
            return checkpoint.checkpoint_path(run_dir, step)
        return checkpoint.save(
            run_dir, step, params, opt_state, meta, generator=data_generator, keep=keep
        )

    examples = experiment.tokens_per_batch
    loss_value, last_eval = float("nan"), {}
    batch = None
    step = start
    timer = StepTimer(backend)
    with contextlib.ExitStack() as stack:
        metrics = (
            stack.enter_context(MetricsWriter(run_dir, start, tensorboard))
            if run_dir is not None and main
            else None
        )
        stop_requested = stack.enter_context(graceful_stop())
        advance = stack.enter_context(progress_bar(experiment, start, enabled=progress))
        for step in range(start + 1, experiment.steps + 1):
            if stop_requested() if parallel is None else parallel.any(stop_requested()):
                step -= 1  # the last finished step
                break
            with _user_code("the first train step", enabled=step == start + 1):
                batch = experiment.next_batch(data_generator)
                if examples is None:
                    examples = batch_examples(batch)
                if parallel is not None:
                    batch = parallel.shard(batch)
                batch = backend.to_device(batch)
                out = compiled(params, opt_state, batch)
            timer.tick(step - start)
            is_checkpoint = is_due(step, checkpoint_every) and step < experiment.steps
            is_eval = (
                experiment.evaluate is not None and main and is_due(step, experiment.eval_every)
            )
            if is_due(step, log_every) or step == experiment.steps or is_checkpoint or is_eval:
                loss_value = _finite_loss(out, step)
                record = _step_record(out, loss_value, timer, examples)
                if is_eval:
                    last_eval = {k: float(v) for k, v in experiment.evaluate(out.params).items()}
                    record.update(last_eval)
                if metrics is not None:
                    metrics.write(step, **record)
                advance(step, loss_value)
            params, opt_state = out.params, out.opt_state
            if is_checkpoint:
                save(step)
    save_final_or_interrupt(step, start, experiment.steps, run_dir, save)
    if experiment.evaluate is not None and main and not last_eval:
        last_eval = {k: float(v) for k, v in experiment.evaluate(params).items()}
    summary = _summary(experiment, backend, seed, config, params, examples or 0, timer)
    summary.update(final_loss=loss_value, resumed_from=start or None)
    if last_eval:
        summary["eval"] = last_eval
    if parallel is not None:
        summary["ranks"] = parallel.world_size
    if report and batch is not None and main:
        summary["resources"] = _resources(
            experiment, backend, params, opt_state, batch, summary, parallel
        )
    if run_dir is not None and main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return FitResult(params, opt_state, summary)


@contextlib.contextmanager
def _user_code(what: str, enabled: bool = True) -> Iterator[None]:
    """Report a failure of the experiment's own code (a bad config, a shape mismatch in the
    loss) as a one-line :class:`ExperimentError`: it is the script's mistake, not the loop's."""
    if not enabled:
        yield
        return
    try:
        yield
    except (ValueError, TypeError, IndexError, RuntimeError) as exc:
        if isinstance(exc, ExperimentError):
            raise
        raise ExperimentError(f"{what} failed: {one_line(exc)}") from exc


def save_final_or_interrupt(
    step: int, start: int, total: int, run_dir: Path | None, save: Callable[[int], Path]
) -> None:
    """After the step loop: checkpoint the last finished step (with a run directory), then
    raise :class:`Interrupted` if the loop stopped before ``total``."""
    path = save(step) if run_dir is not None and step > start else None
    if step == total:
        return
    if path is not None:
        raise Interrupted(
            f"stopped at step {step}; checkpoint saved to {path}; continue with --resume"
        )
    where = "no --out was given" if run_dir is None else "no step finished"
    raise Interrupted(f"stopped at step {step}; {where}, so no checkpoint was saved")


def _initial_state(
    experiment: Experiment,
    backend: Backend,
    seed: int,
    resume_from: Path | None,
    meta: dict[str, Any],
    say: Callable[[str], None],
) -> tuple[Params, OptState, int, torch.Generator]:
    """Seed, init params and optimizer state, and resume from ``resume_from`` if given.

    Returns ``(params, opt_state, step, data_generator)``.
    """
    rng.seed_everything(seed)
    init_generator, data_generator = run_generators(seed)
    with _user_code("the experiment's init(generator)"):
        params = to_backend(experiment.init(init_generator), backend)
    opt_state = experiment.optimizer.init(params)
    start = 0
    if resume_from is not None:
        params, opt_state, start = _resume(
            resume_from, params, opt_state, data_generator, meta, say
        )
    if start > experiment.steps:
        raise ResumeError(
            f"the checkpoint in {resume_from} is at step {start}, past --steps "
            f"{experiment.steps}; pass --steps of at least that, or a new --out"
        )
    return params, opt_state, start, data_generator


def _step_record(
    out: Any, loss_value: float, timer: StepTimer, examples: int | None
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line (without the step): loss, lr, grad norm, aux, speed, RSS."""
    return {
        "loss": loss_value,
        "lr": learning_rate(out.opt_state),
        "grad_norm": float(out.grad_norm),
        **{key: float(value) for key, value in out.aux.items()},
        **timer.rates(examples),
        "rss_bytes": resident_bytes(),
    }


def is_due(step: int, every: int) -> bool:
    """Whether ``step`` is a multiple of ``every`` (never when ``every`` is 0).

    >>> is_due(10, 5), is_due(10, 0), is_due(7, 5)
    (True, False, False)
    """
    return every > 0 and step % every == 0


def _finite_loss(out: Any, step: int) -> float:
    loss_value = float(out.loss)
    if not (math.isfinite(loss_value) and math.isfinite(float(out.grad_norm))):
        raise NonFiniteLoss(
            f"loss became {loss_value} (grad norm {float(out.grad_norm)}) at step {step}; "
            "the last checkpoint is kept; lower the learning rate (--set lr=...) or clip "
            "gradients"
        )
    return loss_value


def _run_meta(
    experiment: Experiment, backend: Backend, seed: int, config: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "experiment": experiment.name,
        "seed": seed,
        "backend": backend.name,
        "config": config or {},
    }


def _resume(
    run_dir: Path,
    params: Params,
    opt_state: OptState,
    data_generator: torch.Generator,
    meta: dict[str, Any],
    say: Callable[[str], None],
) -> tuple[Params, OptState, int]:
    path = checkpoint.latest_valid(
        run_dir, on_skip=lambda p, reason: say(f"skipping checkpoint {p.name}: {reason}")
    )
    if path is None:
        say(f"no valid checkpoint in {run_dir}; starting from step 0")
        return params, opt_state, 0
    saved = checkpoint.load(path, params, opt_state)
    _check_same_run(saved.meta, meta, run_dir)
    checkpoint.restore_rng(saved, data_generator)
    say(f"resuming from {path} (step {saved.step})")
    return saved.params, saved.opt_state, saved.step


def _check_same_run(saved: dict[str, Any], current: dict[str, Any], run_dir: Path) -> None:
    for key in ("experiment", "seed", "backend"):
        if saved.get(key) != current[key]:
            raise ResumeError(
                f"{run_dir} was trained with {key}={saved.get(key)!r}, this run has "
                f"{key}={current[key]!r}; use the same value to resume, or a new --out"
            )
    old, new = saved.get("config", {}), current["config"]
    for key in sorted(set(old) | set(new)):
        if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key):
            raise ResumeError(
                f"{run_dir} was trained with {key}={old.get(key)!r}, this run has "
                f"{key}={new.get(key)!r}; pass --set {key}={old.get(key)} to resume, or a new --out"
            )


class StepTimer:
    """Steady-state step time: from the end of the first step to the end of the last."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.start = time.perf_counter()
        self.steady_start: float | None = None
        self.last = self.start
        self.steady_steps = 0
        self.step_time = 0.0

    def tick(self, steps_this_run: int) -> None:
        now = time.perf_counter()
        self.step_time, self.last = now - self.last, now
        if steps_this_run == 1:
            self.backend.synchronize()
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


def _summary(
    experiment: Experiment,
    backend: Backend,
    seed: int,
    config: dict[str, Any] | None,
    params: Params,
    examples: int,
    timer: StepTimer,
) -> dict[str, Any]:
    backend.synchronize()
    n_params = size(params)
    step_seconds = timer.step_seconds()
    summary: dict[str, Any] = {
        "name": experiment.name,
        "backend": backend.name,
        "seed": seed,
        "steps": experiment.steps,
        "seconds": timer.seconds(),
        "step_seconds": step_seconds,
        "params": n_params,
        "examples_per_step": examples,
        # The chapter's rule (3.5.6): 2·B·P forward + 4·B·P backward.
        "flops_per_step": 6 * examples * n_params,
        "flops_per_step_exact": experiment.flops_per_step,
        "examples_per_second": examples / step_seconds if step_seconds > 0 else None,
    }
    if config is not None:
        summary["config"] = config
    return summary


def _resources(
    experiment: Experiment,
    backend: Backend,
    params: Params,
    opt_state: OptState,
    batch: Any,
    summary: dict[str, Any],
    parallel: Any = None,
) -> dict[str, Any]:
    from minitrain.accounting import resource_report

    # Under data parallelism the report is one rank's step on its shard of the global batch
    # (FLOPs scale with the batch), plus the gradient all-reduce.
    share = parallel.weight if parallel is not None else 1.0
    exact = experiment.flops_per_step
    report = resource_report(
        make_train_step(experiment, backend),
        params,
        opt_state,
        batch,
        examples_per_step=round(summary["examples_per_step"] * share) or None,
        exact_flops_per_step=round(exact * share) if exact is not None else None,
        peak_flops=backend.peak_flops(),
        step_seconds=summary["step_seconds"],
        steps_total=experiment.steps,
        steps_done=experiment.steps,
    )
    if parallel is not None:
        from minitrain.distributed import gradient_bytes

        report["communication"] = parallel.communication(gradient_bytes(params))
    return report


@contextlib.contextmanager
def graceful_stop() -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C / SIGTERM into a request to stop after the current step.

    A second Ctrl-C raises ``KeyboardInterrupt`` at once. Outside the main thread (where
    signal handlers cannot be set) this does nothing.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested.is_set
        return

    def handler(signum: int, frame: Any) -> None:
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested.is_set
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def progress_bar(experiment: Experiment, start: int, enabled: bool) -> Iterator[Any]:
    """A rich progress bar on stderr (steps, elapsed, ETA, live loss); yields
    ``advance(step, loss)``. Disabled, it yields a function that does nothing."""
    if not enabled:
        yield lambda step, loss: None
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("loss {task.fields[loss]}"),
        console=Console(stderr=True),
        refresh_per_second=4,
    )
    with progress:
        task = progress.add_task(experiment.name, total=experiment.steps, completed=start, loss="-")

        def advance(step: int, loss: float) -> None:
            progress.update(task, completed=step, loss=f"{loss:.4g}")

        yield advance


def to_stderr(message: str) -> None:
    """Print a progress message on stderr (stdout stays clean for ``--json``)."""
    print(message, file=sys.stderr, flush=True)
