"""A sweep's members side by side: their log lines, recent losses and the ranking.

Diverged members rank last; the others by the metric ``--rank-by`` names, or by default by
``val_loss`` when all have one, else by the mean of their last :data:`RECENT_LOSSES` logged
losses.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from minitrain.errors import ExperimentError
from minitrain.metrics import METRICS_FILE, read_metrics
from minitrain.optim.base import _find_lr
from minitrain.train.members import Ensemble, Member, member_label
from minitrain.train.stepper import evaluation, resident_bytes
from minitrain.tree import unstack

__all__ = ["LOSSES", "RECENT_LOSSES", "MemberLog", "RankBy", "check_rank_by", "log_step",
           "member_eval", "parse_rank_by", "rank_value", "ranking", "reload_logs"]

RECENT_LOSSES = 10  # the ranking's smoothed loss: the mean of this many last logged losses
# what --rank-by may name besides the metrics of evaluate: each row's field it reads
LOSSES = {"loss": "smoothed_loss", "smoothed_loss": "smoothed_loss", "final_loss": "final_loss"}


class RankBy(NamedTuple):
    """The metric members are ranked by, and whether higher is better."""

    name: str
    higher: bool = False


def parse_rank_by(text: str) -> RankBy:
    """``"val_loss"`` (lower is better), ``"min:val_loss"``, ``"max:accuracy"``.

    >>> parse_rank_by("max:accuracy"), parse_rank_by("loss")
    (RankBy(name='accuracy', higher=True), RankBy(name='loss', higher=False))
    """
    mode, sep, name = text.strip().rpartition(":")
    if (sep and mode not in ("min", "max")) or not name:
        raise ExperimentError(
            f"--rank-by {text}: expected a metric name, with min: or max: before it where "
            "higher is better (e.g. --rank-by val_loss or --rank-by max:accuracy)"
        )
    return RankBy(name, mode == "max")


def check_rank_by(rank_by: RankBy, metrics: Any) -> None:
    """Refuse a metric that neither the losses nor ``metrics`` (evaluate's names) hold."""
    if rank_by.name not in LOSSES and rank_by.name not in metrics:
        available = [*LOSSES, *sorted(metrics)]
        raise ExperimentError(
            f"--rank-by {rank_by.name}: no such metric; available: {', '.join(available)}"
            + ("" if metrics else " (evaluate(params) returns more)")
        )


@dataclasses.dataclass
class MemberLog:
    """One member's recent losses, last evaluation, and whether its divergence was logged."""

    recent: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_LOSSES)
    )
    final_loss: float | None = None
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    diverged_at: int = 0
    reported: bool = False
    final_evaluated: bool = False  # tried after the last step (a failure is not tried again)


def log_step(ensemble: Ensemble, out: Any, step: int, logs: list[MemberLog],
             rates: dict[str, float], is_eval: bool, say: Callable[[str], None]
             ) -> list[dict[str, Any]]:
    """One metrics line per member still training (or diverged since the last log)."""
    losses, norms = out.loss.tolist(), out.grad_norm.tolist()
    diverged = out.diverged_at.tolist()
    found = _find_lr(out.opt_state)  # the members' (K,) lr, wherever the chain keeps it
    lrs = found.tolist() if isinstance(found, torch.Tensor) else [None] * len(losses)
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
            record.update(loss=losses[k], lr=lrs[k], grad_norm=norms[k],
                          **{key: values[k] for key, values in aux.items()}, **rates,
                          rss_bytes=rss)
            if is_eval:
                log.last_eval = member_eval(ensemble, k, member_params[k], log, step, say)
                record.update(log.last_eval)
        records.append(record)
    return records


def member_eval(ensemble: Ensemble, k: int, params: Any, log: MemberLog, step: int | None,
                say: Callable[[str], None]) -> dict[str, float]:
    """Member ``k``'s evaluation at ``step``; the final one, if it fails, is a warning and none."""
    steps = ensemble.template.steps
    log.final_evaluated = step is None or step >= steps
    return evaluation(ensemble.experiments[k].evaluate, params, step=step, steps=steps,
                      what=f"the final evaluation of member {k}", say=say)


def reload_logs(run_dir: Path, start: int, logs: list[MemberLog],
                diverged_at: torch.Tensor) -> None:
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


def rank_value(row: dict[str, Any]) -> float | None:
    """The value of the metric a ranking row was ranked by (None: it has none)."""
    name = row["ranked_by"]
    return row[LOSSES[name]] if name in LOSSES else row["eval"].get(name)


def ranking(members: tuple[Member, ...], logs: list[MemberLog],
            rank_by: RankBy | None = None) -> list[dict[str, Any]]:
    """Members best first: by ``rank_by``, else by held-out ``val_loss`` when every healthy
    member has one, else by the mean of their last logged train losses; diverged members last,
    earliest first. A member without the metric ranks after those with it."""
    healthy = [log for log in logs if not log.diverged_at]
    if rank_by is None:
        by_val = bool(healthy) and all("val_loss" in log.last_eval for log in healthy)
        rank_by = RankBy("val_loss" if by_val else "smoothed_loss")
    rows = []
    for member, log in zip(members, logs, strict=True):
        smoothed = sum(log.recent) / len(log.recent) if log.recent else None
        rows.append({
            "member": member.index,
            "seed": member.seed,
            "config": member.swept,
            "final_loss": None if log.diverged_at else log.final_loss,
            "smoothed_loss": None if log.diverged_at else smoothed,
            "eval": log.last_eval,
            "diverged_at": log.diverged_at or None,
            "ranked_by": rank_by.name,
            "higher_is_better": rank_by.higher,
        })

    def key(row: dict[str, Any]) -> tuple:
        if row["diverged_at"] is not None:
            return (1, row["diverged_at"], row["member"])
        value = rank_value(row)
        if value is None or not math.isfinite(value):
            return (0, math.inf, row["member"])
        return (0, -value if rank_by.higher else value, row["member"])

    rows.sort(key=key)
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    return rows
