"""Predicted vs measured resources of one training step: memory, FLOPs, MFU, time to finish.

:func:`resource_report` runs the pure train step once under a :class:`Counter` (the outputs are
thrown away; the global RNG state is restored) and sets what it counted beside what the
formulas predict:

- **memory**: params, grads, optimizer state and activations, predicted; the peak predicted by
  :func:`predicted_peak_bytes` and measured (CUDA: ``torch.cuda.max_memory_allocated`` around
  one step; CPU: the counter's live storages);
- **FLOPs per step**: the ``6·B·P`` rule, the exact model formula (when given) and as counted
  (all ops with a formula, and the matmul subset that ``FlopCounterMode`` counts);
- **speed**: achieved FLOP/s and MFU against the device's dense peak, and the projected time to
  finish.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from minitrain.accounting.counter import Counter
from minitrain.accounting.memory import optimizer_states
from minitrain.tree import leaves, nbytes, size

__all__ = ["format_report", "predicted_peak_bytes", "resource_report"]


def predicted_peak_bytes(
    *,
    params: int,
    optimizer_state: int,
    batch: int,
    activations: int,
    grads: int | None = None,
    donate: bool = False,
) -> dict[str, int]:
    """Peak bytes of one pure training step, and the two moments that compete for it.

    Resident throughout: params, optimizer state and the batch. At the end of the backward pass
    the grads exist and, as an upper bound, all saved activations (the chapter's
    ``4·(params + activations + grads + optimizer states)``, 3.5.6). During a pure update the
    grads, the old params and state and the new params and state all exist at once, unless the
    update donates its inputs (writes in place).

    >>> predicted_peak_bytes(params=100, optimizer_state=200, batch=10, activations=30)
    {'backward': 440, 'update': 710, 'peak': 710}
    """
    grads = params if grads is None else grads
    resident = params + optimizer_state + batch
    backward = resident + activations + grads
    update = resident + grads + (0 if donate else params + optimizer_state)
    return {"backward": backward, "update": update, "peak": max(backward, update)}


def _storage_keys(tree: Any) -> set[int]:
    return {
        leaf.untyped_storage().data_ptr()
        for leaf in leaves(tree)
        if isinstance(leaf, torch.Tensor) and leaf.numel()
    }


def _first_dim(batch: Any) -> int:
    tensors = [leaf for leaf in leaves(batch) if isinstance(leaf, torch.Tensor)]
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1


def _cuda_device(tree: Any) -> torch.device | None:
    for leaf in leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device
    return None


@contextlib.contextmanager
def _rng_kept(device: torch.device | None) -> Iterator[None]:
    devices = [] if device is None else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type if device else "cuda"):
        yield


def _count_step(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any) -> Counter:
    counter = Counter(keep_records=False)
    with counter:
        counter.track(params, opt_state, batch)
        out = step(params, opt_state, batch)
        del out
    return counter


def _cuda_peak(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any,
               device: torch.device) -> int:
    """``max_memory_allocated`` over one step, less what was allocated before and is not the
    step's own inputs."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    other = before - nbytes(params) - nbytes(opt_state) - nbytes(batch)
    torch.cuda.reset_peak_memory_stats(device)
    out = step(params, opt_state, batch)
    torch.cuda.synchronize(device)
    del out
    return torch.cuda.max_memory_allocated(device) - max(other, 0)


def _ratio(measured: int | float | None, predicted: int | float | None) -> int | float | None:
    return measured / predicted if measured is not None and predicted else None


