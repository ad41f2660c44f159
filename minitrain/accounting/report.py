"""Predicted vs measured resources of one training step: memory, FLOPs, MFU, time to finish.

:func:`resource_report` predicts the step with :func:`~minitrain.accounting.predict_step` on
fake tensors (never from the measured step's tensors), then runs the pure train step once
under a :class:`Counter` (the outputs are thrown away; the global RNG state is restored) and
sets what it measured beside the prediction:

- **memory**: params, grads, optimizer state, batch and activations saved for backward,
  predicted, and the peak with its moment; measured: the peak (CUDA:
  ``torch.cuda.max_memory_allocated`` around one step; CPU: the counter's live storages), the
  resident categories and, on CPU, what was alive when the backward pass began; and where the
  memory goes: the largest tensors saved for backward and the module that saved each;
- **FLOPs per step**: the ``6·B·P`` rule, the exact model formula (when given), predicted and
  as counted (all ops with a formula, and the matmul subset that ``FlopCounterMode`` counts);
- **speed**: achieved FLOP/s and MFU against the device's dense peak, and the projected time to
  finish.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from minitrain.accounting.counter import Counter
from minitrain.accounting.predict import PredictionError, predict_call, predict_step
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


def _buffer_pool_bytes() -> int:
    """Bytes mt.optim's recycling pools hold now (:func:`minitrain.optim.buffer_pool_bytes`)."""
    from minitrain.optim import buffer_pool_bytes

    return buffer_pool_bytes()


def _ratio(measured: int | float | None, predicted: int | float | None) -> int | float | None:
    return measured / predicted if measured is not None and predicted else None


