"""``minitrain estimate ...``: napkin math from the shell (chapter 3.1), no torch needed."""

from __future__ import annotations

from typing import Any

import click

from minitrain import accounting as acc  # the napkin math: no torch
from minitrain.accounting.memory import optimizer_key
from minitrain.accounting.units import si
from minitrain.cli.errors import Group, UserError
from minitrain.cli.estimate_step import step
from minitrain.cli.options import Real, Whole, emit

QUANTITY = Real(min=0, min_open=True)  # 70e9, 70B, 15T, 1.5k
_PRECISION_HELP = ("A backend's precision (fp32, bf16: autocast, fp16, fp8, mxfp8, mxfp4, nvfp4; "
                   "cpu-bf16 runs bf16), or bf16-mixed (fp32 master weights), bf16-pure.")


def _optimizer_options(command: Any) -> Any:
    """``--optimizer`` and the flags that add one state tensor (``--amsgrad``, ``--momentum``,
    ``--centered``), as ``estimate memory`` and ``estimate transformer`` take them."""
    options = [
        click.option("--optimizer", default="adamw",
                     help="sgd, momentum, adagrad, rmsprop, adam, adamw, adadelta, adamax, nadam, "
                          "radam, adafactor, lion, muon, schedule_free_adamw."),
        click.option("--amsgrad", is_flag=True,
                     help="Adam(W) with amsgrad: one more state tensor."),
        click.option("--momentum", is_flag=True,
                     help="SGD or RMSprop with momentum: one more state tensor (the buffer)."),
        click.option("--centered", is_flag=True, help="Centered RMSprop: one more state tensor."),
    ]
    for option in reversed(options):  # listed in --help in this order
        command = option(command)
    return command


def _optimizer_choice(optimizer: str, amsgrad: bool, momentum: bool,
                      centered: bool) -> tuple[str, dict[str, bool], str]:
    """The optimizer's key, its state options and a label for them (``adam+amsgrad``); an
    option the optimizer does not take is refused where the bytes are counted."""
    key = optimizer_key(optimizer)
    options = {"amsgrad": amsgrad, "momentum": momentum, "centered": centered}
    return key, options, "+".join([key, *(name for name, on in options.items() if on)])


@click.group(cls=Group)
def estimate() -> None:
    """Napkin math: time to train, memory and max params, transformer presets; one training
    step of a script predicted before it runs."""


@estimate.command("time")
@click.option("--params", type=QUANTITY, required=True, help="Parameters N (70e9 or 70B).")
@click.option("--tokens", type=QUANTITY, required=True, help="Training tokens D (15e12 or 15T).")
@click.option("--hardware", "hardware_name", default="h100", help="See `minitrain hardware`.")
@click.option("--gpus", type=Whole(min=1), default=1, help="Number of devices.")
@click.option("--mfu", type=Real(0, 1, min_open=True), default=0.5,
              help="Model FLOPs utilization (0.3-0.6 is realistic).")
@click.option("--dtype", default="bf16", help="Dtype of the dense peak (bf16, fp32, fp8...).")
@click.option("--interconnect-bandwidth", type=QUANTITY, default=None,
              help="Bytes/s per GPU for the gradient all-reduce (NCCL bus bandwidth, e.g. 50G); "
                   "adds the data-parallel communication time.")
@click.option("--batch-tokens", type=QUANTITY, default=4e6,
              help="Global batch in tokens (steps = D / this); 4M as in Llama 2.")
