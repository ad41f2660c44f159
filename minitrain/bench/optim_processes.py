"""``minitrain bench optim --processes N``: the same measurement in N fresh processes, one
after another, each figure summarized by its median across the processes.

Within one process a figure's paired ratio is tight (its interval over the rounds is a few
percent wide), yet two processes can disagree by more than that: what differs between them is
where the allocator puts the tensors and the pool's buffers (page offsets, heap or fresh
mmap), which no round within a process samples. On a 2-core AVX2 EPYC the pure chain's paired
ratio ranged 1.30-1.53x over seven processes whose own intervals were +-0.05 wide (README,
runs 28-34). Each process still times the peers interleaved and paired, as one run does.

>>> one = {"results": {"adam": {"peer": "torch_fused",
...        "paired_median_ratios": {"pure": 1.2, "donate": 1.0}}}}
>>> [(row["figure"], row["median"], row["over_target"]) for row in summarize([one, one])]
[('adam pure / torch_fused', 1.2, 0), ('adam donate / torch_fused', 1.0, 0)]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from minitrain.bench.optim import median_interval

__all__ = ["ALIAS_TARGETS", "ChildFailed", "child_command", "figures", "run_children",
           "summarize"]

ALIAS_TARGETS = {"pure": 1.35, "donate": 1.05}
"""The aliases' targets over torch's fastest path: pure and donated updates."""

FAMILY_TARGET = 1.0
"""Every other optimizer's pure update over its reference's fastest path."""


class ChildFailed(RuntimeError):
    """A child benchmark process exited with an error."""


def child_command(options: list[str]) -> list[str]:
    """The command line of one child: ``minitrain bench optim`` with ``options``, as JSON.

    >>> child_command(["--count", "2"])[-4:]
    ['optim', '--count', '2', '--json']
    """
    return [sys.executable, "-m", "minitrain", "bench", "optim", *options, "--json"]


def run_children(options: list[str], processes: int,
                 run: Callable[..., Any] = subprocess.run,
                 progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Each child's ``--json`` result, the children run one after another (two at once would
    share the memory bus each one measures); ``progress(i)`` after the ``i``-th."""
    results = []
    for index in range(processes):
        done = run(child_command(options), capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or "").strip().splitlines()
            raise ChildFailed(f"benchmark process {index + 1} of {processes} exited with "
                              f"status {done.returncode}: {lines[-1] if lines else 'no output'}")
        results.append(json.loads(done.stdout))
        if progress is not None:
            progress(index + 1)
    return results


def figures(result: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """Figure name -> (paired median ratio, target or None) of one process's ``--json`` result:
    each alias pure and donated, each chain pure (its target) and donated, each family member
    timed (a skipped member has none)."""
    rows: dict[str, tuple[float, float | None]] = {}
    for name, entry in result["results"].items():
        for side, target in ALIAS_TARGETS.items():
            rows[f"{name} {side} / {entry['peer']}"] = (
                entry["paired_median_ratios"][side], target)
    for name, entry in result.get("chains", {}).items():
        rows[f"{name} pure / {entry['peer']}"] = (entry["paired_median_ratio"], entry["target"])
        rows[f"{name} donate / {entry['peer']}"] = (entry["paired_median_donate_ratio"], None)
    for name, entry in result.get("family", {}).items():
        if "skipped" not in entry:
            rows[f"{name} pure / {entry['reference']}"] = (entry["paired_median_ratio"],
                                                           FAMILY_TARGET)
    return rows


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per figure, in the first result's order: every process's ratio, their median, its
    distribution-free 95% interval (None under six processes), and how many processes were
    over the target (None without one)."""
    per_process = [figures(result) for result in results]
    rows = []
    for name, (_, target) in per_process[0].items():
        ratios = [figures_of[name][0] for figures_of in per_process if name in figures_of]
        rows.append({
            "figure": name,
            "target": target,
            "ratios": ratios,
            "median": statistics.median(ratios),
            "interval": median_interval(ratios),
            "over_target": None if target is None else sum(r > target for r in ratios),
        })
    return rows
