"""Predict one training step before running it: memory, FLOPs, bytes and time, on fake tensors.

:func:`predict_step` traces forward, backward, clipping and ``optimizer.update`` on tensors
without data: fake tensors for forward and backward, meta tensors for the update (which then
takes the kernels a real step takes). A :class:`~minitrain.accounting.Counter` counts FLOPs,
bytes and memory, so the peak is found, not assumed; time is every op on the roofline,
``max(flops / peak, bytes / bandwidth)`` (chapter 3.6.2), summed.

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

from minitrain._torch import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    UnsupportedOperatorException,
    pytree,
)
from minitrain.accounting.counter import Counter
from minitrain.accounting.hardware import Hardware, hardware
from minitrain.accounting.ledger import Ledger
from minitrain.accounting.op_formulas import tensors
from minitrain.accounting.roofline import step_time
from minitrain.errors import UserError
from minitrain.func import value_and_grad
from minitrain.tree import global_norm

__all__ = [
    "PredictionError", "SavedTensor", "StepPrediction", "TensorSpec", "fake_mode", "predict_call",
    "predict_step",
]


class PredictionError(UserError):
    """A step that cannot be traced without data (``.item()``, data-dependent shapes);
    ``reason`` says which op and why, in a few words."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class TensorSpec(NamedTuple):
    """A tensor's shape and dtype (and device), without data: ``jax.ShapeDtypeStruct``.

    A ``(shape, dtype)`` tuple and a tensor on the meta device are read the same way.

    >>> TensorSpec((8, 1024), torch.int64)
    TensorSpec(shape=(8, 1024), dtype=torch.int64, device='cpu')
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


def fake_mode() -> FakeTensorMode:
    """A fake tensor mode for building a model or a batch to predict with (real tensors that
    meet fake ones are converted, as a module's buffers must be).

    >>> with fake_mode():
    ...     w = torch.nn.Linear(4096, 4096).weight   # no memory behind it
    >>> type(w.data).__name__, w.shape
    ('FakeTensor', torch.Size([4096, 4096]))
    """
    return FakeTensorMode(allow_non_fake_inputs=True)


def _is_spec(x: Any) -> bool:
    return isinstance(x, TensorSpec) or (
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)
        and isinstance(x[0], tuple | list | torch.Size) and all(isinstance(n, int) for n in x[0])
    )


def _to_fake(mode: FakeTensorMode, x: Any) -> Any:
    if _is_spec(x):
        spec = x if isinstance(x, TensorSpec) else TensorSpec(tuple(x[0]), x[1])
        with mode:
            return torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, FakeTensor):
        if x.fake_mode is not mode:
            raise UserError("tensors from two fake modes; build them under one fake_mode()")
        return x
    if x.is_meta:
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    return mode.from_tensor(x)


def _meta_twin(counter: Counter, tree: Any) -> Any:
    """The twins of ``tree``'s fake tensors on the meta device, made outside the fake mode and
    standing for the same allocations (the update runs on them)."""
    twin = pytree.tree_map(lambda x: torch.empty_strided(
        x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x,
        tree)
    counter.ledger.alias(twin, tree)
    return twin


def _start(on: str | Hardware, trees: tuple[Any, ...]) -> tuple[Hardware, FakeTensorMode, Counter]:
    """The spec, the fake mode of ``trees`` (or a new one) and a counter over fake storages."""
    spec = on if isinstance(on, Hardware) else hardware(on)
    fakes = [leaf for leaf in pytree.tree_leaves(trees) if isinstance(leaf, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else fake_mode()
    return spec, mode, Counter(ledger=Ledger(fake=True, inputs="buffers"))


def _inputs(counter: Counter, mode: FakeTensorMode, tree: Any, kind: str) -> Any:
    """``tree`` (specs and tensors: real, meta or fake) as fake tensors of ``mode``, counted
    as live from the start in category ``kind``."""
    fake = pytree.tree_map(lambda x: _to_fake(mode, x), tree, is_leaf=_is_spec)
    counter.track(fake, category=kind)
    return fake


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """What fake tensors raise for a step that needs data, as a :class:`PredictionError`."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        name = str(exc.func).removesuffix(".default")
        why = ("(.item(), float() or int() of a tensor)" if "_local_scalar_dense" in name
               else "(its output shape depends on the values)")
        reason = f"{name} {why} needs the tensor's data, which fake tensors do not have"
        raise PredictionError(f"{reason}: measure one real step instead", reason) from None
    except UnsupportedOperatorException as exc:
        reason = f"{exc.func} has no fake-tensor implementation"
        raise PredictionError(f"{reason}: measure one real step instead", reason) from None


_TOP_SAVED = 10  # the largest saved tensors a prediction lists


class SavedTensor(NamedTuple):
    """A tensor saved for backward: size, shape, dtype, the module and op that made it."""

    bytes: int
    shape: tuple[int, ...]
    dtype: str
    module: str
    op: str


class StepPrediction(NamedTuple):
    """What :func:`predict_step` returns: memory in bytes by category (``memory`` holds
    ``at_peak``, ``persistent``, ``largest``, ``end`` and ``saved_for_backward``), the largest
    ``saved`` tensors (``saved_by_module`` sums them by module); work; time on ``hardware``
    (``mfu_bound`` is ``flops / (seconds_per_step · peak)``)."""

    peak_bytes: int
    peak_phase: str
    peak_op: str
    peak_module: str
    memory: dict[str, Any]
    saved: list[SavedTensor]
    saved_by_module: dict[str, int]
    flops: int
    matmul_flops: int
    bytes: int
    unknown_ops: dict[str, int]
    hardware: str
    dtype: str
    seconds_per_step: float
    mfu_bound: float
    fits: bool

    def summary(self) -> dict[str, Any]:
        """The totals as plain JSON-serializable values (no table by module)."""
        return {key: value for key, value in self._asdict().items() if key != "saved_by_module"} | {
            "saved": [s._asdict() for s in self.saved], "unknown_ops": dict(self.unknown_ops)}


class _MetaInPlace(TorchDispatchMode):
    """Below the counter: an in-place kernel with no meta implementation (torch's
    ``_fused_sgd_``, ``_fused_adagrad_``) changes no shape and no byte on meta tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except NotImplementedError:
            inputs = tensors((args, kwargs))
            if func._schema.returns or not inputs or not all(t.is_meta for t in inputs):
                raise
            return None


@contextlib.contextmanager
def _watching(counter: Counter, mode: FakeTensorMode | None, phase: str) -> Iterator[None]:
    # The counter decomposes composite ops and its ledger sees each part.
    counter.set_phase(phase)
    with mode if mode is not None else contextlib.nullcontext(), _MetaInPlace(), counter:
        yield


def predict_step(
    loss_fn: Callable[..., Any], params: Any, batch: Any, *, optimizer: Any = None,
    donate: bool = False, has_aux: bool = False, max_grad_norm: float | None = None,
    hardware: str | Hardware | None = None, dtype: Any = None,
    autocast: Callable[[], Any] | None = None, model_state: Any = None,
) -> StepPrediction:
    """Predict one training step of ``loss_fn(params, batch)`` (see the module docstring).

    Args:
        loss_fn: ``(params, batch) -> loss`` (``(loss, aux)`` with ``has_aux``); with
            ``model_state`` (buffers the forward pass updates),
            ``(params, model_state, batch) -> (value, new_state)``.
        params, batch: pytrees of real, fake (one :func:`fake_mode`) or meta tensors,
            :class:`TensorSpec` or ``(shape, dtype)`` tuples.
        optimizer: an ``mt.optim`` optimizer, or None (forward and backward only);
            ``donate``: the update writes in place; ``max_grad_norm``: clip as the train step.
        hardware: a registry name or :class:`Hardware` (default ``"h100"``); ``dtype``: of the
            peak FLOP/s for every op (default: each op's own); ``autocast``: a context factory
            for forward and backward. Raises :class:`PredictionError` if the step needs data.

    >>> import torch, minitrain as mt
    >>> pred = predict_step(lambda p, x: (x @ p["w"]).square().mean(),
    ...                     {"w": ((64, 8), torch.float32)}, ((32, 64), torch.float32),
    ...                     optimizer=mt.optim.adam(lr=1e-3))
    >>> pred.matmul_flops  # forward 2·32·64·8, backward the same again for w's grad
    65536
    """
    spec, mode, counter = _start(hardware or "h100", (params, batch))
    fake_params = _inputs(counter, mode, params, "params")
    fake_batch = _inputs(counter, mode, batch, "batch")
    meta_params = _meta_twin(counter, fake_params)
    state = None if optimizer is None else optimizer.init(meta_params)  # on meta, as the update
    counter.track(state, category="optimizer_state")
    objective, aux = loss_fn, has_aux
    if model_state is not None:
        fake_state = _inputs(counter, mode, model_state, "buffers")
        objective, aux = _with_state(loss_fn, fake_state, has_aux), True
    persistent = counter.ledger.live_by_category()
    gradients = value_and_grad(objective, has_aux=aux)
    with one_line_errors():
        # The grads come in a box the update empties: once clipped, the unclipped grads die
        # as they do in the train step (which rebinds its one reference).
        box, new_state = _backward(counter, mode, gradients, fake_params, fake_batch, autocast,
                                   model_state is not None)
        end_state = _update(counter, optimizer, meta_params, box, state, donate, max_grad_norm)
    end = counter.ledger.live_by_category()
    del end_state, new_state
    return _prediction(counter, spec, dtype, persistent, end)


def _backward(counter: Counter, mode: FakeTensorMode, gradients: Callable[..., Any],
              params: Any, batch: Any, autocast: Callable[[], Any] | None,
              stateful: bool) -> tuple[list[Any], Any]:
    """Forward and backward on fake tensors: the grads' meta twins in a box, and the new model
    state."""
    with _watching(counter, mode, "forward"), autocast() if autocast else contextlib.nullcontext():
        value, grads = gradients(params, batch)
    new_state = value[1][1] if stateful else None
    counter.categorize(new_state, category="buffers")  # (None: no tensors)
    del value
    counter.categorize(grads, category="grads")
    return [_meta_twin(counter, grads)], new_state


def _with_state(loss_fn: Callable[..., Any], state: Any, has_aux: bool) -> Callable[..., Any]:
    """``loss_fn(params, state, batch)`` as ``(params, batch) -> (loss, (aux, new_state))``."""

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


def predict_call(step: Callable[..., Any], params: Any, opt_state: Any, batch: Any, *,
                 hardware: str | Hardware = "h100", dtype: Any = None) -> StepPrediction:
    """Predict ``step(params, opt_state, batch)``, any pure train step (a vmapped ensemble), on
    fake tensors: an ``mt.optim`` update inside runs its chain, and the new params, state and
    grads count as temporaries. Prefer :func:`predict_step` for a loss and an optimizer.

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
    spec, mode, counter = _start(hardware, (params, opt_state, batch))
    fakes = [_inputs(counter, mode, tree, kind) for tree, kind in
             zip((params, opt_state, batch), ("params", "optimizer_state", "batch"), strict=True)]
    persistent = counter.ledger.live_by_category()
    with one_line_errors(), _watching(counter, mode, "forward"):
        out = step(*fakes)
    end = counter.ledger.live_by_category()
    del out
    return _prediction(counter, spec, dtype, persistent, end)


def _update(counter: Counter, optimizer: Any, params: Any, box: list[Any], state: Any,
            donate: bool, max_grad_norm: float | None) -> Any:
    """Clip (or take the norm of) the grads, then update, on meta, as the train step does;
    the grads come in a box so that only this frame holds them."""
    grads = box.pop()
    with _watching(counter, None, "clip"):
        if max_grad_norm is not None:
            from minitrain.optim import clip_by_global_norm

            grads, norm = clip_by_global_norm(grads, max_grad_norm)
            counter.categorize(grads, category="grads")
        else:
            norm = global_norm(grads)
    if optimizer is None:
        return norm
    with _watching(counter, None, "update"):
        options = {"donate": True} if donate else {}
        new_params, new_state = optimizer.update(grads, state, params, **options)
        del grads
    counter.categorize(new_params, category="params")
    counter.categorize(new_state, category="optimizer_state")
    return new_params, new_state, norm


def _prediction(counter: Counter, spec: Hardware, dtype: Any, persistent: dict[str, int],
                end: dict[str, int]) -> StepPrediction:
    ledger = counter.ledger
    ledger.close()
    result = ledger.replay()
    seconds, main_dtype, mfu = step_time(counter, spec, dtype)
    saved = sorted((a for a in ledger.allocations if a.saved), key=lambda a: (-a.nbytes, a.index))
    by_module: dict[str, int] = defaultdict(int)
    for allocation in saved:
        by_module[allocation.module] += allocation.nbytes
    peak_name, peak_phase, peak_module = (ledger.ops[result.peak_op] if result.peak_op >= 0
                                          else ("", "input", "Global"))
    return StepPrediction(
        peak_bytes=result.peak_bytes, peak_phase=peak_phase, peak_op=peak_name,
        peak_module=peak_module,
        memory={"at_peak": result.at_peak, "persistent": persistent,
                "saved_for_backward": sum(a.nbytes for a in saved),
                "largest": {k: v for k, v in result.largest.items() if v}, "end": end},
        saved=[SavedTensor(a.nbytes, a.shape, a.dtype, a.module, a.op)
               for a in saved[:_TOP_SAVED]],
        saved_by_module=dict(sorted(by_module.items(), key=lambda kv: -kv[1])),
        flops=counter.flops, matmul_flops=counter.matmul_flops,
        bytes=counter.bytes_read + counter.bytes_written,
        unknown_ops=dict(counter.unknown), hardware=spec.name, dtype=main_dtype,
        seconds_per_step=seconds, mfu_bound=mfu, fits=result.peak_bytes <= spec.memory_bytes,
    )
