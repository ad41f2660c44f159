"""``minitrain bench typecheck``: the cost of runtime shape checks, per call and per train step.

Per call: the jaxtyping+beartype-wrapped ``mt.models.cruncher`` against the same function
unwrapped, in one process. Per step: the linreg example's train step timed in two child
processes, one with ``MINITRAIN_TYPECHECK=1`` and one with ``=0`` (the switch is read at import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import timeit
from pathlib import Path

import click
import torch

import minitrain as mt

LINREG = Path(__file__).resolve().parents[2] / "examples" / "linreg.py"


def per_call_seconds(repeats: int = 2000) -> dict[str, float]:
    """Seconds per call of ``cruncher`` (dim 16, batch 4) with and without the shape check."""
    params = mt.models.cruncher_init(dim=16, num_layers=0, generator=torch.Generator())
    x = torch.randn(4, 16)
    checked = mt.models.cruncher
    unchecked = getattr(checked, "__wrapped__", checked)
    times = {}
    for name, fn in (("checked", checked), ("unchecked", unchecked), ("checked2", checked)):
        best = min(timeit.repeat(lambda fn=fn: fn(params, x), number=repeats, repeat=5))
        times[name] = best / repeats
    times["checked"] = min(times.pop("checked2"), times["checked"])
    return times


def step_seconds(typecheck: bool, steps: int = 2000) -> float:
    """Median-free steady-state seconds per linreg step, from a child process."""
    env = {**os.environ, "MINITRAIN_TYPECHECK": "1" if typecheck else "0"}
    code = (
        "import json, minitrain as mt\n"
        "from minitrain.train import fit, load_experiment\n"
        f"exp, cfg = load_experiment({str(LINREG)!r}, steps={steps})\n"
        "r = fit(exp, mt.get_backend('cpu'), progress=False)\n"
        "print(json.dumps(r.summary['step_seconds']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


@click.command("typecheck")
@click.option("--steps", default=2000, show_default=True, help="Linreg steps per child run.")
@click.option("--json", "as_json", is_flag=True)
def typecheck(steps: int, as_json: bool) -> None:
    """Shape-check overhead: per cruncher call and per linreg train step."""
    call = per_call_seconds()
    on = min(step_seconds(True, steps), step_seconds(True, steps))
    off = min(step_seconds(False, steps), step_seconds(False, steps))
    result = {
        "call_checked_us": call["checked"] * 1e6,
        "call_unchecked_us": call["unchecked"] * 1e6,
        "call_overhead_us": (call["checked"] - call["unchecked"]) * 1e6,
        "step_checked_us": on * 1e6,
        "step_unchecked_us": off * 1e6,
        "step_overhead_us": (on - off) * 1e6,
        "step_ratio": on / off,
    }
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(
        f"per call (cruncher, B=4, D=16): checked {result['call_checked_us']:.1f} us, "
        f"unchecked {result['call_unchecked_us']:.1f} us, "
        f"overhead {result['call_overhead_us']:.1f} us"
    )
    click.echo(
        f"per linreg step: checked {result['step_checked_us']:.1f} us, "
        f"unchecked {result['step_unchecked_us']:.1f} us, "
        f"overhead {result['step_overhead_us']:.1f} us ({result['step_ratio']:.2f}x)"
    )
