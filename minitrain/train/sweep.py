"""Ensembles and hyperparameter sweeps: K models trained by one vmapped step.

An ensemble of K members is one params pytree whose leaves carry a leading K axis
(:func:`minitrain.tree.stack`), with the optimizer state stacked the same way. One
``torch.func.vmap`` of the pure train step over params, optimizer state, batch and the members'
hyperparameters trains all K at once: the chapter compares lr 0.01 with lr 0.1 by training
twice; here both (or fifty) run in one step.

**Members and their data.** ``minitrain sweep SCRIPT --set lr=0.01,0.1 --seeds 0,1`` trains the
grid of every listed value (2 × 2 = 4 members; the last key varies fastest, seeds fastest of
all). Member k is the run ``minitrain run SCRIPT --set lr=... --seed s`` would make: its init
and data generators come from :func:`~minitrain.train.loop.run_generators` of its seed, its
batch is drawn by its own experiment's ``next_batch`` with its own data generator, and the K
batches are stacked. So a member sees the same batches as its single run, and members with
different seeds see different batches. When ``next_batch`` does not read a swept value (checked
on one probe draw of the template experiment), members with the same seed would draw identical
batches, so one draw per seed serves them all.

**Swept hyperparameters.** Only float ``CONFIG`` keys may differ between members (members must
share shapes and code paths). The script's ``experiment(config)`` is called once per member (for
init, data, evaluation and the first-step check) and once more with each swept key given as a
:class:`SweptValue`: a 0-d float64 tensor that holds member 0's value outside the step and, inside
the vmapped step, each member's own value. The experiment built from it therefore applies
per-member values of ``max_grad_norm`` and of the hyperparameters ``mt.optim``'s optimizers take as
0-d tensors: lr and weight_decay, eps, momentum and dampening, RMSprop's alpha, AdaGrad's lr_decay
and initial_accumulator_value (each member's optimizer state is made by its own run's optimizer),
Adadelta's rho and the like, provided the script only does tensor arithmetic with the value or
passes it to an ``mt.optim`` optimizer or schedule (no ``float()``, ``.item()`` or
``torch.tensor()`` of it).
Exceptions: a pair (``betas``, Rprop's ``etas`` and ``step_sizes``) takes tensors only as both of
its values, so one swept beta is refused (both betas, and a centered RMSprop's alpha, train as any
other swept value). A tensor derived from a swept one while the experiment is built
(``config["muon_lr"] / config["lr"]``, ``torch.stack([lr, wd])``, ``weights * config["w"]``) is
a :class:`SweptValue` too, redone on each member's values in the step; ``lr *= 2`` rebinds as on
a float. What the step cannot redo per member is refused in one line while the template is
built: an in-place write of a swept value into a tensor, a random draw from one, and a Python
bool or int of one (an ``if``, a comparison, ``int()``) that differs between members (an ``if``
that every member takes alike is fine; one that only picks the name is refused too). A size or
count made through ``float()`` (a schedule's ``decay_steps=round(float(lr) * 1000)``, a tensor's
length) is a plain number there: the init, loss and optimizer each member builds are compared,
and an int, bool or tensor shape that differs is refused in one line
(:mod:`~minitrain.train.member_checks`). ``json.dumps(config)`` writes member 0's values while
the template is built. Inside the step, Python control flow on a per-member tensor (``if step >
10``) and an in-place write into a tensor the loss did not make are refused in one line naming
the script's line. The first step that moves the params (a warmup from
lr 0 moves none at its first; each of the first :data:`CHECKED_STEPS` steps, then steps 8, 16,
32, ... are tried until one moves) checks every member against the step its single run would
take, to 5% of each leaf's update in norm (rounding, even in Muon's bfloat16 Newton-Schulz,
stays far below; a member trained with member 0's value is off by the values' ratio), and stops
with a one-line error if they differ. Arguments annotated as plain
``float`` (the values of ``mt.optim``'s constant, linear-warmup and cosine schedules, one-cycle's
``pct_start``) work with the swept tensor at run time but refuse it wherever annotations are
enforced (jaxtyping's import hook in the test suite).

**Randomness.** Random ops inside the step draw different numbers for each member (``vmap(...,
randomness="different")``) from the global RNG, seeded with the first member's seed and saved in
checkpoints: a sweep is reproducible and resumes bit-identically on CPU, though a member's
dropout masks differ from its single run's.

**Divergence.** A member whose loss or gradient norm becomes NaN or infinite keeps the params
and optimizer state it had before that step (it is frozen); it is reported, logged once with
``diverged_at``, ranked last, and the others train on. The sweep fails only if all diverge.

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

import collections
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minitrain import checkpoint, rng
from minitrain._torch import pytree as _pytree
from minitrain.errors import NonFiniteLoss, ResumeError
from minitrain.metrics import METRICS_FILE, read_metrics
from minitrain.precision import Backend
from minitrain.train.ensemble_step import (
    EnsembleStepOutput,
    batches_ignore_swept_values,
    check_members,
    draw_batches,
    make_ensemble_step,
    shared_by_seed,
)
from minitrain.train.experiment import as_recorded
from minitrain.train.loop import FitResult, StepTimer, run_loop
from minitrain.train.members import (
    Ensemble,
    Member,
    MemberMismatch,
    SweepBinding,
    SweptValue,
    build_ensemble,
    load_sweep,
    member_grid,
    member_label,
    parse_seeds,
    parse_sweep,
)
from minitrain.train.progress import resident_bytes, to_stderr
from minitrain.train.script_errors import script_call
from minitrain.train.setup import batch_examples, check_params, run_generators, to_backend
from minitrain.train.step import Carry, check_fp8_history, fp8_recipe_of, init_fp8_history
from minitrain.train.sweep_plot import plot_sweep
from minitrain.tree import OptState, Params, PyTree, size, stack, unstack

__all__ = [
    "Ensemble",
    "EnsembleStepOutput",
    "batches_ignore_swept_values",
    "check_members",
    "draw_batches",
    "make_ensemble_step",
    "shared_by_seed",
    "Member",
    "MemberMismatch",
    "SweepBinding",
    "SweepResult",
    "SweepRun",
    "SweptValue",
    "build_ensemble",
    "fit_sweep",
    "load_sweep",
    "member_grid",
    "member_label",
    "parse_seeds",
    "parse_sweep",
    "plot_sweep",
]

RECENT_LOSSES = 10  # the ranking's smoothed loss: the mean of this many last logged losses
# The members are checked against their single runs on the first step that moves the params
# (a warmup's first step at lr 0 moves none): each of this many first steps, then steps 8, 16,
# 32, ... until one moves (an lr held at 0 longer still hides a value frozen by float()).
CHECKED_STEPS = 5

SweepResult = FitResult
"""What :func:`fit_sweep` returns: stacked params and optimizer state, and the summary."""


@dataclass
class _MemberLog:
    """Per-member bookkeeping of the loop: recent losses, last eval, divergence reported."""

    recent: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_LOSSES)
    )
    final_loss: float | None = None
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    diverged_at: int = 0
    reported: bool = False


class SweepRun:
    """The :class:`~minitrain.train.loop.Stepper` of an ensemble: K members, one vmapped step."""

    def __init__(self, ensemble: Ensemble, backend: Backend, *, check: bool = True,
                 say: Callable[[str], None] | None = None) -> None:
        self.ensemble, self.backend, self.check = ensemble, backend, check
        self.say = say or to_stderr
        self.name, self.steps = ensemble.template.name, ensemble.steps
        self.main = True
        self.current_step = 0
        self.synchronize = backend.synchronize
        self.logs = [_MemberLog() for _ in ensemble.members]
        self._examples = ensemble.template.tokens_per_batch
        self._out: EnsembleStepOutput | None = None
        self._checked = False  # whether a checked step moved the params
        self._steps_taken = 0  # by this process (a resumed sweep is checked again)
        self._batch: Any = None
        self._run_dir: Path | None = None

    def init(self) -> None:
        ensemble, members = self.ensemble, self.ensemble.members
        rng.seed_everything(members[0].seed)
        generators = [run_generators(member.seed) for member in members]
        data_generators = [data for _, data in generators]
        with script_call("next_batch(generator)"):
            if batches_ignore_swept_values(ensemble):
                data_generators = shared_by_seed(members, data_generators)
        self.data_generators = data_generators
        member_params = []
        for experiment, (init, _) in zip(ensemble.experiments, generators, strict=True):
            with script_call("init(generator)"):
                params = experiment.init(init)
            check_params(params)
            member_params.append(to_backend(params, self.backend))
        self.params = _stacked(member_params, "params")
        with script_call("optimizer.init(params)"):
            states = [e.optimizer.init(p)
                      for e, p in zip(ensemble.experiments, member_params, strict=True)]
        _check_same_state_layout(ensemble, states)
        self.opt_state = _stacked(states, "optimizer states")
        self.diverged_at = torch.zeros(ensemble.size, dtype=torch.int64, device=self.backend.device)
        self.hyperparameters = ensemble.hyperparameters(self.backend.device)
        self.fp8_history = self._fp8_histories(member_params[0])
        self.step_fn = make_ensemble_step(ensemble, self.backend)

    def _fp8_histories(self, params: Params) -> torch.Tensor | None:
        """Each member's empty amax histories on a delayed-fp8 backend (else None): one per
        matmul of a forward pass on a batch from a copy of the first data generator."""
        if fp8_recipe_of(self.backend) is None:
            return None
        experiment, source = self.ensemble.experiments[0], self.data_generators[0]
        probe = torch.Generator(source.device)
        probe.set_state(source.get_state())
        with script_call("next_batch(generator)", 1):
            batch = self.backend.to_device(experiment.next_batch(probe))
        with script_call("the train step (loss)", 1):
            history = init_fp8_history(experiment, self.backend, params, None, batch)
        return history.expand(self.ensemble.size, *history.shape).clone()

    def _carried(self) -> dict[str, Any]:
        """What a checkpoint's ``opt_state`` file holds besides the parameters."""
        state = {"optimizer": self.opt_state, "diverged_at": self.diverged_at}
        if self.fp8_history is not None:
            state["fp8_history"] = self.fp8_history
        return state

    def meta(self) -> dict[str, Any]:
        ensemble = self.ensemble
        return {
            "experiment": ensemble.template.name,
            "backend": self.backend.name,
            "sweep": list(ensemble.swept),
            "members": [{"seed": m.seed, "config": m.config} for m in ensemble.members],
        }

    def resume_from(self, path: Path, check: Callable[[dict], None]) -> int:
        saved = checkpoint.load(path, self.params, self._carried())
        check(saved.meta)
        checkpoint.restore_rng(saved)
        states = saved.meta["data_generators"]
        for generator, state in zip(self.data_generators, states, strict=True):
            rng.set_generator_state(generator, state)
        self.params = saved.params
        self.opt_state = saved.opt_state["optimizer"]
        self.diverged_at = saved.opt_state["diverged_at"]
        self.fp8_history = saved.opt_state.get("fp8_history")
        check_fp8_history(self.fp8_history, str(path))
        self.current_step = saved.step
        _reload_logs(path.parent.parent, saved.step, self.logs, self.diverged_at)
        return saved.step

    def check_resumable(self, saved: dict[str, Any], run_dir: Path) -> None:
        _check_same_sweep(saved, self.meta(), run_dir)

    def save(self, run_dir: Path, step: int, keep: int) -> Path:
        state = self._carried()
        generator_states = [rng.generator_state(g) for g in self.data_generators]
        saved_meta = {**self.meta(), "data_generators": generator_states}
        return checkpoint.save(run_dir, step, self.params, state, saved_meta, keep=keep)

    def should_stop(self, requested: bool) -> bool:
        return requested

    def step(self, step: int) -> None:
        ensemble = self.ensemble
        with script_call("next_batch(generator)", step):
            member_batches = draw_batches(ensemble.experiments, self.data_generators)
        if self._examples is None:
            self._examples = batch_examples(member_batches[0])
        batch = self.backend.to_device(_stacked(member_batches, "batches"))
        with script_call("the train step (loss)", step):
            out = self.step_fn(self.params, self.opt_state, batch, self.hyperparameters,
                               self.diverged_at, step, self.fp8_history)
        self._steps_taken += 1
        if self.check and not self._checked and _checks(self._steps_taken):
            with script_call("the train step (loss)", step):  # each member's own run's step
                self._checked = check_members(ensemble, self.backend, self.params,
                                              self.opt_state, batch, out,
                                              fp8_history=self.fp8_history)
        self.params, self.opt_state, self.diverged_at = out.params, out.opt_state, out.diverged_at
        self.fp8_history = out.fp8_history
        self._out, self._batch, self.current_step = out, batch, step

    def check_finite(self) -> None:
        """A diverged member is frozen, not fatal; the sweep fails when all have diverged."""
        diverged = self.diverged_at.tolist()
        if all(diverged):
            raise NonFiniteLoss(
                f"every member diverged (the last at step {max(diverged)}); the last "
                "checkpoint is kept; lower the learning rates"
            )

    def evaluates_at(self, step: int) -> bool:
        template = self.ensemble.template
        every = template.eval_every
        return template.evaluate is not None and every > 0 and step % every == 0

    def records(self, step: int, rates: dict[str, float], evaluate: bool) -> list[dict]:
        with script_call("evaluate(params)" if evaluate else "the loss's aux values", step):
            return _log_step(self.ensemble, self._out, step, self.logs, rates, evaluate,
                             self.say)

    def progress_loss(self) -> float:
        alive = [log.final_loss for log in self.logs if not log.diverged_at]
        return min(alive) if alive else math.nan

    def examples(self) -> int | None:
        return self._examples

    def finish(self) -> None:
        member_params = None
        for k, experiment in enumerate(self.ensemble.experiments):
            if experiment.evaluate is None or self.logs[k].last_eval:
                continue
            member_params = member_params or unstack(self.params)
            with script_call("evaluate(params)"):
                values = experiment.evaluate(member_params[k])
                self.logs[k].last_eval = {key: float(v) for key, v in values.items()}

    def summary(self, timer: StepTimer) -> dict[str, Any]:
        summary = _summary(self.ensemble, self.backend, self.params, self.logs,
                           self._examples or 0, timer)
        if self.fp8_history is not None:
            _, matmuls, _, history_len = self.fp8_history.shape
            summary["fp8_scaling"] = {"amax_history": history_len, "matmuls": matmuls}
        return summary

    def report(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The resource report of one whole ensemble step: K × params, grads, state,
        activations."""
        if self._batch is None:
            return {}
        from minitrain.accounting import resource_report

        ensemble, values, diverged = self.ensemble, self.hyperparameters, self.diverged_at
        history = self.fp8_history

        def step(p: Params, s: OptState, b: PyTree) -> EnsembleStepOutput:
            return self.step_fn(p, s, b, values, diverged, ensemble.steps, history)

        # The 6·B·P rule with P = K·(params per member) and B per member gives K × 6·B·P.
        report = resource_report(
            step,
            self.params,
            self.opt_state,
            self._batch,
            examples_per_step=summary["examples_per_step"] // ensemble.size or None,
            exact_flops_per_step=summary["flops_per_step_exact"],
            peak_flops=self.backend.peak_flops(),
            step_seconds=summary["step_seconds"],
            steps_total=ensemble.steps,
            steps_done=ensemble.steps,
        )
        report["members"] = ensemble.size
        return report

    def result(self, summary: dict[str, Any]) -> FitResult:
        history = getattr(self, "fp8_history", None)  # (K, matmuls, 3, history_len)
        carry = None if history is None else Carry(fp8_history=history)
        return FitResult(getattr(self, "params", None), getattr(self, "opt_state", None), summary,
                         carry)


def fit_sweep(
    ensemble: Ensemble,
    backend: Backend,
    *,
    out_dir: str | Path | None = None,
    log_every: int = 1,
    checkpoint_every: int = 0,
    keep: int = 3,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    report: bool = False,
    check: bool = True,
    say: Callable[[str], None] | None = None,
) -> FitResult:
    """Train every member of ``ensemble`` with one vmapped step per step; return the result.

    Arguments are :func:`~minitrain.train.fit`'s. ``out_dir`` receives ``metrics.jsonl`` (one
    line per logged step per member, with ``member``, ``seed`` and the swept ``config``),
    checkpoints of the whole ensemble and ``summary.json`` (the ranking). ``check`` compares
    the first step that moves the params (see :func:`_checks`) with each member's own
    single-run step (:func:`check_members`).
    """
    stepper = SweepRun(ensemble, backend, check=check, say=say)
    return run_loop(
        stepper, out_dir=out_dir, log_every=log_every, checkpoint_every=checkpoint_every,
        keep=keep, resume=resume, overwrite=overwrite, progress=progress, report=report, say=say,
    )


def _check_same_state_layout(ensemble: Ensemble, states: list[PyTree]) -> None:
    """Refuse, in one line naming two members, optimizer states laid out otherwise: their
    optimizers differ in more than values (adadelta, adamax, asgd, lion, nadam and radam leave
    their weight-decay step out at weight_decay=0, as torch.optim does)."""
    layouts = [_pytree.tree_structure(state) for state in states]
    for k, layout in enumerate(layouts):
        if layout != layouts[0]:
            first, other = (member_label(ensemble.members[i]) for i in (0, k))
            raise MemberMismatch(
                f"member 0 ({first}) and member {k} ({other}) build optimizers whose states "
                "differ in layout, so one vmapped step cannot update both: a swept value picks "
                "a step in or out (adadelta, adamax, asgd, lion, nadam and radam leave out "
                "weight decay at weight_decay=0); sweep values that all build the same steps "
                "(weight_decay=1e-8 for none)"
            )


def _checks(steps_taken: int) -> bool:
    """Whether the ``steps_taken``-th step of this process is checked (while none has moved
    the params): each of the first :data:`CHECKED_STEPS`, then each power of two, so an lr held
    at 0 for long costs a few checks, not one per step.

    >>> [n for n in range(1, 40) if _checks(n)]
    [1, 2, 3, 4, 5, 8, 16, 32]
    """
    return steps_taken <= CHECKED_STEPS or steps_taken & (steps_taken - 1) == 0


def _stacked(trees: list[PyTree], what: str) -> PyTree:
    try:
        return stack(trees)
    except ValueError as exc:
        raise MemberMismatch(
            f"the members' {what} cannot be stacked ({exc}); members of one vmapped step may "
            "differ only in float hyperparameters such as lr or weight_decay"
        ) from None


def _log_step(
    ensemble: Ensemble,
    out: EnsembleStepOutput,
    step: int,
    logs: list[_MemberLog],
    rates: dict[str, float],
    is_eval: bool,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One metrics line per member still training (or diverged since the last log)."""
    losses, norms = out.loss.tolist(), out.grad_norm.tolist()
    diverged = out.diverged_at.tolist()
    lrs = out.opt_state.lr.tolist() if hasattr(out.opt_state, "lr") else [None] * len(losses)
    aux = {key: value.tolist() for key, value in out.aux.items()}
    rss = resident_bytes()
    member_params = unstack(out.params) if is_eval else None
    records = []
    for k, member in enumerate(ensemble.members):
        log = logs[k]
        if log.reported:
            continue
        record: dict[str, Any] = {"member": k, "seed": member.seed, "config": member.swept}
        if diverged[k]:
            log.diverged_at, log.reported = diverged[k], True
            say(
                f"member {k} ({member_label(member)}) diverged at step {diverged[k]} (loss "
                f"{losses[k]}, grad norm {norms[k]}); its params stay as they were before it"
            )
            record.update(loss=losses[k], diverged_at=diverged[k])
        else:
            log.final_loss = losses[k]
            log.recent.append(losses[k])
            record.update(
                loss=losses[k],
                lr=lrs[k],
                grad_norm=norms[k],
                **{key: values[k] for key, values in aux.items()},
                **rates,
                rss_bytes=rss,
            )
            if is_eval:
                evaluate = ensemble.experiments[k].evaluate
                log.last_eval = {key: float(v) for key, v in evaluate(member_params[k]).items()}
                record.update(log.last_eval)
        records.append(record)
    return records


