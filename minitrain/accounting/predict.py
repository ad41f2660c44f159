"""Predict one training step before running it: memory, FLOPs, bytes and time, on fake tensors.

:func:`predict_step` traces a whole step (forward, backward through :func:`minitrain.
value_and_grad`, gradient clipping when asked, ``optimizer.update``) on tensors that have a
shape, a dtype and a device but no data: PyTorch's ``FakeTensorMode`` for the forward and
backward pass, meta tensors for the update (an mt.optim optimizer treats fake tensors as
traced and would take its plain path, while a real step takes torch's fused and foreach
kernels; meta tensors take those too). Nothing is computed and nothing model-sized is
allocated, so a 1.5B-param model predicts on a laptop.

- **FLOPs and bytes**: a :class:`~minitrain.accounting.Counter` watches the traced ops, so
  the numbers are the ones the counter gives on a real step (same ops, same formulas).
- **Memory**: :class:`~minitrain.accounting.predict_lifetimes.Lifetimes` follows every
  storage from the op that makes it to the moment its last reference dies. Categories:
  ``params``, ``grads``, ``optimizer_state``, ``batch``, ``buffers`` (module buffers and
  constants), ``activations`` (made by the forward pass and still alive when the backward pass
  starts: what autograd saved), ``temporaries`` (the rest). The peak and its moment (phase,
  op, module) are found, not assumed.
- **Time**: each op on the hardware's roofline, ``max(flops / peak, bytes / bandwidth)``
  (chapter 3.6.2), summed over the step.

>>> import torch, minitrain as mt
>>> loss = lambda p, x: (x @ p["w"]).tanh().sum()
>>> pred = predict_step(loss, {"w": TensorSpec((1024, 1024))}, TensorSpec((4096, 1024)),
...                     optimizer=mt.optim.sgd(lr=0.1))
>>> pred.peak_phase, pred.memory["persistent"]["params"] // 2**20, pred.matmul_flops // 2**30
('backward', 4, 16)
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from minitrain._torch import FakeTensorMode, TorchDispatchMode, disable_current_modes
from minitrain.accounting.counter import Counter
from minitrain.accounting.fake import (
    PredictionError,
    TensorSpec,
    fake_mode,
    fake_tree,
    find_mode,
    meta_tree,
    one_line_errors,
)
from minitrain.accounting.hardware import Hardware, hardware
from minitrain.accounting.predict_lifetimes import Lifetimes, category, replay
from minitrain.accounting.roofline import step_time
from minitrain.accounting.timeline import CATEGORIES
from minitrain.errors import UserError
from minitrain.func import value_and_grad
from minitrain.tree import global_norm

__all__ = [
    "PredictionError",
    "SavedTensor",
    "StepPrediction",
    "TensorSpec",
    "fake_mode",
    "predict_call",
    "predict_step",
]


class SavedTensor(NamedTuple):
    """A tensor saved for backward: size, shape, dtype, the module and op that made it."""

    bytes: int
    shape: tuple[int, ...]
    dtype: str
    module: str
    op: str


class StepPrediction(NamedTuple):
    """What :func:`predict_step` returns.

    Memory (bytes):

    - ``peak_bytes``; ``peak_phase`` (``"forward"``, ``"backward"``, ``"clip"``, ``"update"``),
      ``peak_op`` (``"aten.mm"``) and ``peak_module`` (``"transformer.h.3.mlp"``) at the peak;
    - ``memory``: ``{"at_peak": {category: bytes}, "persistent": {category: bytes},
      "saved_for_backward": bytes, "largest": {category: bytes}, "end": {category: bytes}}``;
      categories are
      ``params, grads, optimizer_state, batch, buffers, activations, temporaries``;
      ``persistent`` holds what lives across steps (params, optimizer state, batch, buffers),
      ``largest`` the most each category holds at any moment, ``end`` what is alive after the
      update (new params and state beside the old ones when the update is pure);
    - ``saved``: the largest tensors saved for backward, largest first (:class:`SavedTensor`);
      ``saved_by_module``: saved bytes per innermost module;
    - ``timeline``: one sample per traced op, ``(op_index, phase, {category: live bytes})``,
      in order; ``op_index`` counts the aten ops of the step from 0 (``per_op`` names them by
      op), categories with no live bytes are left out; live bytes right after the op's
      outputs were allocated (before anything it made obsolete is freed).

    Work: ``flops``, ``matmul_flops`` (the ``FlopCounterMode`` subset), ``bytes`` (read plus
    written), ``bytes_read``, ``bytes_written``; ``per_op`` (op -> ``{"calls", "flops",
    "bytes", "seconds"}``), ``per_module`` (module path -> ``{"calls", "flops", "bytes"}``,
    nested modules included in their parents as ``FlopCounterMode`` does), ``unknown_ops``
    (op -> calls without a FLOP formula).

    Time on ``hardware`` (a name of :func:`minitrain.accounting.hardware`): ``dtype`` (of the
    peak FLOP/s used), ``seconds_per_step`` (the roofline time of every op, summed),
    ``mfu_bound`` (``flops / (seconds_per_step · peak)``: the best MFU the step can reach
    there), ``fits`` (``peak_bytes <= memory`` of the hardware).
    """

    peak_bytes: int
    peak_phase: str
    peak_op: str
    peak_module: str
    memory: dict[str, Any]
    saved: list[SavedTensor]
    saved_by_module: dict[str, int]
    timeline: list[tuple[int, str, dict[str, int]]]
    flops: int
    matmul_flops: int
    bytes: int
    bytes_read: int
    bytes_written: int
    per_op: dict[str, dict[str, int | float]]
    per_module: dict[str, dict[str, int]]
    unknown_ops: dict[str, int]
    hardware: str
    dtype: str
    seconds_per_step: float
    mfu_bound: float
    fits: bool

    def summary(self) -> dict[str, Any]:
        """The totals as plain JSON-serializable values (no timeline, no tables)."""
        return {
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_op": self.peak_op,
            "peak_module": self.peak_module,
            "memory": self.memory,
            "saved": [s._asdict() for s in self.saved],
            "flops": self.flops,
            "matmul_flops": self.matmul_flops,
            "bytes": self.bytes,
            "unknown_ops": dict(self.unknown_ops),
            "hardware": self.hardware,
            "dtype": self.dtype,
            "seconds_per_step": self.seconds_per_step,
            "mfu_bound": self.mfu_bound,
            "fits": self.fits,
        }


# -- the traced step ---------------------------------------------------------------------------


class _Metadata(TorchDispatchMode):
    """Answers ``prim.device`` below every other mode: fake tensors dispatch it where real ones
    never do, and the counter would count it as an op without a formula."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            with disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class _Trace:
    """Runs the step under the modes; holds what the prediction is computed from."""

    def __init__(self) -> None:
        self.lifetimes = Lifetimes()
        self.counter = Counter(keep_records=True, track_memory=False)

    def inputs(self, tree: Any, kind: str) -> Any:
        """``tree`` counted as live from the start, in category ``kind``."""
        self.lifetimes.register(tree, kind)
        return tree

    def meta(self, tree: Any) -> Any:
        """``tree``'s twin on the meta device, standing for the same allocations."""
        twin = meta_tree(tree)
        self.lifetimes.alias(twin, tree)
        return twin

    @contextlib.contextmanager
    def watching(self, mode: FakeTensorMode | None, phase: str) -> Iterator[None]:
        # Fake mode at the bottom, lifetimes above it, the counter on top: the counter
        # decomposes composite ops and lifetimes sees each part.
        self.lifetimes.phase = phase
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
            stack.enter_context(self.lifetimes)
            stack.enter_context(self.counter)
            stack.enter_context(_Metadata())
            yield