@click.option("--grad-bytes", type=QUANTITY, default=2,
              help="Bytes per gradient element all-reduced (2: bf16, 4: fp32).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def time_(params: float, tokens: float, hardware_name: str, gpus: int, mfu: float, dtype: str,
          interconnect_bandwidth: float | None, batch_tokens: float, grad_bytes: float,
          as_json: bool) -> None:
    """Time to train N params on D tokens: 6·N·D over peak × MFU × GPUs (chapter 3.1.1).

    With --interconnect-bandwidth, also the time to all-reduce the gradients every step
    (ring all-reduce: 2·(N-1)/N × gradient bytes per GPU), beside the compute time.
    """
    spec = acc.hardware(hardware_name)
    peak = spec.peak(dtype)
    flops = acc.training_flops(params, tokens)
    throughput = acc.effective_throughput(spec, gpus=gpus, mfu=mfu, dtype=dtype)
    seconds = flops / throughput
    rounded = acc.round_significant(throughput, 1)
    result = {
        "params": params, "tokens": tokens, "flops": flops, "hardware": spec.name,
        "dtype": acc.dtype_name(dtype), "peak_flops_per_gpu": peak, "gpus": gpus, "mfu": mfu,
        "effective_flops_per_second": throughput, "seconds": seconds,
        "days": seconds / acc.SECONDS_PER_DAY, "rounded_flops_per_second": rounded,
        "days_at_rounded_throughput": flops / rounded / acc.SECONDS_PER_DAY,
    }
    lines = [
        f"1. total work   6 × N × D = 6 × {params:.3g} × {tokens:.3g} = {flops:.3g} FLOPs",
        f"2. throughput   {spec.description}: dense {result['dtype']} peak "
        f"{si(peak, 'FLOP/s')} × MFU {mfu:g} × {gpus} GPUs = {throughput:.3g} FLOP/s",
        f"3. time         {flops:.3g} / {throughput:.3g} = {seconds:.3g} s "
        f"= {result['days']:.1f} days",
        f"   (rounding the throughput to {rounded:.0e} FLOP/s, as napkin math does: "
        f"{result['days_at_rounded_throughput']:.1f} days)",
    ]
    if interconnect_bandwidth is not None:
        comm = result["communication"] = _communication(
            params, tokens, batch_tokens, gpus, interconnect_bandwidth, grad_bytes, seconds)
        lines += [
            f"4. all-reduce   2·(N-1)/N × {si(comm['gradient_bytes'], 'B')} of gradients = "
            f"{si(comm['allreduce_bytes_per_gpu_per_step'], 'B')} per GPU per step, at "
            f"{si(interconnect_bandwidth, 'B/s')} = "
            f"{comm['allreduce_seconds_per_step']:.3g} s per step",
            f"   × {comm['steps']:.3g} steps of {batch_tokens:.3g} tokens = "
            f"{comm['days']:.1f} days of communication beside {result['days']:.1f} days of "
            "compute",
            f"   total {comm['days_no_overlap']:.1f} days without overlap, "
            f"{comm['days_full_overlap']:.1f} days if fully overlapped",
        ]
    emit(result, lines, as_json)


def _communication(params: float, tokens: float, batch_tokens: float, gpus: int,
                   bandwidth: float, grad_bytes: float, compute_seconds: float) -> dict[str, Any]:
    gradient_bytes = params * grad_bytes
    per_step = acc.allreduce_bytes(gradient_bytes, gpus)
    seconds = acc.communication_time(params, tokens, batch_tokens, gpus, bandwidth, grad_bytes)
    return {
        "interconnect_bandwidth": bandwidth, "batch_tokens": batch_tokens,
        "steps": tokens / batch_tokens, "gradient_bytes": gradient_bytes,
        "allreduce_bytes_per_gpu_per_step": per_step,
        "allreduce_seconds_per_step": per_step / bandwidth, "seconds": seconds,
        "days": seconds / acc.SECONDS_PER_DAY, "compute_seconds": compute_seconds,
        "days_no_overlap": (compute_seconds + seconds) / acc.SECONDS_PER_DAY,
        "days_full_overlap": max(compute_seconds, seconds) / acc.SECONDS_PER_DAY,
    }


@estimate.command("memory")
@click.option("--hardware", "hardware_name", default="h100", help="See `minitrain hardware`.")
@click.option("--gpus", type=Whole(min=1), default=8, help="Devices per node.")
@click.option("--nodes", type=Whole(min=1), default=1, help="Nodes.")
@_optimizer_options
@click.option("--precision", default="fp32", help=_PRECISION_HELP)
@click.option("--zero", "zero_stage", type=Whole(0, 3), default=3,
              help="ZeRO stage: 0 replicates, 3 shards params, grads and state (the chapter's "
                   "assumption).")
@click.option("--params", type=QUANTITY, default=None,
              help="A model's parameters (7e9 or 7B): add its model states per GPU and per node's "
                   "CPU as DeepSpeed's ZeRO estimators count them.")
@click.option("--largest-layer", type=QUANTITY, default=None,
              help="With --params and --zero 3: parameters of the largest layer, which stage 3 "
                   "gathers on every GPU.")
@click.option("--offload", type=click.Choice(["optimizer", "params"]), multiple=True,
              help="With --params: ZeRO-Offload of the optimizer state (stages 1-3) or of the "
                   "params (stage 3) to the CPU; repeatable.")
@click.option("--zero-init/--no-zero-init", default=True,
              help="With --params and --zero 3: build the model partitioned (deepspeed.zero.Init), "
                   "so each node's CPU loads one layer at a time.")