def _check_same_sweep(saved: dict[str, Any], current: dict[str, Any], run_dir: Path) -> None:
    for key in ("experiment", "backend", "sweep"):
        if saved.get(key) != current[key]:
            raise ResumeError(
                f"{run_dir} was trained with {key}={saved.get(key)!r}, this sweep has "
                f"{key}={current[key]!r}; use the same value to resume, or a new --out"
            )
    old, new = saved.get("members", []), as_recorded(current["members"])
    if len(old) != len(new) or len(saved.get("data_generators", [])) != len(new):
        raise ResumeError(
            f"{run_dir} holds a sweep of {len(old)} members, this one has {len(new)}; pass the "
            "same --set lists and --seeds to resume, or a new --out"
        )
    for index, (was, now) in enumerate(zip(old, new, strict=True)):
        changed = [
            key
            for key in sorted(set(was["config"]) | set(now["config"]))
            if key != "steps" and was["config"].get(key) != now["config"].get(key)
        ]
        if was["seed"] != now["seed"] or changed:
            what = (
                f"{changed[0]}={was['config'].get(changed[0])!r}"
                if changed
                else (f"seed {was['seed']}")
            )
            raise ResumeError(
                f"{run_dir}: member {index} was trained with {what}; pass the same --set lists "
                "and --seeds to resume, or a new --out"
            )


