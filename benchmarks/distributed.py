"""``python benchmarks/distributed.py``: steps/s of the byte-level example at 1 and N ranks.

Strong scaling: the global batch stays the same, so N ranks each compute 1/N of it and then
all-reduce the gradients (gloo on CPU). Each configuration is a real ``minitrain run`` process
(``--nproc N`` starts the workers through torch.distributed's elastic agent); the configurations
alternate round by round so they see the same machine load. The peers are one plain process
without the launcher, with all cores and with one thread: on a small CPU the threads per process
matter as much as the ranks, so the table separates the two. The step time is the loop's
steady-state time (first step excluded); the all-reduce time per step is what rank 0 measured
around its gradient all-reduce, which includes waiting for the slower rank.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from _pages import page
from _timing import main

from minitrain.errors import ExperimentError, RunFailed, UserError
from minitrain.train.experiment import parse_overrides

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "bytelm.py"


def run_once(
    nproc: int | None, steps: int, overrides: dict[str, str], threads: int | None = None
) -> dict[str, Any]:
    """One ``minitrain run examples/bytelm.py`` (with ``--nproc`` unless None); its summary.

    ``threads`` sets ``OMP_NUM_THREADS`` (torch's intra-op threads per process); without it
    a plain process uses every core and ``--nproc N`` gives each worker cores / N.
    """
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "minitrain", "run", str(EXAMPLE), *sets,
               "--steps", str(steps), "--log-every", str(steps), "--json"]
    if nproc is not None:
        command += ["--nproc", str(nproc)]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RunFailed(f"{' '.join(command)} failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout)


def measure(
    ranks: tuple[int, ...] = (1, 2),
    steps: int = 20,
    rounds: int = 2,
    overrides: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Median steady-state step time per configuration over ``rounds`` interleaved rounds."""
    warmup = str(min(30, steps // 4))  # the schedule needs warmup < steps
    defaults = {"eval_every": "0", "eval_batches": "1", "warmup_steps": warmup}
    overrides = {**defaults, **(overrides or {})}
    cores = os.cpu_count() or 1
    configs: dict[str, tuple[int | None, int | None]] = {
        f"1 process, {cores} threads": (None, None),
        "1 process, 1 thread": (None, 1),
        **{f"nproc {n}": (n, None) for n in ranks},
    }
    step_seconds: dict[str, list[float]] = {name: [] for name in configs}
    reduce_seconds: dict[str, list[float]] = {name: [] for name in configs}
    summary: dict[str, Any] = {}
    for _ in range(rounds):
        for name, (nproc, threads) in configs.items():
            summary = run_once(nproc, steps, overrides, threads)
            step_seconds[name].append(summary["step_seconds"])
            comm = summary.get("resources", {}).get("communication") or {}
            if comm.get("reduce_seconds_per_step") is not None:
                reduce_seconds[name].append(comm["reduce_seconds_per_step"])
    medians = {name: statistics.median(values) for name, values in step_seconds.items()}
    base = medians["nproc 1"] if "nproc 1" in medians else medians["1 process, 1 thread"]
    resources = summary.get("resources", {})
    comm = resources.get("communication") or {}
    return {
        "example": "bytelm",
        "config": summary.get("config"),
        "params": summary.get("params"),
        "tokens_per_step": summary.get("examples_per_step"),
        "steps": steps,
        "rounds": rounds,
        "gradient_bytes": comm.get("gradient_bytes"),
        "step_seconds": medians,
        "steps_per_second": {name: 1 / s for name, s in medians.items()},
        "allreduce_seconds_per_step": {
            name: statistics.median(values) for name, values in reduce_seconds.items() if values
        },
        "speedup_vs_one_rank": {name: base / s for name, s in medians.items()},
    }


@click.command()
@page("distributed", "Data parallel: --nproc N against one process")
@click.option("--ranks", default="1,2", help="Comma-separated rank counts to time.")
@click.option("--steps", type=click.IntRange(min=3), default=20, help="Steps per run.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, help="Interleaved rounds.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a CONFIG key of examples/bytelm.py (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def distributed(ranks: str, steps: int, rounds: int, overrides: tuple[str, ...],
                as_json: bool) -> None:
    """Steps/s of examples/bytelm.py at 1 and N data-parallel ranks (same global batch)."""
    try:
        counts = tuple(sorted({int(part) for part in ranks.split(",") if part.strip()}))
        parsed = parse_overrides(list(overrides))
    except (ValueError, ExperimentError) as exc:
        raise UserError(f"--ranks expects e.g. 1,2 and --set key=value: {exc}") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--ranks expects positive rank counts such as 1,2, got {ranks!r}")
    result = measure(counts, steps, rounds, parsed)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(
        f"bytelm, {result['params']:,} params, {result['tokens_per_step']:,} tokens per global "
        f"step, median of {rounds} interleaved rounds of {steps} steps"
    )
    click.echo(f"{'configuration':<24}{'ms/step':>10}{'steps/s':>10}{'vs nproc 1':>12}"
               f"{'all-reduce ms':>15}")
    for name, seconds in result["step_seconds"].items():
        reduce = result["allreduce_seconds_per_step"].get(name)
        click.echo(
            f"{name:<24}{seconds * 1e3:>10.1f}{1 / seconds:>10.2f}"
            f"{result['speedup_vs_one_rank'][name]:>11.2f}x"
            f"{'-' if reduce is None else f'{reduce * 1e3:.2f}':>15}"
        )


if __name__ == "__main__":
    main(distributed)
