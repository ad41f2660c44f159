"""One model, in one process or as one rank of N: the :class:`Stepper` behind ``minitrain run``."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from minitrain import checkpoint, rng
from minitrain.errors import ExperimentError, NonFiniteLoss, ScriptError
from minitrain.optim import learning_rate
from minitrain.precision import Backend
from minitrain.train import stepper
from minitrain.train.experiment import Experiment, as_recorded, check_seed, one_line
from minitrain.train.loop import FitResult, run_loop
from minitrain.train.script_errors import script_call, script_line
from minitrain.train.setup import batch_examples, init_params, run_generators
from minitrain.train.step import (
    Carry,
    can_donate,
    carry_metrics,
    check_fp8_history,
    checked_values,
    fp8_recipe_of,
    init_carry,
    keyed_loss,
    make_train_step,
    pack_checkpoint_state,
    probe_fp8_history,
    step_key,
    unpack_checkpoint_state,
)
from minitrain.tree import size

__all__ = ["SingleRun", "fit"]

class SingleRun:
    """The :class:`~minitrain.train.stepper.Stepper` of one model (optionally one rank of N)."""

    def __init__(self, experiment: Experiment, backend: Backend, *, seed: int = 0,
                 compile: bool = False, config: dict[str, Any] | None = None,
                 parallel: Any = None) -> None:
        check_seed(seed)
        self.experiment, self.backend, self.seed = experiment, backend, seed
        self.compile, self.config, self.parallel = compile, config, parallel
        self.main = parallel is None or parallel.is_main
        self.current_step = 0
        self.loss = float("nan")
        self.examples = experiment.tokens_per_batch
        self.batch: Any = None
        self.key: torch.Tensor | None = None  # the last step's (experiments with uses_key)
        self._out: Any = None
        self._last_eval: dict[str, float] | None = None  # None: not evaluated yet

    # ------------------------------------------------------------------ start and resume

    def init(self) -> None:
        rng.seed_everything(self.seed)
        init_generator, self.data_generator = run_generators(self.seed)
        self.params = init_params(self.experiment, init_generator, self.backend)
        if self.parallel is not None:  # every rank starts from the same params
            self.parallel.check_params(self.params)
        with script_call("optimizer.init(params)"):
            self.opt_state = self.experiment.optimizer.init(self.params)
        with script_call("init_state(generator)"):  # model state and the loss scale, if any
            self.carry = init_carry(self.experiment, self.backend, init_generator)
        if fp8_recipe_of(self.backend) is not None:  # a checkpoint's shape, before any resume
            shard = self.parallel.shard if self.parallel is not None else None
            with first_step_mistakes(True):  # empty, one per matmul of the first step's forward
                history = probe_fp8_history(self.experiment, self.backend, self.params,
                                            getattr(self.carry, "model_state", None),
                                            self.data_generator, shard, self.seed)
            self.carry = (self.carry or Carry())._replace(fp8_history=history)
        # The loop never reads the params and state it passes in again, so the update may
        # write into their buffers (torch.optim's in-place speed).
        parallel = self.parallel
        self._train_step = make_train_step(
            self.experiment, self.backend, parallel.reduce if parallel else None,
            donate=can_donate(self.experiment.optimizer), compile=self.compile,
            amax_reduce=parallel.max if parallel else None,
        )

    def _meta(self) -> dict[str, Any]:
        return {"experiment": self.experiment.name, "seed": self.seed,
                "backend": self.backend.name, "config": self.config or {}}

    def resume(self, found: checkpoint.Verified, run_dir: Path) -> int:
        self._check_resumable(found.state["meta"], run_dir)
        saved = checkpoint.load(found, self.params,
                                pack_checkpoint_state(self.opt_state, self.carry))
        self.opt_state, self.carry = unpack_checkpoint_state(saved.opt_state, self.carry)
        check_fp8_history(self.carry.fp8_history if self.carry else None, str(found.path))
        checkpoint.restore_rng(saved, self.data_generator)
        self.params = saved.params
        if self.parallel is not None:
            self.parallel.check_same(saved.step, "the step to resume from")
        self.current_step = saved.step
        return saved.step

    def _check_resumable(self, saved: dict[str, Any], run_dir: Path) -> None:
        current = self._meta()
        stepper.check_same(saved, current, ("experiment", "seed", "backend"), run_dir, "run")
        old, new = saved.get("config", {}), as_recorded(current["config"])
        if changed := stepper.changed_keys(old, new):
            key = changed[0]
            stepper.check_same(old, new, (key,), run_dir, "run", f"pass --set {key}={old.get(key)}")

    def save(self, run_dir: Path, step: int, keep: int) -> Path:
        return checkpoint.save(
            run_dir, step, self.params, pack_checkpoint_state(self.opt_state, self.carry),
            self._meta(), generator=self.data_generator, keep=keep,
        )

    # ------------------------------------------------------------------ steps

    def step(self, step: int) -> None:
        first = self._out is None  # of this process
        with script_call("next_batch(generator)", step):
            batch = self.experiment.next_batch(self.data_generator)
        if self.examples is None:
            self.examples = batch_examples(batch)
        if self.parallel is not None:
            batch = self.parallel.shard(batch)
        batch = self.backend.to_device(batch)
        if self.experiment.uses_key:
            self.key = step_key(self.seed, step).to(self.backend.device)
        # no_grad: nothing differentiates a run's step, so value_and_grad need not look for
        # closed-over tensors its grads must stay differentiable through (~3% of a MAML step)
        with first_step_mistakes(first), script_call("the train step (loss)", step), \
                torch.no_grad():
            out = self._train_step(self.params, self.opt_state, batch, self.carry, self.key)
        self.params, self.opt_state, self.carry = out.params, out.opt_state, out.carry
        self._out, self.batch, self.current_step = out, batch, step
        self.check_finite()

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteLoss` if the last step's loss or grad norm is not finite (read
        after every step: one host sync each)."""
        if self._out is None:
            return
        loss, norm = (float(value) for value in checked_values(self._out))
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise NonFiniteLoss(
                f"loss became {loss} (grad norm {norm}) at step {self.current_step}; the last "
                "checkpoint is kept; lower the learning rate (--set lr=...) or clip gradients"
            )

    def records(self, step: int, rates: dict[str, float], evaluate: bool) -> list[dict]:
        out = self._out
        self.loss = float(out.loss)
        with script_call("the loss's aux values", step):
            aux = {key: float(value) for key, value in out.aux.items()}
        try:
            lr = learning_rate(out.opt_state)
        except ValueError:  # a state that holds no lr
            lr = None
        record = {
            "loss": self.loss,
            "lr": lr,
            "grad_norm": float(out.grad_norm),
            **aux,
            **carry_metrics(out.carry),
            **rates,
            "rss_bytes": stepper.resident_bytes(),
        }
        if evaluate:
            record.update(self._evaluate(step))
        return [record] if self.main else []

    def _evaluate(self, step: int | None) -> dict[str, float]:
        """The evaluation at ``step``; the last step's, if it fails, is a warning and none."""
        model_state = getattr(self.carry, "model_state", None)
        state = () if model_state is None else (model_state,)
        self._last_eval = stepper.evaluation(self.experiment.evaluate, self.params, *state,
                                             step=step, steps=self.experiment.steps)
        return self._last_eval

    # ------------------------------------------------------------------ the end

    def summary(self, timer: stepper.StepTimer) -> dict[str, Any]:
        if self._out is not None:
            self.loss = float(self._out.loss)
        if self.experiment.evaluate is not None and self.main and self._last_eval is None:
            self._evaluate(None)
        summary = stepper.run_summary(self, timer, {"seed": self.seed},
                                      {"params": size(self.params)})
        summary["final_loss"] = self.loss if math.isfinite(self.loss) else None
        if self.config is not None:
            summary["config"] = self.config
        if self._last_eval:
            summary["eval"] = self._last_eval
        carry = self.carry
        if carry is not None and carry.loss_scale is not None:
            summary["skipped_steps"] = int(carry.skipped)
            summary["loss_scale"] = float(carry.loss_scale.scale)
        summary.update(stepper.fp8_scaling(carry.fp8_history if carry is not None else None))
        if self.parallel is not None:
            summary["ranks"] = self.parallel.world_size
        return summary

    def report(self, summary: dict[str, Any]) -> dict[str, Any]:
        if self.batch is None:
            return {}
        # Under data parallelism the report is one rank's step on its shard of the global
        # batch (FLOPs scale with the batch), plus the gradient all-reduce.
        share = self.parallel.weight if self.parallel is not None else 1.0
        step = functools.partial(make_train_step(self.experiment, self.backend), carry=self.carry,
                                 key=self.key)
        report = stepper.step_report(self, step, summary, examples_scale=share,
                                     flops_scale=share, **self._prediction_inputs())
        if self.parallel is not None:
            from minitrain.distributed import gradient_bytes

            report["communication"] = self.parallel.communication(gradient_bytes(self.params))
        return report

    def _prediction_inputs(self) -> dict[str, Any]:
        """What :func:`~minitrain.accounting.predict_step` needs besides the measured step.

        A loss-scaled step or one with fp8 histories is traced whole instead (``predict_call``).
        """
        experiment, carry = self.experiment, self.carry
        if carry is not None and (carry.loss_scale is not None or carry.fp8_history is not None):
            return {}
        return {
            "loss_fn": functools.partial(keyed_loss(experiment), key=self.key),
            "optimizer": experiment.optimizer,
            "has_aux": experiment.has_aux,
            "max_grad_norm": experiment.max_grad_norm,
            "autocast": self.backend.autocast,
            "model_state": carry.model_state if carry is not None else None,
        }


