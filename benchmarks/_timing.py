"""What every benchmark here shares: interleaved timing, paired ratios and their intervals, the
cache flush of ``--cold``, the measurement repeated in fresh processes, and the entry point.

Absolute times on shared machines mean little; ratios from one process run are what to read:
each round runs every stepper one after another, so all see the same machine load, and the
ratio of two steppers in the same round cancels the load of that moment.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from minitrain.cli.errors import run_cli
from minitrain.errors import RunFailed

__all__ = [
    "ChildFailed", "across_processes", "best_rounds", "cache_flusher", "child_options", "figures",
    "last_level_cache_bytes",
    "main", "median_interval", "paired", "paired_median_ratio", "paired_ratio_interval",
    "run_children", "summarize", "summary_lines", "time_interleaved", "time_rounds",
]


def main(command: click.Command) -> None:
    """Run ``command`` as minitrain's own commands run: a mistake is one ``error:`` line and
    exit code 2, a failed measurement exit code 1."""
    run_cli(command)


# --------------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_rounds(
    steppers: dict[str, Callable[[], None]], rounds: int, inner: int, device: str,
    before_call: Callable[[], None] | None = None, warmup: int = 3,
) -> dict[str, list[float]]:
    """Each round's seconds per call of each stepper, over ``rounds`` interleaved rounds (in a
    round the steppers run one after another, in order), after ``warmup`` untimed calls of
    each. ``before_call`` (e.g. :func:`cache_flusher`) runs untimed before every timed call.

    >>> flushes = []
    >>> times = time_rounds({"a": lambda: None}, 2, 3, "cpu", lambda: flushes.append(1))
    >>> len(times["a"]), len(flushes)
    (2, 6)
    """
    for stepper in steppers.values():  # warm-up: first-step branches, allocator, caches
        for _ in range(warmup):
            stepper()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, stepper in steppers.items():
            if before_call is None:
                _sync(device)
                start = time.perf_counter()
                for _ in range(inner):
                    stepper()
                _sync(device)
                times[name].append((time.perf_counter() - start) / inner)
                continue
            total = 0.0
            for _ in range(inner):
                before_call()
                _sync(device)
                start = time.perf_counter()
                stepper()
                _sync(device)
                total += time.perf_counter() - start
            times[name].append(total / inner)
    return times


def best_rounds(times: dict[str, list[float]]) -> dict[str, float]:
    """Each stepper's fastest round (see :func:`time_interleaved`).

    >>> best_rounds({"a": [2.0, 1.0]})
    {'a': 1.0}
    """
    return {name: min(values) for name, values in times.items()}


def time_interleaved(
    steppers: dict[str, Callable[[], None]], rounds: int, inner: int, device: str
) -> dict[str, float]:
    """Fastest round's seconds per call of each stepper over ``rounds`` interleaved rounds.

    The minimum, not the median: on a machine shared with other jobs, the fastest round is the
    one least disturbed by them, and it is disturbed the same way for every stepper.
    """
    return best_rounds(time_rounds(steppers, rounds, inner, device))


def last_level_cache_bytes() -> int:
    """This CPU's last-level cache, from Linux's sysfs; 512 MiB where it cannot be read.

    >>> last_level_cache_bytes() > 0
    True
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=512 * 2**20)


