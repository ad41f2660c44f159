"""Ensembles and hyperparameter sweeps: K models trained by one vmapped step.

``minitrain sweep SCRIPT --set lr=0.01,0.1 --seeds 0,1`` trains the grid of every listed value
(last key fastest, seeds fastest of all). Member k sees the batches of its own single run; params
and optimizer state carry a leading K axis and one ``torch.func.vmap`` of the train step trains
all K. Only float ``CONFIG`` keys may differ: the template experiment holds them as
:class:`~minitrain.train.swept.SweptValue`, each member's own value inside the step. The first
steps that move the params are checked against each member's single-run step. A member whose
loss goes non-finite is frozen and ranked last; the sweep fails only if all diverge.

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

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minitrain import checkpoint, rng
from minitrain._torch import pytree as _pytree
from minitrain.errors import NonFiniteLoss, ResumeError
from minitrain.precision import Backend
from minitrain.train import stepper
from minitrain.train.ensemble_step import (
    EnsembleStepOutput,
    batches_ignore_swept_values,
    check_members,
    draw_batches,
    make_ensemble_step,
    shared_by_seed,
    single_run_steps,
)
from minitrain.train.experiment import as_recorded, check_config_size
from minitrain.train.loop import FitResult, run_loop
from minitrain.train.members import (
    Ensemble,
    MemberMismatch,
    build_ensemble,
    load_sweep,
    member_grid,
    parse_seeds,
)
from minitrain.train.ranking import (
    LOSSES,
    MemberLog,
    RankBy,
    check_rank_by,
    log_step,
    member_eval,
    ranking,
    reload_logs,
)
from minitrain.train.script_errors import script_call
from minitrain.train.setup import batch_examples, init_params, run_generators
from minitrain.train.single import first_step_mistakes
from minitrain.train.step import (
    Carry,
    check_fp8_history,
    fp8_recipe_of,
    probe_fp8_history,
    step_key,
)
from minitrain.tree import OptState, Params, PyTree, size, stack, unstack

__all__ = ["CHECKED_STEPS", "SweepRun", "build_ensemble", "fit_sweep", "load_sweep",
           "member_grid", "parse_seeds"]

# The members are checked against their single runs on the first step that moves the params
# (a warmup's first step at lr 0 moves none): each of this many first steps, then steps 8, 16,
# 32, ... until one moves (an lr held at 0 longer still hides a value frozen by float()).
CHECKED_STEPS = 5


class SweepRun:
    """The :class:`~minitrain.train.stepper.Stepper` of an ensemble: K members, one vmapped
    step."""

    parallel = None

    def __init__(self, ensemble: Ensemble, backend: Backend, *, check: bool = True,
                 say: Callable[[str], None] | None = None, rank_by: RankBy | None = None
                 ) -> None:
        self.ensemble, self.backend, self.check, self.rank_by = ensemble, backend, check, rank_by
        self.experiment = ensemble.template
        self.say = say or stepper.to_stderr
        self.current_step = 0
        self.examples = ensemble.template.tokens_per_batch
        self.batch: Any = None
        self.keys: torch.Tensor | None = None  # the last step's, one per member (uses_key)
        self.logs = [MemberLog() for _ in ensemble.members]
        self._out: EnsembleStepOutput | None = None
        self._checked = False  # whether a checked step moved the params
        self._steps_taken = 0  # by this process (a resumed sweep is checked again)

    @property
    def loss(self) -> float:
        alive = [log.final_loss for log in self.logs
                 if not log.diverged_at and log.final_loss is not None]
        return min(alive) if alive else math.nan

    @property
    def carry(self) -> Carry | None:
        history = getattr(self, "fp8_history", None)  # (K, matmuls, 3, history_len)
        return None if history is None else Carry(fp8_history=history)

    def init(self) -> None:
        ensemble, members = self.ensemble, self.ensemble.members
        # each checkpoint records every member's config: all of them must fit its state.json
        check_config_size(f"CONFIG × {len(members)} members", self._meta())
        rng.seed_everything(members[0].seed)
        generators = [run_generators(member.seed) for member in members]
        data_generators = [data for _, data in generators]
        with script_call("next_batch(generator)", 1):
            if batches_ignore_swept_values(ensemble):
                data_generators = shared_by_seed(members, data_generators)
        self.data_generators = data_generators
        member_params = [init_params(experiment, init, self.backend)
                         for experiment, (init, _) in zip(ensemble.experiments, generators,
                                                          strict=True)]
        self.params = _stacked(member_params, "params")
        with script_call("optimizer.init(params)"):
            states = [e.optimizer.init(p)
                      for e, p in zip(ensemble.experiments, member_params, strict=True)]
        self.opt_state = _stacked(states, "optimizer states")
        self.diverged_at = torch.zeros(ensemble.size, dtype=torch.int64, device=self.backend.device)
        self.hyperparameters = ensemble.hyperparameters(self.backend.device)
        self.fp8_history = self._fp8_histories(member_params[0])
        self.step_fn = make_ensemble_step(ensemble, self.backend)
        # a --rank-by metric no member reports is refused before the first step (one of
        # evaluate's is looked for in member 0's evaluation of its initial params)
        evaluate = ensemble.experiments[0].evaluate
        if self.rank_by is not None and self.rank_by.name not in LOSSES:
            check_rank_by(self.rank_by, {} if evaluate is None else
                          stepper.evaluated(evaluate, member_params[0]))

    def _fp8_histories(self, params: Params) -> torch.Tensor | None:
        """Each member's empty amax histories on a delayed-fp8 backend (else None)."""
        if fp8_recipe_of(self.backend) is None:
            return None
        history = probe_fp8_history(self.ensemble.experiments[0], self.backend, params, None,
                                    self.data_generators[0], seed=self.ensemble.members[0].seed)
        return history.expand(self.ensemble.size, *history.shape).clone()

    def _carried(self) -> dict[str, Any]:
        """What a checkpoint's ``opt_state`` file holds besides the parameters."""
        state = {"optimizer": self.opt_state, "diverged_at": self.diverged_at}
        if self.fp8_history is not None:
            state["fp8_history"] = self.fp8_history
        return state

    def _meta(self) -> dict[str, Any]:
        ensemble = self.ensemble
        return {
            "experiment": ensemble.template.name,
            "backend": self.backend.name,
            "sweep": list(ensemble.swept),
            "members": [{"seed": m.seed, "config": m.config} for m in ensemble.members],
        }

    def resume(self, found: checkpoint.Verified, run_dir: Path) -> int:
        self._check_resumable(found.state["meta"], run_dir)
        saved = checkpoint.load(found, self.params, self._carried())
        checkpoint.restore_rng(saved)
        states = saved.meta["data_generators"]
        for generator, state in zip(self.data_generators, states, strict=True):
            rng.set_generator_state(generator, state)
        self.params = saved.params
        self.opt_state = saved.opt_state["optimizer"]
        self.diverged_at = saved.opt_state["diverged_at"]
        self.fp8_history = saved.opt_state.get("fp8_history")
        check_fp8_history(self.fp8_history, str(found.path))
        self.current_step = saved.step
        reload_logs(run_dir, saved.step, self.logs, self.diverged_at)
        return saved.step

    def _check_resumable(self, saved: dict[str, Any], run_dir: Path) -> None:
        current = self._meta()
        stepper.check_same(saved, current, ("experiment", "backend", "sweep"), run_dir, "sweep")
        old, new = saved.get("members", []), as_recorded(current["members"])
        if len(old) != len(new) or len(saved.get("data_generators", [])) != len(new):
            raise ResumeError(
                f"{run_dir} holds a sweep of {len(old)} members, this one has {len(new)}; pass "
                "the same --set lists and --seeds to resume, or a new --out"
            )
        for index, (was, now) in enumerate(zip(old, new, strict=True)):
            changed = stepper.changed_keys(was["config"], now["config"])
            if was["seed"] != now["seed"] or changed:
                what = (f"{changed[0]}={was['config'].get(changed[0])!r}" if changed
                        else f"seed {was['seed']}")
                raise ResumeError(
                    f"{run_dir}: member {index} was trained with {what}; pass the same --set "
                    "lists and --seeds to resume, or a new --out"
                )

    def save(self, run_dir: Path, step: int, keep: int) -> Path:
        generator_states = [rng.generator_state(g) for g in self.data_generators]
        saved_meta = {**self._meta(), "data_generators": generator_states}
        return checkpoint.save(run_dir, step, self.params, self._carried(), saved_meta, keep=keep)

    def step(self, step: int) -> None:
        ensemble = self.ensemble
        with script_call("next_batch(generator)", step):
            member_batches = draw_batches(ensemble.experiments, self.data_generators)
        if self.examples is None:
            self.examples = batch_examples(member_batches[0])
        batch = self.backend.to_device(_stacked_batches(member_batches))
        if self.experiment.uses_key:  # each member's key of this step, from its own seed
            keys = [step_key(member.seed, step) for member in ensemble.members]
            self.keys = torch.stack(keys).to(self.backend.device)
        with first_step_mistakes(self._steps_taken == 0), \
                script_call("the train step (loss)", step):
            try:
                out = self.step_fn(self.params, self.opt_state, batch, self.hyperparameters,
                                   self.diverged_at, step, self.fp8_history, self.keys)
            except Exception:  # fail as the members' single runs do, where one of them does
                for _ in single_run_steps(ensemble, self.backend, self.params, self.opt_state,
                                          batch, self.diverged_at, self.fp8_history, self.keys):
                    pass
                raise  # else as it did: e.g. a refusal of what only one vmapped step cannot run
        self._steps_taken += 1
        if self.check and not self._checked and _checks(self._steps_taken):
            with script_call("the train step (loss)", step):  # each member's own run's step
                self._checked = check_members(ensemble, self.backend, self.params,
                                              self.opt_state, batch, out,
                                              fp8_history=self.fp8_history, keys=self.keys)
        self.params, self.opt_state, self.diverged_at = out.params, out.opt_state, out.diverged_at
        self.fp8_history = out.fp8_history
        self._out, self.batch, self.current_step = out, batch, step

    def check_finite(self) -> None:
        """A diverged member is frozen, not fatal; the sweep fails when all have diverged."""
        diverged = self.diverged_at.tolist()
        if all(diverged):
            raise NonFiniteLoss(
                f"every member diverged (the last at step {max(diverged)}); the last "
                "checkpoint is kept; lower the learning rates"
            )

    def records(self, step: int, rates: dict[str, float], evaluate: bool) -> list[dict]:
        with script_call("evaluate(params)" if evaluate else "the loss's aux values", step):
            return log_step(self.ensemble, self._out, step, self.logs, rates, evaluate,
                            self.say)

    def summary(self, timer: stepper.StepTimer) -> dict[str, Any]:
        ensemble, logs, member_params = self.ensemble, self.logs, None
        wanted = getattr(self.rank_by, "name", None)
        for k, experiment in enumerate(ensemble.experiments):
            if experiment.evaluate is not None and not logs[k].final_evaluated and (
                    not logs[k].last_eval or wanted not in (None, *LOSSES, *logs[k].last_eval)):
                member_params = member_params or unstack(self.params)
                logs[k].last_eval = member_eval(ensemble, k, member_params[k], logs[k], None,
                                                self.say)
        k = ensemble.size
        per_member = size(self.params) // k
        head = {"members": k, "swept": list(ensemble.swept),
                "seeds": sorted({m.seed for m in ensemble.members})}
        summary = stepper.run_summary(self, timer, head,
                              {"params_per_member": per_member, "params": per_member * k}, k)
        summary["ranking"] = ranking(ensemble.members, logs, self.rank_by)
        summary["diverged"] = [
            m.index for m, log in zip(ensemble.members, logs, strict=True) if log.diverged_at
        ]
        summary["configs"] = [m.config for m in ensemble.members]
        summary.update(stepper.fp8_scaling(self.fp8_history))
        return summary

    def report(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The resource report of one whole ensemble step (K × params, grads, state, activations).
        """
        if self.batch is None:
            return {}
        values, diverged, history = self.hyperparameters, self.diverged_at, self.fp8_history
        steps, keys = self.experiment.steps, self.keys

        def step(p: Params, s: OptState, b: PyTree) -> EnsembleStepOutput:
            return self.step_fn(p, s, b, values, diverged, steps, history, keys)

        # The 6·B·P rule with P = K·(params per member) and B per member gives K × 6·B·P.
        report = stepper.step_report(self, step, summary, flops_scale=self.ensemble.size)
        report["members"] = self.ensemble.size
        return report


def fit_sweep(ensemble: Ensemble, backend: Backend, *, check: bool = True,
              say: Callable[[str], None] | None = None, rank_by: RankBy | None = None,
              **options: Any) -> FitResult:
    """Train every member of ``ensemble`` with one vmapped step per step; return the result.

    ``options`` are :func:`~minitrain.train.loop.run_loop`'s (``out_dir``, ``log_every``,
    ``resume``, ...); ``check`` compares the first steps that move the params with each member's
    own single-run step; ``rank_by`` orders the summary's ranking
    (:func:`~minitrain.train.ranking.parse_rank_by`; default: val_loss, else the train loss).
    """
    run = SweepRun(ensemble, backend, check=check, say=say, rank_by=rank_by)
    return run_loop(run, say=say, **options)


def _checks(steps_taken: int) -> bool:
    """Whether this process's ``steps_taken``-th step is checked: the first few, then powers of two.

    >>> [n for n in range(1, 40) if _checks(n)]
    [1, 2, 3, 4, 5, 8, 16, 32]
    """
    return steps_taken <= CHECKED_STEPS or steps_taken & (steps_taken - 1) == 0


def _stacked_batches(batches: list[PyTree]) -> PyTree:
    """The members' batches stacked; a draw that members share is flattened once."""
    drawn: dict[int, tuple[list, Any]] = {}
    for batch in batches:
        if id(batch) not in drawn:
            drawn[id(batch)] = _pytree.tree_flatten(batch)
    first, spec = drawn[id(batches[0])]
    if all(other == spec and all(_alike(a, b) for a, b in zip(flat, first, strict=True))
           for flat, other in drawn.values()):
        columns = zip(*(drawn[id(batch)][0] for batch in batches), strict=True)
        return _pytree.tree_unflatten([torch.stack(column) for column in columns], spec)
    return _stacked(batches, "batches")  # says what differs


def _alike(a: Any, b: Any) -> bool:
    """Whether ``torch.stack`` stacks ``a`` and ``b`` as :func:`~minitrain.tree.stack` does."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device)


def _stacked(trees: list[PyTree], what: str) -> PyTree:
    """``trees``, member k's at k, stacked; else a :class:`MemberMismatch` saying what differs."""
    try:
        return stack(trees)
    except ValueError as exc:
        raise MemberMismatch(
            f"the members' {what} cannot be stacked ({exc}; trees[k] is member k's); members of "
            "one vmapped step may differ only in float hyperparameters that build the same "
            "steps (adadelta, adamax, lion, nadam and radam leave the weight decay step out at "
            "weight_decay=0: sweep 1e-8 for none)"
        ) from None