def predict_step(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    *,
    optimizer: Any = None,
    donate: bool = False,
    has_aux: bool = False,
    max_grad_norm: float | None = None,
    hardware: str | Hardware | None = None,
    dtype: Any = None,
    autocast: Callable[[], Any] | None = None,
    top_saved: int = 10,
    model_state: Any = None,
) -> StepPrediction:
    """Predict one training step of ``loss_fn(params, batch)`` (see the module docstring).

    Args:
        loss_fn: ``(params, batch) -> 0-d loss`` (or ``(loss, aux)`` with ``has_aux``); with
            ``model_state``, ``(params, model_state, batch) -> (value, new_state)`` as an
            experiment with ``init_state`` has it, ``value`` what a stateless loss returns.
        params, batch: pytrees of real tensors, fake tensors (from one :func:`fake_mode`),
            meta tensors, :class:`TensorSpec` or ``(shape, dtype)`` tuples.
        optimizer: an ``mt.optim`` optimizer; its state is made by ``optimizer.init`` (the
            first step's state). None: forward and backward only.
        donate: the update writes params and state in place (``update(..., donate=True)``).
        max_grad_norm: clip grads to this global norm, as the train step does; without it
            the grad norm is still taken (the train step logs it). Clipping is predicted
            active (the grads multiplied by the scale): a real step whose norm is already
            within the bound skips that multiply, one FLOP and one copy of the grads less.
        hardware: a name of ``mt.accounting.hardware`` (or a :class:`Hardware`) for the time
            per step and ``fits``; default ``"h100"``.
        dtype: the dtype of the peak FLOP/s for every op (``"bf16"`` to assume tensor
            cores); default: each op's own floating dtype.
        autocast: a context manager factory for the forward and backward pass (the backend's
            ``autocast``), as the train step uses.
        top_saved: how many of the largest saved tensors to list.
        model_state: buffers a forward pass updates (BatchNorm statistics, from
            ``mt.from_module(module, with_state=True)``), as real, fake or meta tensors or
            specs. They count as ``buffers``; the new state the loss returns stays alive to
            the end of the step, as the train step carries it.

    Raises :class:`PredictionError` (one line, naming the op) when the step needs data.
    """
    spec = hardware if isinstance(hardware, Hardware) else _lookup(hardware or "h100")
    mode = find_mode((params, batch)) or fake_mode()
    trace = _Trace()
    fake_params = trace.inputs(fake_tree(mode, params), "params")
    fake_batch = trace.inputs(fake_tree(mode, batch), "batch")
    meta_params = trace.meta(fake_params)
    state = None
    if optimizer is not None:
        state = trace.inputs(optimizer.init(meta_params), "optimizer_state")
    objective, aux = loss_fn, has_aux
    if model_state is not None:
        fake_state = trace.inputs(fake_tree(mode, model_state), "buffers")
        objective, aux = _with_state(loss_fn, fake_state, has_aux), True
    persistent = _live_by_category(trace.lifetimes)
    gradients = value_and_grad(objective, has_aux=aux)
    with one_line_errors():
        meta_grads, new_state = _backward(trace, mode, gradients, fake_params, fake_batch,
                                          autocast, model_state is not None)
        # The grads go in a box the update empties: once clipped, the unclipped grads die as
        # they do in the train step (which rebinds its one reference).
        box = [meta_grads]
        del meta_grads
        end_state = _update(trace, optimizer, meta_params, box, state, donate, max_grad_norm)
    end = _live_by_category(trace.lifetimes)
    del end_state, new_state
    return _prediction(trace, spec, dtype, persistent, end, top_saved)