def _reload_logs(
    run_dir: Path, start: int, logs: list[_MemberLog], diverged_at: torch.Tensor
) -> None:
    """Recent losses, last evals and divergences of the steps before ``start``, from the log."""
    for k, step in enumerate(diverged_at.tolist()):
        logs[k].diverged_at = step
    if not start or not (run_dir / METRICS_FILE).exists():
        return
    for record in read_metrics(run_dir):
        k = record.get("member")
        if record["step"] > start or not isinstance(k, int) or not 0 <= k < len(logs):
            continue
        log = logs[k]
        if "diverged_at" in record:
            log.reported = True
        elif isinstance(record.get("loss"), int | float):
            log.final_loss = record["loss"]
            log.recent.append(record["loss"])
            evals = {key: v for key, v in record.items() if key.startswith(("val", "eval"))}
            log.last_eval = evals or log.last_eval


def _summary(
    ensemble: Ensemble,
    backend: Backend,
    params: Params,
    logs: list[_MemberLog],
    examples: int,
    timer: StepTimer,
) -> dict[str, Any]:
    backend.synchronize()
    k = ensemble.size
    per_member = size(params) // k
    step_seconds = timer.step_seconds()
    exact = ensemble.template.flops_per_step
    return {
        "name": ensemble.template.name,
        "backend": backend.name,
        "members": k,
        "swept": list(ensemble.swept),
        "seeds": sorted({m.seed for m in ensemble.members}),
        "steps": ensemble.steps,
        "seconds": timer.seconds(),
        "step_seconds": step_seconds,
        "params_per_member": per_member,
        "params": per_member * k,
        "examples_per_step": examples * k,
        # The chapter's rule (3.5.6), for all K members: 6·B·P each.
        "flops_per_step": 6 * examples * per_member * k,
        "flops_per_step_exact": exact * k if exact is not None else None,
        "examples_per_second": examples * k / step_seconds if step_seconds > 0 else None,
        "ranking": _ranking(ensemble, logs),
        "diverged": [
            m.index for m, log in zip(ensemble.members, logs, strict=True) if log.diverged_at
        ],
        "configs": [m.config for m in ensemble.members],
    }