def cache_flusher() -> Callable[[], None]:
    """A function that writes twice the last-level cache's bytes: what a forward and backward
    pass do to the optimizer's buffers between two updates of a model larger than the cache
    (``--cold``). Without it, an in-place peer keeps its params and state in cache from one
    timed update to the next, which no training loop does.
    """
    import torch

    buffer = torch.empty(2 * last_level_cache_bytes() // 4)
    value = [0.0]

    def flush() -> None:
        value[0] = 1.0 - value[0]
        buffer.fill_(value[0])

    return flush


# ------------------------------------------------------------------------- paired ratios


def paired_median_ratio(times: dict[str, list[float]], name: str, peer: str) -> float:
    """The median over rounds of ``name``'s time over ``peer``'s in the same round: two
    steppers run back to back share the load of that moment, which the ratio cancels.

    >>> paired_median_ratio({"a": [2.0, 9.0, 3.0], "b": [1.0, 9.0, 2.0]}, "a", "b")
    1.5
    """
    return statistics.median(a / b for a, b in zip(times[name], times[peer], strict=True))


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free ``confidence`` interval for the median of what ``values`` sample: the
    ``k``-th smallest and ``k``-th largest value, ``k`` the largest with P(Binomial(n, 1/2) < k)
    <= (1 - confidence) / 2 (the sign test's interval: Conover, *Practical Nonparametric
    Statistics*, 3rd ed., 3.2). None when ``n`` is too small for any (under 6 at 95%).

    >>> median_interval([float(v) for v in range(1, 16)])  # n = 15: the 4th and the 12th
    (4.0, 12.0)
    >>> median_interval([1.0, 2.0, 3.0]) is None
    True
    """
    n, tail = len(values), (1 - confidence) / 2
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k)
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def paired_ratio_interval(times: dict[str, list[float]], name: str,
                          peer: str) -> tuple[float, float] | None:
    """The 95% interval (:func:`median_interval`) of :func:`paired_median_ratio`'s median."""
    return median_interval([a / b for a, b in zip(times[name], times[peer], strict=True)])


def paired(ratio: float, interval: list[float] | tuple[float, float] | None) -> str:
    """``paired 1.09x [1.02, 1.15]``: the paired median ratio and its 95% interval (none under
    6 rounds).

    >>> paired(1.094, (1.02, 1.151)), paired(1.0, None)
    ('paired 1.09x [1.02, 1.15]', 'paired 1.00x')
    """
    text = f"paired {ratio:.2f}x"
    return text if interval is None else f"{text} [{interval[0]:.2f}, {interval[1]:.2f}]"


# -------------------------------------------------------------------- in fresh processes
# Within one process a figure's paired ratio is tight (its interval over the rounds is a few
# percent wide), yet two processes can disagree by more than that: what differs between them is
# where the allocator puts the tensors and the pool's buffers (page offsets, heap or fresh
# mmap), which no round within a process samples. ``--processes N`` runs the whole measurement
# in N fresh processes one after another, each still timing its peers interleaved and paired,
# and gives each figure's median across them (:func:`summarize`). Results saved with ``--json``
# pool by passing their ``"processes"`` lists, joined, to :func:`summarize`.


class ChildFailed(RunFailed):
    """A child benchmark process failed (exit code 1): it exited with an error or printed no
    JSON result."""


def child_command(script: str | Path, options: list[str]) -> list[str]:
    """The command line of one child: ``python <script>`` with ``options``, as JSON.

    >>> child_command("benchmarks/optim.py", ["--count", "2"])[1:]
    ['benchmarks/optim.py', '--count', '2', '--json']
    """
    return [sys.executable, str(script), *options, "--json"]


def child_options(command: click.Command, params: dict, not_forwarded: set[str]) -> list[str]:
    """The options of one child process: every option of ``command`` as ``params`` holds it
    (defaults too), less those named in ``not_forwarded`` and those left unset (None).

    >>> @click.command()
    ... @click.option("--size", default=8)
    ... @click.option("--threads", type=int, default=None)
    ... @click.option("--cold", is_flag=True)
    ... @click.option("--json", "as_json", is_flag=True)
    ... def bench(size, threads, cold, as_json): ...
    >>> child_options(bench, bench.make_context("bench", ["--cold", "--json"]).params, {"as_json"})
    ['--size', '8', '--cold']
    """
    options: list[str] = []
    for param in command.params:
        if param.name in not_forwarded or not isinstance(param, click.Option) or \
                params[param.name] is None:
            continue
        flag, value = param.opts[0], params[param.name]
        if param.is_flag:
            options += [flag] if value else []
        elif param.multiple:
            for item in value:
                options += [flag, str(item)]
        else:
            options += [flag, str(value)]
    return options


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


def run_children(script: str | Path, options: list[str], processes: int,
                 run: Callable[..., Any] = subprocess.run,
                 progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Each child's ``--json`` result, the children run one after another (two at once would
    share the memory bus each one measures); ``progress(i)`` after the ``i``-th. Raises
    :class:`ChildFailed` for a child that fails or prints no JSON."""
    results = []
    for index in range(processes):
        done = run(child_command(script, options), capture_output=True, text=True)
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


def across_processes(script: str | Path, options: list[str], processes: int, as_json: bool,
                     heading: Callable[[dict[str, Any]], str]) -> None:
    """Run ``processes`` children of ``script`` with ``options`` (progress on stderr) and print
    each figure's median across them (:func:`summary_lines`) under ``heading(first result)``,
    or with ``as_json`` every result and the summary."""
    def progress(done: int) -> None:
        click.echo(f"process {done} of {processes} done", err=True)

    results = run_children(Path(script).resolve(), options, processes, progress=progress)
    rows = summarize(results)
    if as_json:
        click.echo(json.dumps({"processes": results, "summary": rows}, indent=2))
        return
    click.echo(f"{heading(results[0])}; {processes} processes one after another, each giving "
               "the paired median ratio over its interleaved rounds. Per figure: the median "
               "across processes [its 95% interval], how many processes were over the target, "
               "each process's ratio")
    for line in summary_lines(rows):
        click.echo(line)


def figures(result: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """Figure name -> (paired median ratio, target or None) of one process's ``--json``
    result: of ``optim.py``, each alias pure and donated, each chain pure (its target) and
    donated, each family member timed (a skipped member has none); of ``research.py``, each row.
    The targets are the ones the measurement reports."""
    if "rows" in result:
        return {name: (entry["paired_median_ratio"], entry["target"])
                for name, entry in result["rows"].items()}
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
    """Per figure (:func:`figures`) of the processes' ``--json`` results: every process's ratio,
    their median, its distribution-free 95% interval (None under six ratios), and how many were
    over the target (None without one). Raises ``ValueError`` when the processes did not all
    measure the same figures.

    >>> one = {"results": {"adam": {"peer": "torch_fused", "targets": {"pure": 1.35},
    ...        "paired_median_ratios": {"pure": 1.2}}}}
    >>> [(row["figure"], row["median"], row["over_target"]) for row in summarize([one, one])]
    [('adam pure / torch_fused', 1.2, 0)]
    """
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


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per figure: the median across processes [its 95% interval], how many processes
    were over the target, each process's ratio.

    >>> one = {"results": {"adam": {"peer": "torch_fused", "targets": {"pure": 1.35},
    ...        "paired_median_ratios": {"pure": 1.1}}}}
    >>> summary_lines(summarize([one]))
    ['  adam pure / torch_fused  1.10x  target <= 1.35x: 0 of 1 over  (1.100)']
    """
    width = max(len(row["figure"]) for row in rows)
    lines = []
    for row in rows:
        interval = "" if row["interval"] is None else \
            f" [{row['interval'][0]:.2f}, {row['interval'][1]:.2f}]"
        target = "" if row["target"] is None else \
            f"  target <= {row['target']}x: {row['over_target']} of {len(row['ratios'])} over"
        each = " ".join(f"{r:.3f}" for r in row["ratios"])
        median = f"{row['median']:.2f}x"
        lines.append(f"  {row['figure']:{width}s}  {median}{interval}{target}  ({each})")
    return lines