@click.option("--buffer-factor", type=QUANTITY, default=1.5,
              help="With --params: padding of the CPU figure, as DeepSpeed's estimators apply it.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def memory(hardware_name: str, gpus: int, nodes: int, optimizer: str, amsgrad: bool,
           momentum: bool, centered: bool, precision: str, zero_stage: int, params: float | None,
           largest_layer: float | None, offload: tuple[str, ...], zero_init: bool,
           buffer_factor: float, as_json: bool) -> None:
    """Bytes per parameter and the largest model that fits (chapter 3.1.2); with --params, the
    model states of one model under ZeRO as DeepSpeed estimates them."""
    spec = acc.hardware(hardware_name)
    key, options, label = _optimizer_choice(optimizer, amsgrad, momentum, centered)
    zero = None if params is None else _zero_states(
        params, largest_layer, zero_stage, gpus, nodes, offload, zero_init, buffer_factor, key,
        precision, options)
    gpus *= nodes
    chosen = acc.bytes_per_param(key, precision, **options)
    table = {
        name: row._asdict() | {"total": row.total}
        for name in acc.OPTIMIZER_STATES
        for row in [chosen if name == key else acc.bytes_per_param(name, precision)]
    }
    by_stage = {
        stage: acc.max_params(spec, optimizer=key, precision=precision, gpus=gpus,
                              zero_stage=stage, **options)
        for stage in range(4)
    }
    result = {
        "hardware": spec.name, "gpus": gpus, "memory_bytes_per_gpu": spec.memory_bytes,
        "total_memory_bytes": spec.memory_bytes * gpus, "optimizer": key,
        "state_options": options, "precision": precision, "zero_stage": zero_stage,
        "bytes_per_param": chosen._asdict() | {"total": chosen.total}, "table": table,
        "max_params": by_stage[zero_stage],
        "max_params_by_zero_stage": {str(stage): n for stage, n in by_stage.items()},
    }
    width = max(map(len, table)) + 2
    header = f"{'optimizer':<{width}}{'params':>8}{'grads':>8}{'state':>8}{'master':>8}{'total':>8}"
    lines = [f"bytes per parameter, precision {precision}:", header]
    for name, row in table.items():
        mark = f" < {label}" if name == key and label != key else " <" if name == key else ""
        lines.append(
            f"{name:<{width}}{row['params']:>8}{row['grads']:>8}{row['optimizer_state']:>8}"
            f"{row['master_weights']:>8}{row['total']:>8}{mark}"
        )
    lines += [
        "",
        f"{gpus} × {spec.description}: {si(spec.memory_bytes * gpus, 'B')} in all",
        f"largest model ({label}, ZeRO stage {zero_stage}): "
        f"{si(by_stage[zero_stage])} params (activations not included)",
        "by ZeRO stage: " + ", ".join(f"{s}: {si(n)}" for s, n in by_stage.items()),
    ]
    if zero is not None:
        result["zero"] = zero
        lines += _zero_lines(zero, spec)
    emit(result, lines, as_json)


def _zero_states(params: float, largest_layer: float | None, zero_stage: int, gpus: int,
                 nodes: int, offload: tuple[str, ...], zero_init: bool, buffer_factor: float,
                 optimizer: str, precision: str, options: dict[str, bool]) -> dict[str, Any]:
    """``accounting.zero_memory`` of the command's options, as a JSON record."""
    if zero_stage == 0:
        raise UserError("--params counts a ZeRO optimizer's model states: pass --zero 1, 2 or 3")
    if zero_stage == 3 and largest_layer is None:
        raise UserError("--zero 3 gathers the largest layer on every GPU: pass --largest-layer N "
                        "(the parameters of the biggest module, e.g. 5e8)")
    if largest_layer is not None and largest_layer > params:
        raise UserError(f"--largest-layer {largest_layer:g} is more than --params {params:g}")
    if "params" in offload and zero_stage != 3:
        raise UserError("--offload params needs --zero 3 (only stage 3 partitions the params)")
    states = acc.zero_memory(
        params, largest_layer=largest_layer, zero_stage=zero_stage, gpus_per_node=gpus,
        nodes=nodes, offload_optimizer="optimizer" in offload, offload_params="params" in offload,
        zero_init=zero_init, buffer_factor=buffer_factor, optimizer=optimizer,
        precision=precision, **{name: on for name, on in options.items() if on})
    return {"params": params, "largest_layer": largest_layer, "offload": sorted(offload),
            "zero_init": zero_init, "buffer_factor": buffer_factor, **states._asdict()}


def _zero_lines(zero: dict[str, Any], spec: Any) -> list[str]:
    gathered = f", {si(zero['gathered'], 'B')} of it the gathered layer" if zero["gathered"] else ""
    fits = "fits" if zero["gpu"] <= spec.memory_bytes else "does not fit"
    return [
        "",
        f"model states of {si(zero['params'])} params (DeepSpeed's ZeRO estimators, activations "
        "not included):",
        f"  per GPU        {si(zero['gpu'], 'B')}{gathered}: {fits} in "
        f"{si(spec.memory_bytes, 'B')}",
        f"  per node CPU   {si(zero['cpu'], 'B')} (× {zero['buffer_factor']:g} buffer)",
    ]


