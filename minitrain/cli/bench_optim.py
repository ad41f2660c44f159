"""``minitrain bench optim``: the command over :mod:`minitrain.bench.optim` (parse, run, print)."""

from __future__ import annotations

import json

import click
import torch

from minitrain.bench.optim import CHAINS, OPTIMIZERS, breakdown, measure, measure_chains
from minitrain.bench.optim_family import FAMILY, family_ratios
from minitrain.bench.optim_processes import run_children, summarize
from minitrain.cli.errors import UserError

__all__ = ["optim"]


@click.command()
@click.option("--optimizer", "names", multiple=True, type=click.Choice(list(OPTIMIZERS)),
              help="Optimizers to time (repeatable); default: all.")
@click.option("--count", type=click.IntRange(min=1), default=8, help="Number of params.")
@click.option("--size", type=click.IntRange(min=1), default=1024, help="Each param is size².")
@click.option("--rounds", type=click.IntRange(min=1), default=15, help="Interleaved rounds.")
@click.option("--inner", type=click.IntRange(min=1), default=5, help="Updates per round.")
@click.option("--device", default="cpu", help="cpu or cuda.")
@click.option("--breakdown", "with_breakdown", is_flag=True,
              help="Also split a pure AdamW update into kernel, copies, overhead, faults (CPU).")
@click.option("--compiled", is_flag=True,
              help="Also time the pure update with impl='compiled' (torch.compile; slow start).")
@click.option("--chain", "chains", multiple=True, type=click.Choice(list(CHAINS)),
              help="Chains of transformations to time (repeatable); default: all.")
@click.option("--family", "with_family", is_flag=True,
              help="Also time the rest of the family (Adadelta ... Muon, Lion, schedule-free "
                   "AdamW) against their references' fastest path (CPU).")
@click.option("--member", "members", multiple=True, type=click.Choice(list(FAMILY)),
              help="With --family: members to time (repeatable); default: all.")
@click.option("--cold", is_flag=True,
              help="Flush the last-level cache before every timed update, as a training "
                   "loop's forward and backward pass do (CPU).")
@click.option("--budget", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="With --family: seconds a member's row may take; a slower one (Muon's "
                   "bfloat16 GEMMs on a CPU without native bfloat16) times fewer updates, "
                   "down to 6 rounds of 1.")
@click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the whole measurement in this many fresh processes, one after "
                   "another, and give each figure's median across them (with a 95% interval "
                   "from 6 on): where the allocator puts buffers differs between processes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def optim(names: tuple[str, ...], count: int, size: int, rounds: int, inner: int, device: str,
          with_breakdown: bool, compiled: bool, chains: tuple[str, ...], with_family: bool,
          members: tuple[str, ...], cold: bool, budget: float, processes: int,
          as_json: bool) -> None:
    """mt.optim update time over torch.optim fused (foreach for RMSprop), pure and donated;
    chains built by hand over fused AdamW; with --family, every other optimizer's pure update
    over its reference (target <= 1.0x)."""
    if with_family and device != "cpu":
        raise UserError("--family times the CPU only; drop --family or use --device cpu")
    if cold and device != "cpu":
        raise UserError("--cold flushes the CPU's cache only; drop --cold or use --device cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda needs a CUDA GPU; none is available, use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"--device {device!r} is not supported; use cpu or cuda")
    if processes > 1:
        if with_breakdown or compiled:
            flag = "--breakdown" if with_breakdown else "--compiled"
            raise UserError(f"{flag} is not summarized across processes; drop {flag} or "
                            "--processes")
        context = click.get_current_context()
        _across_processes(_child_options(context.command, context.params), processes, cold,
                          as_json)
        return
    result = measure(list(names or OPTIMIZERS), count, size, rounds, inner, device, compiled,
                     cold)
    result["cold"] = cold
    if with_breakdown:
        result["breakdown"] = breakdown(count, size, rounds, inner)
    result["chains"] = measure_chains(list(chains or CHAINS), count, size, rounds, inner,
                                      device, cold)["results"]
    if with_family:
        result["family"] = family_ratios(list(members) or None, count, size, rounds, inner,
                                         compiled, cold, budget)["results"]
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"update of {result['params']} on {device} (best of {rounds} interleaved "
               f"rounds x {inner}; paired: median of the rounds' own ratios, with its "
               "distribution-free 95% interval"
               + ("; cold: the last-level cache flushed before every update)" if cold else ")"))
    for name, entry in result["results"].items():
        times = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in entry["seconds"].items())
        click.echo(f"  {name:13s} {times}")
        paired, intervals = entry["paired_median_ratios"], entry["paired_intervals"]
        ratios = f"pure / {entry['peer']}: {entry['pure_over_peer']:.2f}x "
        ratios += f"({_paired(paired['pure'], intervals['pure'])})   "
        ratios += f"donate / {entry['peer']}: {entry['donate_over_peer']:.2f}x "
        ratios += f"({_paired(paired['donate'], intervals['donate'])})"
        if "compiled_over_peer" in entry:
            ratios += f"   compiled / {entry['peer']}: {entry['compiled_over_peer']:.2f}x"
        click.echo(f"  {'':13s} {ratios}")
    for name, entry in result["chains"].items():
        times = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in entry["seconds"].items())
        click.echo(f"  {name}  {times}")
        pure = _paired(entry["paired_median_ratio"], entry["paired_interval"])
        donate = _paired(entry["paired_median_donate_ratio"], entry["paired_donate_interval"])
        click.echo(f"  {'':13s} pure / {entry['peer']}: {entry['pure_over_peer']:.2f}x "
                   f"({pure}; target <= {entry['target']}x)   "
                   f"donate: {entry['donate_over_peer']:.2f}x ({donate})"
                   f"   pure / torch's clip_grad_norm_ + step: "
                   f"{entry['pure_over_torch_chain']:.2f}x (paired)")
    for name, entry in result.get("family", {}).items():
        if "skipped" in entry:
            click.echo(f"  {name:13s} skipped: {entry['skipped']}")
            continue
        times = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in entry["seconds"].items())
        click.echo(f"  {name:13s} {times}")
        ratios = (f"pure / {entry['reference']}: {entry['pure_over_reference']:.2f}x "
                  f"({_paired(entry['paired_median_ratio'], entry['paired_interval'])}; "
                  f"target <= {entry['target']}x)")
        if "compiled_over_reference" in entry:
            ratios += f"   compiled: {entry['compiled_over_reference']:.2f}x"
        if (entry["rounds"], entry["inner"]) != (rounds, inner):
            ratios += (f"   ({entry['rounds']} rounds x {entry['inner']}: a slow update, "
                       "cut to --budget)")
        click.echo(f"  {'':13s} {ratios}")
    if with_breakdown:
        click.echo("pure AdamW update, by part:")
        parts = result["breakdown"]
        for name, seconds in parts["seconds"].items():
            faults = parts["minor_page_faults_per_call"][name]
            click.echo(f"  {name:28s} {seconds * 1e3:8.3f} ms  {faults:8.0f} page faults/call")


