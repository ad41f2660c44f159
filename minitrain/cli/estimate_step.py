"""``minitrain estimate step SCRIPT``: one training step of a script predicted on fake tensors
(memory, FLOPs, time per step), or measured on this machine with ``--measure``."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import click

from minitrain import accounting as acc  # its names load on use: torch only where needed
from minitrain.accounting.units import si
from minitrain.cli.errors import Command, UserError
from minitrain.cli.options import SEED, Whole, emit, script_argument
from minitrain.errors import ExperimentError


@click.command("step", cls=Command)
@script_argument
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a CONFIG key of the script (repeatable), e.g. --set n_layer=48.")
@click.option("--hardware", "hardware_name", default="h100", help="See `minitrain hardware`.")
@click.option("--gpus", type=Whole(min=1), default=1,
              help="Data parallel: each device gets 1/N of the batch (the all-reduce of the "
                   "grads is not included).")
@click.option("--dtype", default=None,
              help="Dtype of the peak FLOP/s for every op (e.g. bf16 for tensor cores); "
                   "default: each op's own dtype.")
@click.option("--autocast", type=click.Choice(["none", "bf16", "fp16"]), default="none",
              help="Run forward and backward under torch.autocast in this dtype (what the "
                   "CUDA backend does in bf16); the update stays fp32.")
@click.option("--donate/--pure", default=True,
              help="Donated update (in place, as `minitrain run` does) or a pure one.")
@click.option("--seed", type=SEED, default=0, help="Seed for init and data.")
@click.option("--measure", is_flag=True,
              help="Run one real step on this machine and count it, instead of predicting "
                   "on fake tensors (for scripts that need data, e.g. .item() in the loss).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def step(script: Path, overrides: tuple[str, ...], hardware_name: str, gpus: int,
         dtype: str | None, autocast: str, donate: bool, seed: int, measure: bool,
         as_json: bool) -> None:
    """Predict one training step of SCRIPT: peak memory (and when it happens), FLOPs, and the
    time per step on --hardware, on fake tensors (no data, no memory), without running it."""
    import torch

    spec = acc.hardware(hardware_name)
    if dtype is not None:
        spec.peak(dtype)
    cast = None  # a factory of autocast contexts on the CPU, where fake tensors live
    if autocast != "none":
        cast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[autocast]
        cast = functools.partial(torch.autocast, "cpu", dtype=cast_dtype)
    result = (_measured_step(script, overrides, spec, dtype, donate, seed, cast) if measure
              else _predicted_step(script, overrides, spec, dtype, donate, seed, gpus, cast))
    result |= {"script": str(script), "gpus": gpus, "donate": donate, "autocast": autocast,
               "memory_bytes": spec.memory_bytes}
    emit(result, _step_lines(result, spec), as_json)


def _load(script: Path, overrides: tuple[str, ...]) -> Any:
    from minitrain.train import load_experiment
    from minitrain.train.experiment import parse_overrides
    from minitrain.train.step import with_fixed_key

    return with_fixed_key(load_experiment(script, parse_overrides(overrides))[0])


def _reason(exc: BaseException) -> str:
    from minitrain.train.script_errors import one_line

    return exc.reason if isinstance(exc, acc.PredictionError) else one_line(exc)


def _shard(batch: Any, gpus: int) -> Any:
    """Each device's share of the batch: 1/gpus of the leading dim, as a shape spec."""
    import torch

    from minitrain.tree import map as tree_map

    def share(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % gpus:
            raise UserError(
                f"the batch's leading dim {t.shape[0]} does not split over {gpus} GPUs; "
                "choose --gpus that divides it"
            )
        return acc.TensorSpec((t.shape[0] // gpus, *t.shape[1:]), t.dtype)

    return tree_map(share, batch)


def _predicted_step(script: Path, overrides: tuple[str, ...], spec: Any, dtype: str | None,
                    donate: bool, seed: int, gpus: int, cast: Any) -> dict[str, Any]:
    import torch

    from minitrain.train.setup import check_params

    mode = acc.fake_mode()
    built = []
    experiment = _fake_or_real(mode, lambda: _load(script, overrides), built)
    try:
        generator = torch.Generator().manual_seed(seed)
        params = _fake_only(mode, lambda: experiment.init(generator), "init", script)
        check_params(params)
        init_state = getattr(experiment, "init_state", None)
        model_state = (None if init_state is None
                       else _fake_only(mode, lambda: init_state(generator), "init_state", script))
        batch = _fake_or_real(mode, lambda: experiment.next_batch(generator), built)
        if gpus > 1:
            batch = _shard(batch, gpus)
        prediction = acc.predict_step(
            experiment.loss, params, batch, optimizer=experiment.optimizer, donate=donate,
            has_aux=experiment.has_aux, max_grad_norm=experiment.max_grad_norm,
            hardware=spec, dtype=dtype, autocast=cast, model_state=model_state,
        )
    except (UserError, ExperimentError):
        raise
    except Exception as exc:  # the script's code failed on fake tensors: one line
        raise UserError(f"{script}: cannot predict the step on fake tensors: {_reason(exc)}; "
                        "run one real step instead with --measure") from None
    from minitrain.tree import size

    return {"measured": False, "params": size(params),
            "built_on": "real tensors" if built else "fake tensors"} | prediction.summary()


def _fake_only(mode: Any, build: Any, what: str, script: Path) -> Any:
    """``build()`` on fake tensors: the model is never built for real by surprise (it may be
    the size the prediction is asked about)."""
    try:
        with mode:
            return build()
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"{script}: {what} cannot run on fake tensors ({_reason(exc)}), and building the "
            "model for real could take the memory being predicted; run one real step with "
            "--measure"
        ) from None


def _fake_or_real(mode: Any, build: Any, built: list[str]) -> Any:
    """``build()`` on fake tensors; for the scripts whose own code needs data (a data pipeline
    calling ``.numpy()``), on real ones, noting it in ``built``."""
    try:
        with mode:
            return build()
    except Exception:
        built.append("real")
        return build()


def _measured_step(script: Path, overrides: tuple[str, ...], spec: Any, dtype: str | None,
                   donate: bool, seed: int, cast: Any) -> dict[str, Any]:
    from minitrain.precision import get_backend
    from minitrain.train.step import first_step_inputs, make_train_step
    from minitrain.tree import size

    experiment = _load(script, overrides)
    backend = get_backend("auto")
    params, state, batch, carry = first_step_inputs(experiment, backend, seed)
    train_step = make_train_step(experiment, backend, donate=donate)
    counter = acc.Counter()
    try:
        with counter, cast() if cast else contextlib.nullcontext():
            counter.track(params, state, batch, carry)
            out = train_step(params, state, batch, carry=carry)
            del out
    except Exception as exc:
        raise UserError(f"{script}: the step failed: {type(exc).__name__}: {exc}") from None
    seconds, name, mfu = acc.roofline.step_time(counter, spec, dtype)
    peak = counter.peak_bytes
    return {
        "measured": True, "params": size(params), "peak_bytes": peak,
        "peak_source": "live storages (minitrain.accounting.Counter)",
        "flops": counter.flops, "matmul_flops": counter.matmul_flops,
        "bytes": counter.bytes_read + counter.bytes_written,
        "unknown_ops": dict(counter.unknown), "hardware": spec.name, "dtype": name,
        "seconds_per_step": seconds, "mfu_bound": mfu, "fits": peak <= spec.memory_bytes,
    }


def _step_lines(result: dict[str, Any], spec: Any) -> list[str]:
    how = "measured (one real step)" if result["measured"] else "predicted (fake tensors)"
    if result.get("built_on") == "real tensors":
        how += "; the script's setup needed data and ran on real tensors"
    lines = [
        f"{result['script']}: {result['params']:,} params, {how}"
        + (f", per device of {result['gpus']}" if result["gpus"] > 1 else ""),
        f"peak memory       {si(result['peak_bytes'], 'B')}"
        + (f" in the {result['peak_phase']} pass, at {result['peak_op']} "
           f"({result['peak_module']})" if not result["measured"] else ""),
    ]
    if not result["measured"]:
        at_peak = result["memory"]["at_peak"]
        lines.append("  at the peak      " + ", ".join(
            f"{name} {si(value, 'B')}" for name, value in at_peak.items()))
        lines.append(f"  saved for backward {si(result['memory']['saved_for_backward'], 'B')}; "
                     "largest:")
        for saved in result["saved"][:3]:
            lines.append(f"    {si(saved['bytes'], 'B'):>9} {tuple(saved['shape'])} "
                         f"{saved['dtype']} by {saved['op']} in {saved['module']}")
    lines += [
        f"FLOPs per step    {result['flops']:.4g} (matmul {result['matmul_flops']:.4g}), "
        f"{si(result['bytes'], 'B')} moved",
        f"time on {spec.name:<9} {result['seconds_per_step'] * 1e3:.4g} ms per step "
        f"(roofline of every op, {result['dtype']} peak), MFU at most "
        f"{result['mfu_bound']:.0%}",
        f"fits on {spec.name:<9} {'yes' if result['fits'] else 'no'} "
        f"({si(result['peak_bytes'], 'B')} of {si(spec.memory_bytes, 'B')})",
    ]
    if result["unknown_ops"]:
        lines.append("ops without FLOP formula: " + ", ".join(sorted(result["unknown_ops"])))
    return lines
