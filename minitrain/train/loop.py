"""The fit loop: the impure shell around the pure train step.

It is the one place in training that touches clocks, devices, files and global RNG state:
seed, init, loop over steps (batch -> device -> step), log, and summarize.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
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

from minitrain import rng
from minitrain.backend import Backend
from minitrain.train.experiment import Experiment
from minitrain.train.step import make_train_step
from minitrain.tree import OptState, Params, leaves, size
from minitrain.tree import map as tree_map

__all__ = ["FitResult", "NonFiniteLoss", "fit", "run_generators", "batch_examples", "to_backend"]


class FitResult(NamedTuple):
    """What :func:`fit` returns: the trained params, the optimizer state and the summary."""

    params: Params
    opt_state: OptState
    summary: dict[str, Any]


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the run stopped."""


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
    """Examples in a batch: the leading dimension of its first tensor (1 for a 0-d tensor)."""
    tensors = [leaf for leaf in leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        return 1
    return int(tensors[0].shape[0])


def fit(
    experiment: Experiment,
    backend: Backend,
    *,
    seed: int = 0,
    out_dir: str | Path | None = None,
    log_every: int = 1,
    progress: bool = True,
    compile: bool = False,
    config: dict[str, Any] | None = None,
) -> FitResult:
    """Train ``experiment`` on ``backend``; return params, optimizer state and the summary.

    With ``out_dir``, writes ``metrics.jsonl`` (one line per logged step) and ``summary.json``.
    Raises :class:`NonFiniteLoss` when a logged loss is NaN or infinite.
    """
    if log_every < 1:
        raise ValueError(f"log_every must be >= 1, got {log_every}")
    rng.seed_everything(seed)
    init_generator, data_generator = run_generators(seed)
    params = to_backend(experiment.init(init_generator), backend)
    opt_state = experiment.optimizer.init(params)
    step_fn = make_train_step(experiment, backend)
    if compile:
        step_fn = torch.compile(step_fn)
    run_dir = Path(out_dir) if out_dir is not None else None
    metrics_file = _open_metrics(run_dir)
    examples = None
    history: list[float] = []
    loss_value = float("nan")
    start = time.perf_counter()
    steady_start = start
    with metrics_file as metrics, _progress(experiment, enabled=progress) as advance:
        for step in range(1, experiment.steps + 1):
            step_start = time.perf_counter()
            batch = backend.to_device(experiment.next_batch(data_generator))
            if examples is None:
                examples = experiment.tokens_per_batch or batch_examples(batch)
            out = step_fn(params, opt_state, batch)
            params, opt_state = out.params, out.opt_state
            if step == 1:
                backend.synchronize()
                steady_start = time.perf_counter()
            if step % log_every == 0 or step == experiment.steps:
                backend.synchronize()
                loss_value = float(out.loss)
                if not math.isfinite(loss_value):
                    raise NonFiniteLoss(
                        f"loss became {loss_value} at step {step}; lower the learning rate "
                        "(--set lr=...) or clip gradients"
                    )
                history.append(loss_value)
                record = {
                    "step": step,
                    "loss": loss_value,
                    "grad_norm": float(out.grad_norm),
                    "step_time": time.perf_counter() - step_start,
                    **{k: float(v) for k, v in out.aux.items()},
                }
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                advance(step, loss_value)
    backend.synchronize()
    end = time.perf_counter()
    steady_steps = max(experiment.steps - 1, 0)
    step_seconds = (end - steady_start) / steady_steps if steady_steps else end - start
    n_params = size(params)
    examples = examples or 0
    summary: dict[str, Any] = {
        "name": experiment.name,
        "backend": backend.name,
        "seed": seed,
        "steps": experiment.steps,
        "final_loss": loss_value,
        "seconds": end - start,
        "step_seconds": step_seconds,
        "params": n_params,
        "examples_per_step": examples,
        # The chapter's rule (3.5.6): 2·B·P forward + 4·B·P backward.
        "flops_per_step": 6 * examples * n_params,
        "flops_per_step_exact": experiment.flops_per_step,
        "examples_per_second": examples / step_seconds if step_seconds > 0 else None,
    }
    if experiment.evaluate is not None:
        summary["eval"] = {k: float(v) for k, v in experiment.evaluate(params).items()}
    if config is not None:
        summary["config"] = config
    if run_dir is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return FitResult(params, opt_state, summary)


@contextmanager
def _open_metrics(run_dir: Path | None) -> Iterator[Any]:
    if run_dir is None:
        yield None
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as handle:
        yield handle


@contextmanager
def _progress(experiment: Experiment, enabled: bool) -> Iterator[Any]:
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
        task = progress.add_task(experiment.name, total=experiment.steps, loss="-")

        def advance(step: int, loss: float) -> None:
            progress.update(task, completed=step, loss=f"{loss:.4g}")

        yield advance