@contextlib.contextmanager
def first_step_mistakes(enabled: bool) -> Iterator[None]:
    """At the first step, a shape or type error in the loss is a setup mistake (exit 2, one line).
    """
    try:
        yield
    except ScriptError as exc:
        cause = exc.__cause__
        if enabled and isinstance(cause, ValueError | TypeError | IndexError | RuntimeError):
            raise ExperimentError(
                f"the first train step failed in the loss{script_line(cause)}: {one_line(cause)}"
            ) from cause
        raise


def fit(experiment: Experiment, backend: Backend, *, seed: int = 0,
        out_dir: str | Path | None = None, log_every: int = 1, checkpoint_every: int = 0,
        keep: int = 3, resume: bool = False, overwrite: bool = False, progress: bool = True,
        compile: bool = False, tensorboard: bool = False, report: bool = False,
        config: dict[str, Any] | None = None, say: Callable[[str], None] | None = None,
        parallel: Any = None) -> FitResult:
    """Train ``experiment`` on ``backend``; return params, optimizer state and the summary.

    >>> import torch, minitrain as mt
    >>> exp = mt.Experiment(init=lambda g: {"w": torch.zeros(2)},
    ...     loss=lambda p, batch: ((batch @ p["w"] - 1) ** 2).mean(),
    ...     next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1), steps=3)
    >>> result = fit(exp, mt.get_backend("cpu"), progress=False)
    >>> result.summary["steps"], round(result.summary["final_loss"], 4)
    (3, 0.1296)

    Args:
        out_dir: run directory for ``metrics.jsonl``, checkpoints and ``summary.json``.
        log_every: log every this many steps (every step is checked for finiteness).
        checkpoint_every: also checkpoint every this many steps (0: at the end and on stops).
        keep: how many checkpoints to keep.
        resume: continue from the latest valid checkpoint in ``out_dir``.
        overwrite: replace an earlier run in ``out_dir``.
        report: add the resource report (predicted vs measured memory, FLOPs, MFU).
        parallel: a :class:`minitrain.distributed.DataParallel`; rank 0 alone writes.
    """
    run = SingleRun(experiment, backend, seed=seed, compile=compile, config=config,
                        parallel=parallel)
    return run_loop(
        run, out_dir=out_dir, log_every=log_every, checkpoint_every=checkpoint_every,
        keep=keep, resume=resume, overwrite=overwrite, progress=progress,
        tensorboard=tensorboard, report=report, say=say,
    )
