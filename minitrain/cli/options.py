"""Options that ``minitrain run`` and ``minitrain sweep`` share, defined once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

# Step numbers name checkpoints (step-NNNNNNNN) and seeds feed numpy's SeedSequence and torch:
# both take values below 2**63.
MAX_STEPS = 2**63 - 1
MAX_SEED = 2**63 - 1
SEED = click.IntRange(min=0, max=MAX_SEED)

_SHARED = (
    click.option(
        "--backend",
        default="cpu",
        help="cpu (fp32), cpu-bf16, cpu-fp16, cpu-fp8, cpu-mxfp8, cpu-mxfp4, cpu-nvfp4, cuda "
        "(bf16 autocast), cuda-fp16, cuda-fp8, auto, or an installed backend "
        "(see minitrain backends).",
    ),
    click.option(
        "--steps",
        type=click.IntRange(min=0, max=MAX_STEPS),
        default=None,
        help="Override the step count.",
    ),
    click.option("--out", type=click.Path(path_type=Path), default=None, help="Run directory."),
    click.option("--log-every", type=click.IntRange(min=1), default=1, help="Log every N steps."),
    click.option(
        "--checkpoint-every",
        type=click.IntRange(min=0),
        default=0,
        help="Checkpoint every N steps (0: only at the end and on Ctrl-C). Needs --out.",
    ),
    click.option("--keep", type=click.IntRange(min=1), default=3, help="Checkpoints to keep."),
    click.option(
        "--resume", is_flag=True, help="Continue from the latest valid checkpoint in --out."
    ),
    click.option(
        "--overwrite",
        is_flag=True,
        help="Replace the earlier run in --out (its metrics, checkpoints and summary).",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout."),
)


def training_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add --backend, --steps, --out, --log-every, --checkpoint-every, --keep, --resume,
    --overwrite and --json."""
    for option in reversed(_SHARED):
        command = option(command)
    return command
