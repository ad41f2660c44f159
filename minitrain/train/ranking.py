"""A sweep's members side by side: their log lines, recent losses and the ranking.

Diverged members rank last; the others by ``val_loss`` when all have one, else by the mean of
their last :data:`RECENT_LOSSES` logged losses.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minitrain.metrics import METRICS_FILE, read_metrics
from minitrain.train.members import Ensemble, Member, member_label
from minitrain.train.progress import resident_bytes
from minitrain.train.stepper import evaluated
from minitrain.tree import unstack

__all__ = ["RECENT_LOSSES", "MemberLog", "log_step", "ranking", "reload_logs"]

RECENT_LOSSES = 10  # the ranking's smoothed loss: the mean of this many last logged losses


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


def log_step(ensemble: Ensemble, out: Any, step: int, logs: list[MemberLog],
             rates: dict[str, float], is_eval: bool, say: Callable[[str], None]
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
            record.update(loss=losses[k], lr=lrs[k], grad_norm=norms[k],
                          **{key: values[k] for key, values in aux.items()}, **rates,
                          rss_bytes=rss)
            if is_eval:
                evaluate = ensemble.experiments[k].evaluate
                log.last_eval = evaluated(evaluate, member_params[k], step=step)
                record.update(log.last_eval)
        records.append(record)
    return records


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


def ranking(members: tuple[Member, ...], logs: list[MemberLog]) -> list[dict[str, Any]]:
    """Members best first: by held-out ``val_loss`` when every healthy member has one, else by
    the mean of their last logged train losses; diverged members last, earliest first."""
    healthy = [log for log in logs if not log.diverged_at]
    by_val = bool(healthy) and all("val_loss" in log.last_eval for log in healthy)
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
            "ranked_by": "val_loss" if by_val else "smoothed_loss",
        })

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
