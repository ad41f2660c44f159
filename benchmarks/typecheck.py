"""``python benchmarks/typecheck.py``: the cost of runtime shape checks, per call and per train
step.

Both figures come from child processes, alternately with ``MINITRAIN_TYPECHECK=1`` and ``=0``
(the switch is read at import): a ``mt.models.cruncher`` call (D=16, B=4) and a steady-state
step of the linreg example.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
from _pages import page
from _timing import main

LINREG = Path(__file__).resolve().parents[1] / "examples" / "linreg.py"


def measure(typecheck: bool, steps: int) -> dict[str, float]:
    """Seconds per ``cruncher`` call (D=16, B=4) and per linreg step, in a child process."""
    env = {**os.environ, "MINITRAIN_TYPECHECK": "1" if typecheck else "0"}
    code = (
        "import json, timeit, torch, minitrain as mt\n"
        "from minitrain.train import fit, load_experiment\n"
        "p = mt.models.cruncher_init(dim=16, num_layers=0, generator=torch.Generator())\n"
        "x = torch.randn(4, 16)\n"
        "call = min(timeit.repeat(lambda: mt.models.cruncher(p, x), number=2000, repeat=5))\n"
        f"exp, cfg = load_experiment({str(LINREG)!r}, steps={steps})\n"
        "r = fit(exp, mt.get_backend('cpu'), progress=False)\n"
        "print(json.dumps({'call': call / 2000, 'step': r.summary['step_seconds']}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of(typecheck: bool, steps: int, runs: int = 2) -> dict[str, float]:
    """The fastest of ``runs`` child processes, per figure (noise only ever adds time)."""
    results = [measure(typecheck, steps) for _ in range(runs)]
    return {key: min(r[key] for r in results) for key in results[0]}


def overhead(steps: int) -> dict[str, float]:
    """Checked and unchecked microseconds per cruncher call and per linreg step, and the ratio.

    The checked step is the best of two batches of child runs, as it is the figure a noisy
    machine inflates most.
    """
    on, off = best_of(True, steps), best_of(False, steps)
    on = {**on, "step": min(on["step"], best_of(True, steps)["step"])}
    return {
        "call_checked_us": on["call"] * 1e6,
        "call_unchecked_us": off["call"] * 1e6,
        "call_overhead_us": (on["call"] - off["call"]) * 1e6,
        "step_checked_us": on["step"] * 1e6,
        "step_unchecked_us": off["step"] * 1e6,
        "step_overhead_us": (on["step"] - off["step"]) * 1e6,
        "step_ratio": on["step"] / off["step"],
    }


@click.command("typecheck")
@page("typecheck", "Shape checks: jaxtyping + beartype on against off")
@click.option("--steps", default=2000, show_default=True, help="Linreg steps per child run.")
@click.option("--json", "as_json", is_flag=True)
def typecheck(steps: int, as_json: bool) -> None:
    """Shape-check overhead: per cruncher call and per linreg train step."""
    result = overhead(steps)
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


if __name__ == "__main__":
    main(typecheck)