def _backward(trace: _Trace, mode: FakeTensorMode, gradients: Callable[..., Any], params: Any,
              batch: Any, autocast: Callable[[], Any] | None, stateful: bool) -> tuple[Any, Any]:
    """The forward and backward pass on fake tensors: the grads as meta tensors, and the new
    model state (None without one), which the step carries to its end."""
    with trace.watching(mode, "forward"), autocast() if autocast else contextlib.nullcontext():
        value, grads = gradients(params, batch)
    new_state = None
    if stateful:
        new_state = value[1][1]
        trace.lifetimes.categorize(new_state, "buffers")
    del value
    trace.lifetimes.categorize(grads, "grads")
    return trace.meta(grads), new_state


def _with_state(loss_fn: Callable[..., Any], state: Any, has_aux: bool) -> Callable[..., Any]:
    """``loss_fn(params, state, batch) -> (value, new_state)`` as ``(params, batch) -> (loss,
    (aux, new_state))``, the state bound."""

    def objective(params: Any, batch: Any) -> Any:
        out = loss_fn(params, state, batch)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise UserError(
                f"with model_state the loss returns (value, new_state), got {type(out).__name__}"
            )
        value, new_state = out
        loss, aux = value if has_aux else (value, ())
        return loss, (aux, new_state)

    return objective