NOT_FORWARDED = {"processes", "as_json"}
"""Options a child process does not get: it runs once and prints JSON."""


def _child_options(command: click.Command, params: dict) -> list[str]:
    """The options of one child process: every option of ``command`` as ``params`` holds it
    (defaults too), less :data:`NOT_FORWARDED`.

    >>> _child_options(optim, optim.make_context("optim", ["--optimizer", "adam",
    ...     "--cold"]).params)[:6]
    ['--optimizer', 'adam', '--count', '8', '--size', '1024']
    """
    options: list[str] = []
    for param in command.params:
        if param.name in NOT_FORWARDED or not isinstance(param, click.Option):
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


def _across_processes(options: list[str], processes: int, cold: bool, as_json: bool) -> None:
    """Run ``processes`` children with ``options`` and print each figure's median across them."""
    def progress(done: int) -> None:
        click.echo(f"process {done} of {processes} done", err=True)

    results = run_children(options, processes, progress=progress)
    rows = summarize(results)
    if as_json:
        click.echo(json.dumps({"processes": results, "summary": rows}, indent=2))
        return
    first = results[0]
    click.echo(f"update of {first['params']} on {first['device']}"
               + (", the cache flushed before every update" if cold else "")
               + f"; {processes} processes one after another, each giving the paired median "
               "ratio over its interleaved rounds. Per figure: the median across processes "
               "[its 95% interval], how many processes were over the target, each process's "
               "ratio")
    width = max(len(row["figure"]) for row in rows)
    for row in rows:
        interval = "" if row["interval"] is None else \
            f" [{row['interval'][0]:.2f}, {row['interval'][1]:.2f}]"
        target = "" if row["target"] is None else \
            f"  target <= {row['target']}x: {row['over_target']} of {len(row['ratios'])} over"
        each = " ".join(f"{r:.3f}" for r in row["ratios"])
        click.echo(f"  {row['figure']:{width}s}  {row['median']:.2f}x{interval}{target}  ({each})")


def _paired(ratio: float, interval: list[float] | tuple[float, float] | None) -> str:
    """``paired 1.09x [1.02, 1.15]``: the paired median ratio and its 95% interval (none under
    6 rounds).

    >>> _paired(1.094, (1.02, 1.151)), _paired(1.0, None)
    ('paired 1.09x [1.02, 1.15]', 'paired 1.00x')
    """
    text = f"paired {ratio:.2f}x"
    return text if interval is None else f"{text} [{interval[0]:.2f}, {interval[1]:.2f}]"