def _ranking(ensemble: Ensemble, logs: list[_MemberLog]) -> list[dict[str, Any]]:
    """Members best first: by held-out ``val_loss`` when every healthy member has one, else by
    the mean of their last logged train losses; diverged members last, earliest first."""
    healthy = [log for log in logs if not log.diverged_at]
    by_val = bool(healthy) and all("val_loss" in log.last_eval for log in healthy)
    rows = []
    for member, log in zip(ensemble.members, logs, strict=True):
        smoothed = sum(log.recent) / len(log.recent) if log.recent else None
        row = {
            "member": member.index,
            "seed": member.seed,
            "config": member.swept,
            "final_loss": None if log.diverged_at else log.final_loss,
            "smoothed_loss": None if log.diverged_at else smoothed,
            "eval": log.last_eval,
            "diverged_at": log.diverged_at or None,
            "ranked_by": "val_loss" if by_val else "smoothed_loss",
        }
        rows.append(row)

    def key(row: dict[str, Any]) -> tuple:
        if row["diverged_at"] is not None:
            return (1, row["diverged_at"], row["member"])
        value = row["eval"]["val_loss"] if by_val else row["smoothed_loss"]
        value = value if value is not None and math.isfinite(value) else math.inf
        return (0, value, row["member"])

    rows.sort(key=key)
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    return rows