@estimate.command("transformer")
@click.option("--preset", "preset_name", required=True,
              help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt3-175b, llama3-8b/70b/405b.")
@click.option("--batch", type=Whole(min=1), default=1, help="Sequences per device.")
@click.option("--seq-len", type=Whole(min=1), default=None,
              help="Context length (default: the preset's).")
@click.option("--tokens", type=QUANTITY, default=None, help="Training tokens, for the time.")
@_optimizer_options
@click.option("--precision", default="bf16-mixed", help=_PRECISION_HELP)
@click.option("--gpus", type=Whole(min=1), default=1, help="Number of devices.")
@click.option("--zero", "zero_stage", type=Whole(0, 3), default=0, help="ZeRO stage.")
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]), default="none",
              help="Activation recomputation (Korthikanti et al. 2022).")
@click.option("--attention", type=click.Choice(["eager", "flash"]), default="eager",
              help="eager: the a·s² scores saved; flash: a fused kernel saves none.")
@click.option("--hardware", "hardware_name", default="h100", help="See `minitrain hardware`.")
@click.option("--mfu", type=Real(0, 1, min_open=True), default=0.5, help="For time.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def transformer(preset_name: str, batch: int, seq_len: int | None, tokens: float | None,
                optimizer: str, amsgrad: bool, momentum: bool, centered: bool, precision: str,
                gpus: int, zero_stage: int, recompute: str, attention: str, hardware_name: str,
                mfu: float, as_json: bool) -> None:
    """Params, FLOPs per token and per step, and memory per device of a transformer preset."""
    config = acc.preset(preset_name)
    spec = acc.hardware(hardware_name)
    key, options, label = _optimizer_choice(optimizer, amsgrad, momentum, centered)
    if key == "muon":
        label = "muon for the layers' matrices, adamw for the rest"
    context = seq_len or config.seq_len
    n_params = acc.transformer_params(config)
    per_token = acc.transformer_flops_per_token(config, seq_len=context)
    mem = acc.transformer_memory(
        config, batch=batch, seq_len=context, optimizer=key, precision_name=precision,
        gpus=gpus, zero_stage=zero_stage, recompute=recompute, attention=attention, **options,
    )
    result: dict[str, Any] = {
        "preset": config.name, "source": config.source, "params": n_params,
        "matmul_params": acc.transformer_matmul_params(config), "seq_len": context,
        "flops_per_token_6n": 6.0 * n_params, "flops_per_token": per_token,
        "flops_per_step": per_token * batch * context * gpus, "optimizer": key,
        "state_options": options, "memory_per_gpu": mem._asdict() | {"total": mem.total},
        "activations_per_layer": mem.activations / config.num_layers, "recompute": recompute,
        "attention": attention, "fits": mem.total <= spec.memory_bytes, "hardware": spec.name,
    }
    lines = [
        f"{config.name}: {config.num_layers} layers, d={config.hidden}, {config.heads} heads, "
        f"vocab {config.vocab}, context {context}  [{config.source}]",
        f"params              {n_params:,} ({si(n_params)})",
        f"FLOPs per token     6·N = {6.0 * n_params:.3g}; with attention "
        f"(6·N_matmul + 12·L·d·T) = {per_token:.3g}",
        f"FLOPs per step      {result['flops_per_step']:.3g} "
        f"({batch} × {context} tokens × {gpus} GPUs)",
        f"memory per GPU      {si(mem.total, 'B')}: params {si(mem.params, 'B')}, grads "
        f"{si(mem.grads, 'B')}, optimizer state ({label}) {si(mem.optimizer_state, 'B')}, "
        + (f"master weights {si(mem.master_weights, 'B')}, " if mem.master_weights else "")
        + f"activations {si(mem.activations, 'B')} (recompute {recompute}, {attention} "
        f"attention; {si(mem.activations / config.num_layers, 'B')} per layer)",
        f"fits on {spec.name}      {'yes' if result['fits'] else 'no'} "
        f"({si(spec.memory_bytes, 'B')})",
    ]
    if tokens is not None:
        total = per_token * tokens
        seconds = acc.training_time(total, hardware=spec, gpus=gpus, mfu=mfu)
        result |= {"tokens": tokens, "training_flops": total, "seconds": seconds,
                   "days": seconds / acc.SECONDS_PER_DAY}
        lines.append(
            f"training            {total:.3g} FLOPs on {tokens:.3g} tokens: "
            f"{result['days']:.1f} days on {gpus} × {spec.name} at MFU {mfu:g}"
        )
    emit(result, lines, as_json)


estimate.add_command(step)
