"""``minitrain bench optim --processes N``: the same measurement in N fresh processes, one
after another, each figure summarized by its median across the processes.

Within one process a figure's paired ratio is tight (its interval over the rounds is a few
percent wide), yet two processes can disagree by more than that: what differs between them is
where the allocator puts the tensors and the pool's buffers (page offsets, heap or fresh
mmap), which no round within a process samples. On a 2-core AVX2 EPYC the pure chain's paired
ratio ranged 1.30-1.53x over seven processes whose own intervals were +-0.05 wide (README,
runs 28-34). Each process still times the peers interleaved and paired, as one run does.
Results saved with ``--json`` pool by passing their ``"processes"`` lists, joined, to
:func:`summarize`.

>>> one = {"results": {"adam": {"peer": "torch_fused", "targets": {"pure": 1.35},
...        "paired_median_ratios": {"pure": 1.2}}}}
>>> [(row["figure"], row["median"], row["over_target"]) for row in summarize([one, one])]
[('adam pure / torch_fused', 1.2, 0)]
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from minitrain.bench.optim import median_interval
from minitrain.errors import RunFailed

__all__ = ["ChildFailed", "child_command", "figures", "run_children", "summarize"]


class ChildFailed(RunFailed):
    """A child benchmark process failed (exit code 1): it exited with an error or printed no
    JSON result."""


def child_command(options: list[str]) -> list[str]:
    """The command line of one child: ``minitrain bench optim`` with ``options``, as JSON.

    >>> child_command(["--count", "2"])[-4:]
    ['optim', '--count', '2', '--json']
    """
    return [sys.executable, "-m", "minitrain", "bench", "optim", *options, "--json"]


def _why(done: subprocess.CompletedProcess) -> str:
    """How a child ended badly, in a few words: its signal or exit status, and its last line on
    stderr (less the command line's ``error:`` prefix)."""
    if done.returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            how = f"was killed by signal {-done.returncode}"
    else:
        how = f"exited with status {done.returncode}"
    lines = (done.stderr or "").strip().splitlines()
    last = lines[-1].removeprefix("error: ") if lines else "no output on stderr"
    return f"{how}: {last}"


def run_children(options: list[str], processes: int,
                 run: Callable[..., Any] = subprocess.run,
                 progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Each child's ``--json`` result, the children run one after another (two at once would
    share the memory bus each one measures); ``progress(i)`` after the ``i``-th. Raises
    :class:`ChildFailed` for a child that fails or prints no JSON."""
    results = []
    for index in range(processes):
        done = run(child_command(options), capture_output=True, text=True)
        which = f"benchmark process {index + 1} of {processes}"
        if done.returncode != 0:
            raise ChildFailed(f"{which} {_why(done)}")
        try:
            results.append(json.loads(done.stdout))
        except json.JSONDecodeError:
            first = (done.stdout or "").strip().splitlines()[:1] or ["nothing"]
            raise ChildFailed(f"{which} printed no JSON result; its output began: "
                              f"{first[0][:200]}") from None
        if progress is not None:
            progress(index + 1)
    return results


def figures(result: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """Figure name -> (paired median ratio, target or None) of one process's ``--json`` result:
    each alias pure and donated, each chain pure (its target) and donated, each family member
    timed (a skipped member has none). The targets are the ones the measurement reports."""
    rows: dict[str, tuple[float, float | None]] = {}
    for name, entry in result["results"].items():
        for side, ratio in entry["paired_median_ratios"].items():
            rows[f"{name} {side} / {entry['peer']}"] = (ratio, entry["targets"].get(side))
    for name, entry in result.get("chains", {}).items():
        rows[f"{name} pure / {entry['peer']}"] = (entry["paired_median_ratio"], entry["target"])
        rows[f"{name} donate / {entry['peer']}"] = (entry["paired_median_donate_ratio"], None)
    for name, entry in result.get("family", {}).items():
        if "skipped" not in entry:
            rows[f"{name} pure / {entry['reference']}"] = (entry["paired_median_ratio"],
                                                           entry["target"])
    return rows


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per figure: every process's ratio, their median, its distribution-free 95% interval
    (None under six ratios), and how many were over the target (None without one). Raises
    ``ValueError`` when the processes did not all measure the same figures."""
    per_process = [figures(result) for result in results]
    names = list(per_process[0])
    for index, figures_of in enumerate(per_process[1:], start=2):
        if set(figures_of) != set(names):
            differ = sorted(set(figures_of) ^ set(names))
            raise ValueError(f"process {index} measured other figures than process 1 "
                             f"({', '.join(differ)}); summarize runs of the same options")
    rows = []
    for name in names:
        ratios = [figures_of[name][0] for figures_of in per_process]
        target = per_process[0][name][1]
        rows.append({
            "figure": name,
            "target": target,
            "ratios": ratios,
            "median": statistics.median(ratios),
            "interval": median_interval(ratios),
            "over_target": None if target is None else sum(r > target for r in ratios),
        })
    return rows