def resource_report(
    step: Callable[[Any, Any, Any], Any],
    params: Any,
    opt_state: Any,
    batch: Any,
    *,
    optimizer: Any = None,
    examples_per_step: int | None = None,
    exact_flops_per_step: int | None = None,
    activation_bytes: int | None = None,
    donate: bool = False,
    peak_flops: int | float | None = None,
    step_seconds: int | float | None = None,
    steps_total: int | None = None,
    steps_done: int = 0,
    loss_fn: Callable[..., Any] | None = None,
    has_aux: bool = False,
    max_grad_norm: float | None = None,
    autocast: Callable[[], Any] | None = None,
    hardware: str | None = None,
    model_state: Any = None,
) -> dict[str, Any]:
    """Predicted vs measured memory, FLOPs and speed of ``step(params, opt_state, batch)``.

    With ``loss_fn`` (and an ``mt.optim`` optimizer as ``optimizer``) the prediction is
    :func:`~minitrain.accounting.predict_step` on fake tensors: made before and apart from the
    measured step, category by category, with the largest tensors saved for backward and the
    module that saved each. Without them (a step that is not ``loss_fn`` + optimizer, e.g. a
    vmapped ensemble) the whole ``step`` is traced on fake tensors
    (:func:`~minitrain.accounting.predict.predict_call`); if even that cannot run (the step
    needs data), the prediction is the chapter's formula (:func:`predicted_peak_bytes`), with
    activations from ``activation_bytes`` only.

    Args:
        step: the pure train step (uncompiled); it runs once more here, outputs discarded.
        optimizer: the ``mt.optim`` optimizer the step updates with, or its name (``"sgd"``,
            ``"adamw"``...) for the formula's optimizer state.
        examples_per_step: ``B`` of the ``6·B·P`` rule (tokens per batch for a language model);
            default: the batch's leading dimension.
        exact_flops_per_step: the model's exact FLOP formula for one step, if known.
        activation_bytes: the model's activation formula in bytes (formula prediction only).
        donate: whether the step's update writes params and state in place.
        peak_flops: the device's dense peak FLOP/s (the backend's ``peak_flops()``) for MFU.
        step_seconds, steps_total, steps_done: measured time per step and progress, for
            achieved FLOP/s and the projected time to finish.
        loss_fn, has_aux, max_grad_norm, autocast: the step's loss, whether it returns aux,
            its clipping and the backend's autocast, as the train step uses them.
        hardware: a device name for the predicted time per step (roofline), if wanted.
        model_state: the buffers a forward pass updates, for a ``loss_fn(params, state,
            batch) -> (value, new_state)`` (see :func:`~minitrain.accounting.predict_step`).

    Returns a JSON-serializable dict: ``params``, ``examples_per_step``, ``memory``
    (``predicted``, ``measured``, ``peak_ratio`` measured/predicted, ``where`` the largest
    saved tensors), ``flops_per_step`` (``rule_6bp``, ``exact``, ``predicted``, ``counted``,
    ``counted_matmul``, ``unknown_ops``) and ``speed``.

    >>> import torch, minitrain as mt
    >>> params = {"w": torch.zeros(8, 4)}
    >>> opt = mt.optim.sgd(lr=0.1)
    >>> loss = lambda p, x: (x @ p["w"]).square().mean()
    >>> grad = mt.value_and_grad(loss)
    >>> def step(params, state, x):
    ...     value, grads = grad(params, x)
    ...     mt.tree.global_norm(grads)
    ...     return opt.update(grads, state, params)
    >>> r = resource_report(step, params, opt.init(params), torch.ones(16, 8), optimizer=opt,
    ...                     loss_fn=loss)
    >>> r["params"], r["flops_per_step"]["rule_6bp"], r["flops_per_step"]["counted_matmul"]
    (32, 3072, 2048)
    >>> r["memory"]["predicted"]["peak"] == r["memory"]["measured"]["peak"]
    True
    """
    device = _cuda_device((params, batch))
    if loss_fn is not None and hasattr(optimizer, "update"):
        prediction = predict_step(
            loss_fn, params, batch, optimizer=optimizer, donate=donate, has_aux=has_aux,
            max_grad_norm=max_grad_norm, autocast=autocast, hardware=hardware or "h100",
            model_state=model_state,
        )
        source = "predict_step (fake tensors)"
    else:
        prediction = _predict_any(step, params, opt_state, batch, hardware or "h100")
        source = "predict_call: the whole step on fake tensors (update on its plain path)"
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
    if prediction is not None:
        predicted = _traced_memory(prediction, donate) | {"source": source}
    else:
        predicted = _formula_memory(_formula_state_bytes(optimizer, params, state_bytes),
                                    params_bytes, batch_bytes, activation_bytes, donate)
    resident = params_bytes + state_bytes + batch_bytes
    measured_activations = (
        counter.backward_start_live_bytes - resident
        if counter.backward_start_live_bytes is not None and device is None
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
    report = {
        "params": n_params,
        "examples_per_step": examples,
        "memory": {
            "predicted": predicted,
            "measured": {
                "peak": measured_peak,
                "params": params_bytes,
                "optimizer_state": state_bytes,
                "batch": batch_bytes,
                "activations": measured_activations,
                # the pure fast path's recycled buffers, held beyond what the step returned
                "optimizer_buffer_pools": _buffer_pool_bytes(),
                "source": (
                    "torch.cuda.max_memory_allocated"
                    if device is not None
                    else "live storages (minitrain.accounting.Counter)"
                ),
            },
            "peak_ratio": _ratio(measured_peak, predicted["peak"]),
            "where": (
                [saved._asdict() for saved in prediction.saved[:5]] if prediction else []
            ),
        },
        "flops_per_step": {
            "rule_6bp": rule,
            "exact": exact_flops_per_step,
            "predicted": prediction.flops if prediction else None,
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
    if prediction is not None and hardware is not None:
        report["speed"] |= {"predicted_step_seconds": prediction.seconds_per_step,
                            "predicted_on": prediction.hardware,
                            "mfu_bound": prediction.mfu_bound}
    return report


def _predict_any(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any,
                 hardware: str) -> Any:
    try:
        return predict_call(step, params, opt_state, batch, hardware=hardware)
    except PredictionError:
        return None


def _traced_memory(prediction: Any, donate: bool) -> dict[str, Any]:
    memory = prediction.memory
    persistent, largest = memory["persistent"], memory["largest"]
    # The chapter's two moments (predicted_peak_bytes) over the traced sizes, beside the
    # traced peak itself.
    chapter = predicted_peak_bytes(
        params=persistent.get("params", 0), optimizer_state=persistent.get("optimizer_state", 0),
        batch=persistent.get("batch", 0), activations=memory["saved_for_backward"],
        grads=largest.get("grads", persistent.get("params", 0)), donate=donate,
    )
    return {
        "backward_peak": chapter["backward"],
        "update_peak": chapter["update"],
        "params": persistent.get("params", 0),
        "grads": largest.get("grads"),  # None: a whole-step trace cannot tell grads apart
        "optimizer_state": persistent.get("optimizer_state", 0),
        "batch": persistent.get("batch", 0),
        "activations": memory["saved_for_backward"],
        "activations_source": "predict_step: alive from the forward into the backward pass",
        "at_peak": memory["at_peak"],
        "peak": prediction.peak_bytes,
        "peak_phase": prediction.peak_phase,
        "peak_op": prediction.peak_op,
        "peak_module": prediction.peak_module,
        "source": "predict_step (fake tensors)",
    }


def _formula_state_bytes(optimizer: Any, params: Any, state_bytes: int) -> int:
    """The state an optimizer named ``optimizer`` keeps for ``params`` (shape by shape: Adafactor
    factors matrices, Muon's other leaves fall back to AdamW); else the state as passed."""
    if not isinstance(optimizer, str):
        return state_bytes
    from minitrain.optim import state_bytes as optimizer_state_bytes

    return optimizer_state_bytes(optimizer, params)


def _formula_memory(predicted_state: int, params_bytes: int, batch_bytes: int,
                    activation_bytes: int | None, donate: bool) -> dict[str, Any]:
    peaks = predicted_peak_bytes(
        params=params_bytes, optimizer_state=predicted_state, batch=batch_bytes,
        activations=activation_bytes or 0, donate=donate,
    )
    return {
        "params": params_bytes,
        "grads": params_bytes,
        "optimizer_state": predicted_state,
        "activations": activation_bytes,
        "activations_source": "model formula" if activation_bytes is not None else None,
        "batch": batch_bytes,
        "backward_peak": peaks["backward"],
        "update_peak": peaks["update"],
        "peak": peaks["peak"],
        "source": "formula (pass loss_fn and the optimizer for a traced prediction)",
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
    predicted, measured = memory["predicted"], memory["measured"]
    ratio = memory["peak_ratio"]
    mfu = speed["mfu"]
    moment = (
        f" ({predicted['peak_phase']}, {predicted['peak_op']} in {predicted['peak_module']})"
        if predicted.get("peak_phase") else ""
    )
    lines = [
        ("params", f"{report['params']:,}"),
        (
            "peak memory",
            f"predicted {_si(predicted['peak'], 'B')}{moment}, "
            f"measured {_si(measured['peak'], 'B')}"
            + (f" (x{ratio:.2f})" if ratio is not None else ""),
        ),
    ]
    both = [key for key in ("params", "optimizer_state", "batch", "activations")
            if predicted.get(key) is not None and measured.get(key) is not None]
    if both:
        lines.append(("  predicted/measured", ", ".join(
            f"{key.replace('_', ' ')} {_si(predicted[key], 'B')}/{_si(measured[key], 'B')}"
            for key in both)))
    if measured.get("optimizer_buffer_pools"):
        lines.append(("  optimizer pools", f"{_si(measured['optimizer_buffer_pools'], 'B')} "
                      "of recycled buffers (pure updates), beyond the peak"))
    for index, saved in enumerate(memory.get("where", [])[:3]):
        lines.append((
            "  where it goes" if index == 0 else "",
            f"{_si(saved['bytes'], 'B')} {tuple(saved['shape'])} saved by {saved['op']} in "
            f"{saved['module']}",
        ))
    predicted_flops = flops.get("predicted")
    lines += [
        (
            "FLOPs per step",
            f"6·B·P {_si(flops['rule_6bp'], 'FLOP')}, exact {_si(flops['exact'], 'FLOP')}, "
            + (f"predicted {_si(predicted_flops, 'FLOP')}, " if predicted_flops else "")
            + f"counted {_si(flops['counted'], 'FLOP')} "
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