def predict_call(
    step: Callable[..., Any],
    params: Any,
    opt_state: Any,
    batch: Any,
    *,
    hardware: str | Hardware = "h100",
    dtype: Any = None,
    top_saved: int = 10,
) -> StepPrediction:
    """Predict ``step(params, opt_state, batch)``, any pure train step, on fake tensors.

    For a step that is not a loss and an ``mt.optim`` optimizer (a vmapped ensemble, a
    hand-written step). Everything runs on fake tensors, so an ``mt.optim`` update inside takes
    its plain path (per leaf, out of place) where a real step takes torch's fused kernels: the
    update's FLOPs and temporaries are those of the plain path. Phases are ``forward`` and
    ``backward`` (which runs on to the end of the step); the new params, state and grads count
    as temporaries. Prefer :func:`predict_step` when the step is a loss and an optimizer.

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.sgd(lr=0.1)
    >>> grad = mt.value_and_grad(lambda p, x: (x @ p["w"]).sum())
    >>> def step(p, s, x):
    ...     return opt.update(grad(p, x)[1], s, p)
    >>> p = {"w": torch.zeros(256, 256)}
    >>> pred = predict_call(step, p, opt.init(p), torch.ones(64, 256))
    >>> pred.memory["persistent"]["params"], pred.matmul_flops == 2 * (2 * 64 * 256 * 256)
    (262144, True)
    """
    spec = hardware if isinstance(hardware, Hardware) else _lookup(hardware)
    mode = find_mode((params, opt_state, batch)) or fake_mode()
    trace = _Trace()
    fakes = [trace.inputs(fake_tree(mode, tree), kind) for tree, kind in
             zip((params, opt_state, batch), ("params", "optimizer_state", "batch"), strict=True)]
    persistent = _live_by_category(trace.lifetimes)
    with one_line_errors(), trace.watching(mode, "forward"):
        out = step(*fakes)
    end = _live_by_category(trace.lifetimes)
    del out
    return _prediction(trace, spec, dtype, persistent, end, top_saved)


def _update(trace: _Trace, optimizer: Any, params: Any, box: list[Any], state: Any,
            donate: bool, max_grad_norm: float | None) -> Any:
    """Clip (or take the norm of) the grads (``box``'s one item, taken out, so only this
    frame holds them) and update, as the train step does; on meta."""
    grads = box.pop()
    with trace.watching(None, "clip"):
        if max_grad_norm is not None:
            from minitrain.optim import clip_by_global_norm

            grads, norm = clip_by_global_norm(grads, max_grad_norm)
            trace.lifetimes.categorize(grads, "grads")
        else:
            norm = global_norm(grads)
    if optimizer is None:
        return norm
    with trace.watching(None, "update"):
        options = {"donate": True} if donate else {}
        new_params, new_state = optimizer.update(grads, state, params, **options)
        del grads
    trace.lifetimes.categorize(new_params, "params")
    trace.lifetimes.categorize(new_state, "optimizer_state")
    return new_params, new_state, norm


_lookup = hardware  # predict_step's own ``hardware`` argument hides the function

def _live_by_category(lifetimes: Lifetimes) -> dict[str, int]:
    totals = dict.fromkeys(CATEGORIES, 0)
    for allocation in lifetimes.live():
        totals[category(allocation)] += allocation.nbytes
    return {k: v for k, v in totals.items() if v}


def _prediction(trace: _Trace, spec: Hardware, dtype: Any, persistent: dict[str, int],
                end: dict[str, int], top_saved: int) -> StepPrediction:
    lifetimes, counter = trace.lifetimes, trace.counter
    lifetimes.close()
    result = replay(lifetimes)
    seconds, per_op, main_dtype, mfu = step_time(counter, spec, dtype)
    saved = sorted(
        (a for a in lifetimes.allocations if a.saved), key=lambda a: (-a.nbytes, a.index)
    )
    by_module: dict[str, int] = defaultdict(int)
    for allocation in saved:
        by_module[allocation.module] += allocation.nbytes
    peak_name, peak_phase, peak_module = (
        lifetimes.ops[result.peak_op] if result.peak_op >= 0 else ("", "input", "Global")
    )
    return StepPrediction(
        peak_bytes=result.peak_bytes,
        peak_phase=peak_phase,
        peak_op=peak_name,
        peak_module=peak_module,
        memory={
            "at_peak": {k: v for k, v in result.at_peak.items() if v},
            "persistent": persistent,
            "saved_for_backward": sum(a.nbytes for a in saved),
            "largest": {k: v for k, v in result.largest.items() if v},
            "end": end,
        },
        saved=[SavedTensor(a.nbytes, a.shape, a.dtype, a.module, a.op)
               for a in saved[:top_saved]],
        saved_by_module=dict(sorted(by_module.items(), key=lambda kv: -kv[1])),
        timeline=result.timeline,
        flops=counter.flops,
        matmul_flops=counter.matmul_flops,
        bytes=counter.bytes_read + counter.bytes_written,
        bytes_read=counter.bytes_read,
        bytes_written=counter.bytes_written,
        per_op=per_op,
        per_module={name: {"calls": t.calls, "flops": t.flops,
                           "bytes": t.bytes_read + t.bytes_written}
                    for name, t in counter.by_module.items()},
        unknown_ops=dict(counter.unknown),
        hardware=spec.name,
        dtype=main_dtype,
        seconds_per_step=seconds,
        mfu_bound=mfu,
        fits=result.peak_bytes <= spec.memory_bytes,
    )