def resource_report(
    step: Callable[[Any, Any, Any], Any],
    params: Any,
    opt_state: Any,
    batch: Any,
    *,
    optimizer: str | None = None,
    examples_per_step: int | None = None,
    exact_flops_per_step: int | None = None,
    activation_bytes: int | None = None,
    donate: bool = False,
    peak_flops: int | float | None = None,
    step_seconds: int | float | None = None,
    steps_total: int | None = None,
    steps_done: int = 0,
) -> dict[str, Any]:
    """Predicted vs measured memory, FLOPs and speed of ``step(params, opt_state, batch)``.

    Args:
        step: the pure train step (uncompiled); it runs once more here, outputs discarded.
        optimizer: name for the predicted optimizer state (``"sgd"``, ``"adamw"``...); without
            it the state's actual size is used.
        examples_per_step: ``B`` of the ``6·B·P`` rule (tokens per batch for a language model);
            default: the batch's leading dimension.
        exact_flops_per_step: the model's exact FLOP formula for one step, if known.
        activation_bytes: the model's activation formula in bytes; without it, the bytes of
            every forward matmul operand that is neither a param nor batch data.
        donate: whether the update writes params and state in place.
        peak_flops: the device's dense peak FLOP/s (the backend's ``peak_flops()``) for MFU.
        step_seconds, steps_total, steps_done: measured time per step and progress, for
            achieved FLOP/s and the projected time to finish.

    Returns a JSON-serializable dict: ``params``, ``examples_per_step``, ``memory``
    (``predicted``, ``measured``, ``peak_ratio``), ``flops_per_step`` (``rule_6bp``, ``exact``,
    ``counted``, ``counted_matmul``, ``unknown_ops``) and ``speed``.

    >>> import torch, minitrain as mt
    >>> params = {"w": torch.zeros(8, 4)}
    >>> opt = mt.optim.sgd(lr=0.1)
    >>> grad = mt.value_and_grad(lambda p, x: (x @ p["w"]).square().mean())
    >>> def step(params, state, x):
    ...     loss, grads = grad(params, x)
    ...     return opt.update(grads, state, params)
    >>> r = resource_report(step, params, opt.init(params), torch.ones(16, 8), optimizer="sgd")
    >>> r["params"], r["flops_per_step"]["rule_6bp"], r["flops_per_step"]["counted_matmul"]
    (32, 3072, 2048)
    """
    device = _cuda_device((params, batch))
    with _rng_kept(device):
        counter = _count_step(step, params, opt_state, batch)
        measured_peak = (
            _cuda_peak(step, params, opt_state, batch, device)
            if device is not None
            else counter.peak_bytes
        )
    n_params = size(params)
    examples = examples_per_step if examples_per_step is not None else _first_dim(batch)
    params_bytes, state_bytes, batch_bytes = nbytes(params), nbytes(opt_state), nbytes(batch)
    if activation_bytes is None:
        known = _storage_keys((params, opt_state, batch))
        activation_bytes = sum(
            b for key, b in counter.forward_matmul_inputs.items() if key not in known
        )
        activation_source = "forward matmul operands other than params and batch"
    else:
        activation_source = "model formula"
    predicted_state = (
        optimizer_states(optimizer) * params_bytes if optimizer is not None else state_bytes
    )
    peaks = predicted_peak_bytes(
        params=params_bytes, optimizer_state=predicted_state, batch=batch_bytes,
        activations=activation_bytes, donate=donate,
    )
    resident = params_bytes + state_bytes + batch_bytes
    measured_activations = (
        counter.backward_start_live_bytes - resident
        if counter.backward_start_live_bytes is not None
        else None
    )
    rule = 6 * examples * n_params
    model_flops, model_source = (
        (exact_flops_per_step, "exact formula")
        if exact_flops_per_step is not None
        else (counter.matmul_flops, "counted matmuls")
    )
    achieved = model_flops / step_seconds if step_seconds else None
    remaining = (steps_total - steps_done) if steps_total is not None else None
    return {
        "params": n_params,
        "examples_per_step": examples,
        "memory": {
            "predicted": {
                "params": params_bytes,
                "grads": params_bytes,
                "optimizer_state": predicted_state,
                "activations": activation_bytes,
                "activations_source": activation_source,
                "batch": batch_bytes,
                "backward_peak": peaks["backward"],
                "update_peak": peaks["update"],
                "peak": peaks["peak"],
            },
            "measured": {
                "peak": measured_peak,
                "activations": measured_activations,
                "optimizer_state": state_bytes,
                "source": (
                    "torch.cuda.max_memory_allocated"
                    if device is not None
                    else "live storages (minitrain.accounting.Counter)"
                ),
            },
            "peak_ratio": _ratio(measured_peak, peaks["peak"]),
        },
        "flops_per_step": {
            "rule_6bp": rule,
            "exact": exact_flops_per_step,
            "counted": counter.flops,
            "counted_matmul": counter.matmul_flops,
            "unknown_ops": dict(counter.unknown),
        },
        "speed": {
            "step_seconds": step_seconds,
            "model_flops_per_step": model_flops,
            "model_flops_source": model_source,
            "achieved_flops_per_second": achieved,
            "peak_flops_per_second": peak_flops,
            "mfu": _ratio(achieved, peak_flops),
            "steps_total": steps_total,
            "steps_done": steps_done,
            "seconds_to_finish": (
                remaining * step_seconds if remaining is not None and step_seconds else None
            ),
        },
    }


def _si(value: int | float | None, unit: str) -> str:
    if value is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned text lines for a run summary.

    >>> print(format_report({"params": 10, "examples_per_step": 2,
    ...     "memory": {"predicted": {"peak": 100}, "measured": {"peak": 90}, "peak_ratio": 0.9},
    ...     "flops_per_step": {"rule_6bp": 120, "exact": None, "counted": 130,
    ...                        "counted_matmul": 100, "unknown_ops": {}},
    ...     "speed": {"achieved_flops_per_second": None, "mfu": None,
    ...               "seconds_to_finish": None}}))
    params                 10
    peak memory            predicted 100 B, measured 90 B (x0.90)
    FLOPs per step         6·B·P 120 FLOP, exact -, counted 130 FLOP (matmul 100 FLOP)
    achieved               - (MFU -)
    time to finish         -
    """
    memory, flops, speed = report["memory"], report["flops_per_step"], report["speed"]
    ratio = memory["peak_ratio"]
    mfu = speed["mfu"]
    lines = [
        ("params", f"{report['params']:,}"),
        (
            "peak memory",
            f"predicted {_si(memory['predicted']['peak'], 'B')}, "
            f"measured {_si(memory['measured']['peak'], 'B')}"
            + (f" (x{ratio:.2f})" if ratio is not None else ""),
        ),
        (
            "FLOPs per step",
            f"6·B·P {_si(flops['rule_6bp'], 'FLOP')}, exact {_si(flops['exact'], 'FLOP')}, "
            f"counted {_si(flops['counted'], 'FLOP')} "
            f"(matmul {_si(flops['counted_matmul'], 'FLOP')})",
        ),
        (
            "achieved",
            f"{_si(speed['achieved_flops_per_second'], 'FLOP/s')} "
            f"(MFU {'-' if mfu is None else f'{mfu:.1%}'})",
        ),
        ("time to finish", _si(speed["seconds_to_finish"], "s")),
    ]
    if flops["unknown_ops"]:
        lines.append(("ops without formula", ", ".join(sorted(flops["unknown_ops"]))))
    if report.get("communication"):  # data parallel: the gradient all-reduce of one rank
        comm = report["communication"]
        lines.append((
            "all-reduce per step",
            f"{_si(comm['allreduce_bytes_per_rank'], 'B')} sent per rank "
            f"(2·(N-1)/N × {_si(comm['gradient_bytes'], 'B')} of grads, N = {comm['ranks']}), "
            f"{_si(comm['reduce_seconds_per_step'], 's')} measured ({comm['process_group']})",
        ))
    return "\n".join(f"{name:<23}{value}" for name, value in lines)
