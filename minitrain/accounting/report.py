"""Predicted vs measured resources of one training step: memory, FLOPs, MFU, time to finish.

:func:`resource_report` predicts the step on fake tensors, then runs it once under a
:class:`Counter` (outputs thrown away, the global RNG state restored) and sets the measurement
(CUDA: ``torch.cuda.max_memory_allocated``; CPU: the counter's live storages) beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minitrain.accounting.counter import Counter
from minitrain.accounting.op_formulas import tensors
from minitrain.accounting.predict import PredictionError, predict_call, predict_step
from minitrain.accounting.units import si
from minitrain.tree import nbytes, size

__all__ = ["format_report", "resource_report"]


def resource_report(
    step: Callable[[Any, Any, Any], Any], params: Any, opt_state: Any, batch: Any, *,
    optimizer: Any = None, examples_per_step: int | None = None,
    exact_flops_per_step: int | None = None, donate: bool = False,
    peak_flops: int | float | None = None, step_seconds: int | float | None = None,
    steps_total: int | None = None, steps_done: int = 0,
    loss_fn: Callable[..., Any] | None = None, has_aux: bool = False,
    max_grad_norm: float | None = None, autocast: Callable[[], Any] | None = None,
    model_state: Any = None,
) -> dict[str, Any]:
    """Predicted vs measured memory, FLOPs and speed of ``step(params, opt_state, batch)``.

    ``step`` (pure, uncompiled) runs once more here. The prediction is :func:`predict_step`
    given ``loss_fn`` and an ``mt.optim`` optimizer (the other arguments as it takes them),
    else :func:`predict_call` of the whole step; a step that needs data has none (``source``
    says why).
    ``examples_per_step`` is ``B`` of the ``6·B·P`` rule (default: the batch's leading dim);
    ``peak_flops`` and the step counts give MFU and the time to finish. Returns a
    JSON-serializable dict.

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
    device = next((t.device for t in tensors((params, batch)) if t.is_cuda), None)
    step_options = dict(has_aux=has_aux, max_grad_norm=max_grad_norm, autocast=autocast,
                        model_state=model_state)
    prediction, predicted = _predict(step, params, opt_state, batch, loss_fn, optimizer, donate,
                                     step_options)
    counter, peak = _measure(step, params, opt_state, batch, device)
    measured = _measured_memory(counter, peak, device, params, opt_state, batch)
    examples = examples_per_step
    if examples is None:  # the batch's leading dim
        leaves = tensors(batch)
        examples = int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 1
    return {
        "params": size(params),
        "examples_per_step": examples,
        "memory": {
            "predicted": predicted,
            "measured": measured,
            "peak_ratio": _ratio(peak, predicted["peak"]),
            "where": [saved._asdict() for saved in prediction.saved[:5]] if prediction else [],
        },
        "flops_per_step": {
            "rule_6bp": 6 * examples * size(params), "exact": exact_flops_per_step,
            "predicted": prediction.flops if prediction else None, "counted": counter.flops,
            "counted_matmul": counter.matmul_flops, "unknown_ops": dict(counter.unknown),
        },
        "speed": _speed(exact_flops_per_step, counter, step_seconds, peak_flops, steps_total,
                        steps_done),
    }


def _measure(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any,
             device: torch.device | None) -> tuple[Counter, int]:
    """One step under the counter, and its peak bytes; the global RNG state is kept."""
    with torch.random.fork_rng(devices=[] if device is None else [device],
                               device_type=device.type if device else "cuda"):
        with Counter(keep_records=False) as counter:
            counter.track(params, opt_state, batch)
            out = step(params, opt_state, batch)
            del out
        if device is None:
            return counter, counter.peak_bytes
        return counter, _cuda_peak(step, params, opt_state, batch, device)


def _cuda_peak(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any,
               device: torch.device) -> int:
    """``max_memory_allocated`` over one step, less what else was allocated before."""
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


def _predict(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any,
             loss_fn: Callable[..., Any] | None, optimizer: Any, donate: bool,
             step_options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """:func:`predict_step` given a loss and an ``mt.optim`` optimizer, else the whole step
    traced; no prediction (``peak`` None) for a step that needs data."""
    if loss_fn is not None and hasattr(optimizer, "update"):
        prediction = predict_step(loss_fn, params, batch, optimizer=optimizer, donate=donate,
                                  **step_options)
        source = "predict_step (fake tensors)"
    else:
        try:
            prediction = predict_call(step, params, opt_state, batch)
        except PredictionError as error:
            return None, {"peak": None, "source": f"no prediction: {error.reason}"}
        source = "predict_call: the whole step on fake tensors (update on its plain path)"
    return prediction, _traced_memory(prediction) | {"source": source}


def _speed(exact_flops: int | None, counter: Counter, step_seconds: int | float | None,
           peak_flops: int | float | None, steps_total: int | None,
           steps_done: int) -> dict[str, Any]:
    model_flops, model_source = ((exact_flops, "exact formula") if exact_flops is not None
                                 else (counter.matmul_flops, "counted matmuls"))
    achieved = model_flops / step_seconds if step_seconds else None
    remaining = max(0, steps_total - steps_done) if steps_total is not None else None
    return {
        "step_seconds": step_seconds, "model_flops_per_step": model_flops,
        "model_flops_source": model_source, "achieved_flops_per_second": achieved,
        "peak_flops_per_second": peak_flops, "mfu": _ratio(achieved, peak_flops),
        "steps_total": steps_total, "steps_done": steps_done,
        "seconds_to_finish": (remaining * step_seconds if remaining is not None and step_seconds
                              else None),
        "seconds_total": steps_total * step_seconds if steps_total and step_seconds else None,
    }


def _measured_memory(counter: Counter, peak: int, device: torch.device | None, params: Any,
                     opt_state: Any, batch: Any) -> dict[str, Any]:
    from minitrain.optim.kernels.pool import idle_bytes

    sizes = {"params": nbytes(params), "optimizer_state": nbytes(opt_state), "batch": nbytes(batch)}
    at_backward = counter.live_at_backward
    return {
        "peak": peak, **sizes,
        "activations": (at_backward.get("activations", 0)
                        if at_backward is not None and device is None else None),
        # the pure fast path's recycled buffers, held beyond what the step returned
        "optimizer_buffer_pools": idle_bytes(),
        "source": "torch.cuda.max_memory_allocated" if device is not None
        else "live storages (minitrain.accounting.Counter)",
    }


def _traced_memory(prediction: Any) -> dict[str, Any]:
    memory = prediction.memory
    sizes = {key: memory["persistent"].get(key, 0) for key in ("params", "optimizer_state",
                                                                 "batch")}
    # grads None: a whole-step trace cannot tell grads apart
    return sizes | {
        "grads": memory["largest"].get("grads"), "activations": memory["saved_for_backward"],
        "activations_source": "predict_step: alive from the forward into the backward pass",
        "at_peak": memory["at_peak"], "peak": prediction.peak_bytes,
        "peak_phase": prediction.peak_phase, "peak_op": prediction.peak_op,
        "peak_module": prediction.peak_module,
    }


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
    ratio, mfu = memory["peak_ratio"], speed["mfu"]
    moment = (
        f" ({predicted['peak_phase']}, {predicted['peak_op']} in {predicted['peak_module']})"
        if predicted.get("peak_phase") else ""
    )
    def b(value: int | float | None) -> str:
        return si(value, "B", 3)

    def f(value: int | float | None, unit: str = "FLOP") -> str:
        return si(value, unit, 3)

    lines = [("params", f"{report['params']:,}"), (
        "peak memory", f"predicted {b(predicted['peak'])}{moment}, measured "
        f"{b(measured['peak'])}" + (f" (x{ratio:.2f})" if ratio is not None else ""),
    )]
    both = [key for key in ("params", "optimizer_state", "batch", "activations")
            if predicted.get(key) is not None and measured.get(key) is not None]
    if both:
        lines.append(("  predicted/measured", ", ".join(
            f"{key.replace('_', ' ')} {b(predicted[key])}/{b(measured[key])}" for key in both)))
    if measured.get("optimizer_buffer_pools"):
        lines.append(("  optimizer pools", f"{b(measured['optimizer_buffer_pools'])} of recycled "
                      "buffers (pure updates), beyond the peak"))
    for index, saved in enumerate(memory.get("where", [])[:3]):
        lines.append(("  where it goes" if index == 0 else "", f"{b(saved['bytes'])} "
                      f"{tuple(saved['shape'])} saved by {saved['op']} in {saved['module']}"))
    predicted_flops = flops.get("predicted")
    lines += [
        ("FLOPs per step", f"6·B·P {f(flops['rule_6bp'])}, exact {f(flops['exact'])}, "
         + (f"predicted {f(predicted_flops)}, " if predicted_flops else "")
         + f"counted {f(flops['counted'])} (matmul {f(flops['counted_matmul'])})"),
        ("achieved", f"{f(speed['achieved_flops_per_second'], 'FLOP/s')} "
                     f"(MFU {'-' if mfu is None else f'{mfu:.1%}'})"),
        # a finished run: its length; else the steps left
        (f"time for {speed['steps_total']:,} step{'s' * (speed['steps_total'] != 1)}",
         f(speed.get("seconds_total"), "s"))
        if speed.get("steps_total") and speed.get("steps_done") == speed["steps_total"] else
        ("time to finish", f(speed["seconds_to_finish"], "s")),
    ]
    if flops["unknown_ops"]:
        lines.append(("ops without formula", ", ".join(sorted(flops["unknown_ops"]))))
    if report.get("communication"):  # data parallel: the gradient all-reduce of one rank
        comm = report["communication"]
        lines.append(("all-reduce per step", f"{b(comm['allreduce_bytes_per_rank'])} sent per "
                      f"rank (2·(N-1)/N × {b(comm['gradient_bytes'])} of grads, N = "
                      f"{comm['ranks']}), {f(comm['reduce_seconds_per_step'], 's')} measured "
                      f"({comm['process_group']})"))
    return "\n".join(f"{name:<23}{value}" for name, value in lines)
