"""Low-precision matmuls in training, simulated exactly: fp8 (per-tensor scales) and MX / NVFP4.

Each matmul quantizes its inputs with :func:`minitrain.formats.quantize` semantics (bit-exact),
then multiplies the quantized values in fp32, which is what an fp8 tensor core does: products of
fp8 values are exact in fp32 and accumulation is fp32. Params, grads of params, optimizer state
and the update stay fp32; only the three GEMMs of each matmul see low precision.

The fp8 recipe is Transformer Engine's (``DelayedScaling``, Micikevicius et al. 2022, "FP8
Formats for Deep Learning"): activations and weights in e4m3 in the forward pass, the gradient
of the output in e5m2 in the backward pass, each tensor scaled by ``fp8_max / amax / 2**margin``
before the (saturating) cast and unscaled after it. With ``state`` the amax comes from a history
of the last ``history_len`` steps (delayed scaling, TE's ``amax_compute_algo="max"``); without,
from the tensor itself (TE's ``Float8CurrentScaling``). The history is explicit, pure state: a
tensor ``(num_matmuls, 3, history_len)`` (operand a, operand b, output grad), and the updated
history comes back as the *gradient* of the state, the trick flax's ``fp8_ops`` uses, so it works
under ``torch.func.grad`` and ``vmap`` with no side effects.

Block formats (``mxfp8``, ``mxfp4``, ``nvfp4``) scale blocks along the reduction dimension of
each GEMM, as torchao's MX training does: the forward pass quantizes ``a`` along K and ``b``
along K; the backward requantizes the high-precision operands along the new reduction dimension
(N for the input gradient, M for the weight gradient). Reduction dimensions that are not a
multiple of the block are padded with zeros, which change no block scale and no sum.

Inside :func:`simulate`, a ``TorchFunctionMode`` routes ``F.linear``, ``torch.matmul``, ``@``,
``mm`` and ``bmm`` through these matmuls, so any model runs unchanged, including
``mt.from_module`` models and ``torch.func.vmap`` sweeps.

>>> import torch
>>> a, b = torch.randn(4, 32), torch.randn(32, 8)
>>> with simulate(RECIPES["fp8"]):
...     y = a @ b
>>> expected = quantize_operand(a, "fp8_e4m3") @ quantize_operand(b, "fp8_e4m3")
>>> torch.equal(y, expected)
True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from minitrain.formats import quantize, spec

__all__ = [
    "Recipe",
    "RECIPES",
    "recipe",
    "quantize_operand",
    "delayed_scale",
    "matmul",
    "linear",
    "simulate",
    "init_state",
    "count_matmuls",
]

PER_TENSOR = ("fp8_e4m3", "fp8_e5m2")
BLOCK = ("mxfp8", "mxfp4", "nvfp4")
_TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class Recipe(NamedTuple):
    """Formats of the forward operands and of the output gradient, and the scaling options."""

    forward: str = "fp8_e4m3"  # activations and weights
    backward: str = "fp8_e5m2"  # gradient of the matmul's output
    history_len: int = 16  # delayed scaling: steps of amax history (TE default 1024)
    margin: int = 0  # scale = fp8_max / amax / 2**margin (TE DelayedScaling.margin)
    gemm: str = "simulated"  # or "scaled_mm": real fp8 GEMMs through torch._scaled_mm


RECIPES = {
    "fp8": Recipe("fp8_e4m3", "fp8_e5m2"),  # Transformer Engine's HYBRID format
    "mxfp8": Recipe("mxfp8", "mxfp8"),  # OCP MX: e4m3 elements everywhere (torchao default)
    "mxfp4": Recipe("mxfp4", "mxfp4"),
    "nvfp4": Recipe("nvfp4", "nvfp4"),
    "fp8-scaled-mm": Recipe("fp8_e4m3", "fp8_e5m2", gemm="scaled_mm"),  # fp8 tensor cores
}


def recipe(name: str | Recipe) -> Recipe:
    """A recipe by name (``fp8``, ``mxfp8``, ``mxfp4``, ``nvfp4``), checked.

    >>> recipe("fp8").backward
    'fp8_e5m2'
    """
    if isinstance(name, Recipe):
        r = name
    elif name in RECIPES:
        r = RECIPES[name]
    else:
        raise ValueError(f"unknown matmul format {name!r}; choose one of: {', '.join(RECIPES)}")
    for fmt in (r.forward, r.backward):
        if fmt not in PER_TENSOR + BLOCK:
            raise ValueError(
                f"matmul operands take one of {', '.join(PER_TENSOR + BLOCK)}, not {fmt!r}"
            )
    if r.gemm not in ("simulated", "scaled_mm") or (r.gemm == "scaled_mm" and r.forward in BLOCK):
        raise ValueError(f"gemm is 'simulated' or 'scaled_mm' (fp8 only), got {r.gemm!r}")
    if r.history_len < 1:
        raise ValueError(f"history_len must be at least 1, got {r.history_len}")
    return r


# ---------------------------------------------------------------------------------------------
# Quantizing one operand


def _fp8_codes(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` saturated and cast to torch's fp8 dtype (round to nearest even)."""
    top = spec(fmt).max
    return x.clamp(-top, top).to(_TORCH_FP8[fmt])


def _cast_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``quantize(x, fmt, saturate=True)`` through torch's fp8 cast (tested equal bit for bit):
    clamp, cast, back to fp32."""
    return _fp8_codes(x, fmt).float()


def delayed_scale(history: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """TE's scale from an amax history: ``fp8_max / max(history) / 2**margin`` over its finite
    entries, or 1 while it holds no positive finite amax (a fresh history). An inf or NaN
    recorded by an overflowing step is skipped: TE's ``_default_sf_compute`` would keep its
    previous scale, which a history alone does not hold.

    >>> delayed_scale(torch.tensor([2.0, 4.0, 0.0]), "fp8_e4m3")
    tensor(112.)
    >>> delayed_scale(torch.tensor([float("nan"), 2.0, 4.0]), "fp8_e4m3")
    tensor(112.)
    """
    finite = torch.where(torch.isfinite(history), history, 0.0)
    amax = finite.amax(dim=-1)
    usable = amax > 0
    return torch.where(usable, spec(fmt).max / torch.where(usable, amax, 1.0) / 2.0**margin, 1.0)


def _along_last(x: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """Block-quantize ``x`` along ``dim``, zero-padding that dimension to whole blocks."""
    block = spec(fmt).block_size
    moved = x.movedim(dim, -1)
    length = moved.shape[-1]
    pad = -length % block
    if pad:
        moved = F.pad(moved, (0, pad))
    return quantize(moved, fmt)[..., :length].movedim(-1, dim)


def quantize_operand(
    x: torch.Tensor, fmt: str, dim: int = -1, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 values a low-precision GEMM sees for operand ``x``.

    Per-tensor formats: ``quantize(x * scale, fmt, saturate=True) / scale`` with ``scale``
    given, else ``fp8_max / amax(x)`` (current scaling). Block formats: blocks along ``dim``,
    the reduction dimension of the GEMM.

    >>> quantize_operand(torch.tensor([1.0, 3.0, 448.0]), "fp8_e4m3", scale=torch.tensor(1.0))
    tensor([  1.,   3., 448.])
    """
    x = x.float()
    if fmt in BLOCK:
        return _along_last(x, fmt, dim)
    if scale is None:
        scale = delayed_scale(x.abs().amax().reshape(1), fmt)
    codes = _fp8_codes(x * scale, fmt)
    decoded = _decode_div(codes, fmt, scale)
    return codes.float() / scale if decoded is None else decoded


_FAST_DECODE_MIN = 16384  # elements: below, the kernel call costs more than torch's cast


def _decode_div(codes: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor | None:
    """``codes.float() / scale`` through the streaming kernels' table lookup, bit for bit (the
    fp8 -> float32 cast is a slow scalar loop in torch), or None where torch's ops must run:
    small tensors, under a torch.func transform, and whatever :func:`streaming.decode_div`
    refuses (a scale of more than one element, counters, fake tensors)."""
    functorch = torch._C._functorch
    if (codes.numel() < _FAST_DECODE_MIN or functorch.is_functorch_wrapped_tensor(codes)
            or functorch.is_functorch_wrapped_tensor(scale)):
        return None
    from minitrain.optim.kernels import streaming

    return streaming.decode_div(codes, _decode_table(fmt), scale)


@functools.cache
def _decode_table(fmt: str) -> torch.Tensor:
    """The float32 value of each of the format's 256 codes (torch's own cast)."""
    return torch.arange(256, dtype=torch.uint8).view(_TORCH_FP8[fmt]).float()


def scaled_mm_operands(
    a: torch.Tensor, b: torch.Tensor, formats: tuple[str, str], scales: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The arguments of ``torch._scaled_mm`` for ``a (M, K) @ b (K, N)``: ``a`` in fp8 row-major,
    ``b`` in fp8 column-major (cuBLASLt's layout), and the dequantization scales ``1 / scale``.
    The fp8 codes are those :func:`quantize_operand` rounds to.

    >>> a8, b8, ia, ib = scaled_mm_operands(torch.ones(16, 32), torch.ones(32, 16),
    ...     ("fp8_e4m3", "fp8_e4m3"), (torch.tensor(2.0), torch.tensor(4.0)))
    >>> a8.dtype, b8.stride(), ia.item(), ib.item()
    (torch.float8_e4m3fn, (1, 32), 0.5, 0.25)
    """
    (fa, fb), (sa, sb) = formats, scales
    a8 = (a.float() * sa).clamp(-spec(fa).max, spec(fa).max).to(_TORCH_FP8[fa])
    b8 = (b.float() * sb).clamp(-spec(fb).max, spec(fb).max).to(_TORCH_FP8[fb])
    return a8.contiguous(), b8.mT.contiguous().mT, sa.reciprocal(), sb.reciprocal()


def _gemm(a, b, formats, scales, r: Recipe, qa, qb) -> torch.Tensor:
    """``qa @ qb`` in fp32, or the same product on fp8 tensor cores for ``gemm="scaled_mm"``
    (2-D operands whose dimensions are multiples of 16, as cuBLASLt needs; others simulate)."""
    dims = (*a.shape, b.shape[-1])
    if r.gemm == "scaled_mm" and a.ndim == 2 and b.ndim == 2 and all(d % 16 == 0 for d in dims):
        a8, b8, ia, ib = scaled_mm_operands(a, b, formats, scales)
        return torch._scaled_mm(a8, b8, scale_a=ia, scale_b=ib, out_dtype=torch.float32)
    return qa @ qb


# ---------------------------------------------------------------------------------------------
# The matmul: forward and backward GEMMs in low precision, fp32 accumulation


def _record(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Newest amax first, oldest dropped (TE rolls its ``amax_history`` the same way)."""
    return torch.cat([amax.reshape(1), history[:-1]])


class _LowPrecisionMatmul(torch.autograd.Function):
    """``a @ b`` for ``a (..., M, K)``, ``b (..., K, N)`` (same batch dims, or ``b`` 2-D with
    ``a`` 2-D), with the forward and both backward GEMMs on quantized operands."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, history, r: Recipe):
        a32, b32 = a.float(), b.float()
        one = torch.ones((), device=a.device)
        with _bypass(), torch.autocast(a.device.type, enabled=False):
            if r.forward in BLOCK:
                qa = quantize_operand(a32, r.forward, -1)
                qb = quantize_operand(b32, r.forward, -2)
                return (
                    (qa @ qb).to(torch.promote_types(a.dtype, b.dtype)),
                    qa,
                    qb,
                    history,
                    one.expand(2),
                )
            fmt = r.forward
            if history is None:  # current scaling
                sa = delayed_scale(a32.abs().amax().reshape(1), fmt, r.margin)
                sb = delayed_scale(b32.abs().amax().reshape(1), fmt, r.margin)
                new_history = None
            else:
                sa = delayed_scale(history[0], fmt, r.margin)
                sb = delayed_scale(history[1], fmt, r.margin)
                amax_a, amax_b = a32.abs().amax(), b32.abs().amax()
                rows = [_record(history[0], amax_a), _record(history[1], amax_b), history[2]]
                new_history = torch.stack(rows)
            qa, qb = quantize_operand(a32, fmt, scale=sa), quantize_operand(b32, fmt, scale=sb)
            y = _gemm(a32, b32, (fmt, fmt), (sa, sb), r, qa, qb)
        return (
            y.to(torch.promote_types(a.dtype, b.dtype)),
            qa,
            qb,
            new_history,
            torch.stack([sa, sb]),
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, history, r = inputs
        _, qa, qb, new_history, scales = output
        ctx.recipe = r
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.has_history = history is not None
        ctx.save_for_backward(a, b, qa, qb, new_history, scales)
        ctx.mark_non_differentiable(qa, qb, scales)

    @staticmethod
    def backward(ctx, grad_y, _qa, _qb, _history, _scales):
        a, b, qa, qb, history, scales = ctx.saved_tensors
        sa, sb = scales[0], scales[1]
        r = ctx.recipe
        g = grad_y.float()
        new_history = None
        with _bypass(), torch.autocast(g.device.type, enabled=False):
            if r.forward in BLOCK:
                ga = quantize_operand(g, r.backward, -1) @ quantize_operand(b, r.forward, -1).mT
                gb = quantize_operand(a, r.forward, -2).mT @ quantize_operand(g, r.backward, -2)
            else:
                if history is None:
                    sg = delayed_scale(g.abs().amax().reshape(1), r.backward, r.margin)
                else:
                    sg = delayed_scale(history[2], r.backward, r.margin)
                if ctx.has_history:  # the "gradient" of the state is the updated state
                    g_row = _record(history[2], g.abs().amax())
                    new_history = torch.stack([history[0], history[1], g_row])
                qg = quantize_operand(g, r.backward, scale=sg)
                fmts = (r.backward, r.forward)
                ga = _gemm(g, b.float().mT, fmts, (sg, sb), r, qg, qb.mT)
                gb = _gemm(a.float().mT, g, fmts[::-1], (sa, sg), r, qa.mT, qg)
        return ga.to(ctx.dtypes[0]), gb.to(ctx.dtypes[1]), new_history, None


def matmul(
    a: torch.Tensor, b: torch.Tensor, r: Recipe | str, history: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.matmul(a, b)`` with quantized operands and fp32 accumulation.

    ``history`` is this matmul's amax history ``(3, history_len)`` (delayed fp8 scaling), or
    None for current scaling; its gradient is the updated history.

    >>> a, b = torch.randn(2, 3, 32), torch.randn(32, 4)
    >>> matmul(a, b, "mxfp8").shape
    torch.Size([2, 3, 4])
    """
    return _matmul(a, b, r, history)[0]


# Under torch.compile the simulated matmul runs eager (a graph break around each one): dynamo
# cannot trace this autograd.Function ("Expected FakeTensor", torch 2.13); the rest compiles.
# torch's lazy form of torch.compiler.disable imports dynamo (0.8 s) on the first call, not
# when minitrain is imported.
@getattr(torch, "_disable_dynamo", torch.compiler.disable)
def _matmul(a: torch.Tensor, b: torch.Tensor, r: Recipe | str,
            history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`matmul`, and the history with this forward pass's operand amaxes recorded
    (rows 0 and 1; row 2, the output gradient's, as it was), None without a history."""
    r = recipe(r)
    squeeze = []
    if a.ndim == 1:
        a, squeeze = a.unsqueeze(0), [*squeeze, -2]
    if b.ndim == 1:
        b, squeeze = b.unsqueeze(-1), [*squeeze, -1]
    with _bypass():
        if b.ndim == 2:  # fold a's batch dims into M: one GEMM, as F.linear runs it
            lead = a.shape[:-1]
            y, _, _, recorded, _ = _LowPrecisionMatmul.apply(
                a.reshape(-1, a.shape[-1]), b, history, r)
            y = y.reshape(*lead, b.shape[-1])
        else:
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            a = a.expand(*batch, *a.shape[-2:])
            b = b.expand(*batch, *b.shape[-2:])
            y, _, _, recorded, _ = _LowPrecisionMatmul.apply(a, b, history, r)
    for dim in squeeze:
        y = y.squeeze(dim)
    return y, None if history is None else recorded.detach()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    r: Recipe | str,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``weight`` is ``(out, in)``) with quantized operands;
    the bias is added in fp32."""
    return _linear(x, weight, bias, r, history)[0]


def _linear(x, weight, bias, r, history):
    y, recorded = _matmul(x, weight.mT, r, history)
    return (y if bias is None else y + bias), recorded


# ---------------------------------------------------------------------------------------------
# The mode: every matmul of a model, unchanged


_BYPASS = [0]  # > 0 while our own GEMMs run: the mode lets them through


@contextlib.contextmanager
def _bypass() -> Iterator[None]:
    _BYPASS[0] += 1
    try:
        yield
    finally:
        _BYPASS[0] -= 1


_MATMULS = {
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.bmm,
    torch.Tensor.bmm,
}


def _levels(t: torch.Tensor, batched: bool) -> list[int]:
    """The functorch levels of ``t``'s vmap (``batched``) or grad wrappers."""
    functorch, levels = torch._C._functorch, []
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t) == batched:
            levels.append(functorch.maybe_get_level(t))
        t = functorch.get_unwrapped(t)
    return levels


def _vmapped_inside(history: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether an operand is batched by a ``vmap`` inside the function that differentiates
    ``history`` (per-example grads, MAML's inner loop): that history's gradient would be summed
    over the vmapped batch instead of recording one amax. Levels grow inward."""
    grad_level = max(_levels(history, batched=False), default=0)
    return any(level > grad_level for t in operands for level in _levels(t, batched=True))


def _is_float(*tensors: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors)


class _Simulate(TorchFunctionMode):
    def __init__(self, r: Recipe, state: torch.Tensor | None, count_only: bool = False,
                 first_call: int = 0):
        super().__init__()
        self.recipe, self.state, self.count_only, self.calls = r, state, count_only, first_call
        self.recorded: dict[int, torch.Tensor] = {}  # matmul index -> its forward amaxes

    def forward_history(self) -> torch.Tensor | None:
        """The state with every matmul's forward amaxes recorded as this forward pass saw
        them (rows 0 and 1 of each matmul that ran with a history; the rest as they were),
        detached; None without a state. The gradient of the state holds the same rows and the
        output gradient's amax, but only for matmuls whose backward pass ran: a matmul whose
        output never reaches the loss gets its forward amaxes from here (Transformer Engine
        records forward amaxes in the forward pass)."""
        if self.state is None:
            return None
        state = self.state.detach()
        rows = [self.recorded.get(i, state[i]) for i in range(state.shape[0])]
        return torch.stack(rows) if rows else state.clone()  # a model without matmuls

    def _history(self, *operands: torch.Tensor) -> torch.Tensor | None:
        """Matmul ``i``'s amax history (row ``i`` of the state), or None for current scaling:
        without a state, and for a matmul vmapped inside the loss (its row stays as it was)."""
        index, self.calls = self.calls, self.calls + 1
        if self.state is None or self.count_only or _vmapped_inside(self.state, *operands):
            return None
        if index >= self.state.shape[0]:
            raise ValueError(
                f"the model ran more matmuls than the {self.state.shape[0]} its fp8 amax "
                "histories were counted for: delayed fp8 scaling needs the same matmuls in every "
                "forward pass (count them with count_matmuls(fn, *args), build the state with "
                "init_state)"
            )
        return self.state[index]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _BYPASS[0]:
            return func(*args, **kwargs)
        if func is F.linear and _is_float(*args[:2]):
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            history = self._history(x, weight)
            if self.count_only:
                return func(*args, **kwargs)
            y, recorded = _linear(x, weight, bias, self.recipe, history)
            return self._keep(recorded, y)
        if func in _MATMULS and _is_float(*args[:2]) and not kwargs:
            history = self._history(args[0], args[1])
            if self.count_only:
                return func(*args, **kwargs)
            return self._keep(*_matmul(args[0], args[1], self.recipe, history)[::-1])
        return func(*args, **kwargs)

    def _keep(self, recorded: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
        if recorded is not None:
            self.recorded[self.calls - 1] = recorded
        return y


# ---------------------------------------------------------------------------------------------
# Activation checkpointing: the recomputation replays the simulated matmuls


def _innermost_simulation() -> _Simulate | None:
    from torch.overrides import _get_current_function_mode_stack

    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, _Simulate)]
    return modes[-1] if modes and not modes[-1].count_only else None


class _Replay:
    """The recomputation's context: ``recompute`` (the caller's), then a simulation that
    starts at the matmul the checkpointed region started at, so that it reads the same amax
    history rows of the same state and saves the same tensors as the forward pass did. Fresh
    on every entry (a graph kept with ``retain_graph`` recomputes once per backward pass)."""

    def __init__(self, recompute: Any, mode: _Simulate) -> None:
        self.recompute, self.recipe, self.state = recompute, mode.recipe, mode.state
        self.first_call = mode.calls
        self.stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.recompute)
        stack.enter_context(_Simulate(self.recipe, self.state, first_call=self.first_call))
        self.stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return self.stacks.pop().__exit__(*exc)


def _replaying_contexts(mode: _Simulate, context_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``context_fn()``'s forward context, and its recomputation context under a replay."""
    forward, recompute = context_fn()
    return forward, _Replay(recompute, mode)


def _checkpoint_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's non-reentrant checkpoint, which recomputes the region in the backward pass,
    outside :func:`simulate`, as it re-enters the device context of the forward pass: with a
    simulation active, the recomputation runs under one too (see :func:`_replaying_contexts`).
    """

    @functools.wraps(original)
    def generator(fn, preserve_rng_state=True, context_fn=None, *rest, **kwargs):
        import torch.utils.checkpoint as checkpoint

        context_fn = checkpoint.noop_context_fn if context_fn is None else context_fn
        mode = _innermost_simulation()
        # torch's own rules: a global debug setting wins over the argument (rest[1]); a traced
        # region (make_fx, export: a proxy mode) takes only dispatch modes from context_fn
        debug = getattr(checkpoint, "_checkpoint_debug_enabled", None)
        debug = bool(rest[1:2] and rest[1]) if debug is None else debug
        traced = getattr(checkpoint, "_is_compiling", lambda *a: False)(fn, (), {})
        if mode is not None and not debug and not traced and not torch.compiler.is_compiling():
            context_fn = functools.partial(_replaying_contexts, mode, context_fn)
        return original(fn, preserve_rng_state, context_fn, *rest, **kwargs)

    generator.minitrain_replays = True  # type: ignore[attr-defined]
    return generator


def _refusing_reentrant(original: type) -> type:
    """torch's reentrant checkpoint, refused inside a simulation: its recomputation runs in
    the backward pass with no hook to replay the simulated matmuls, so the region's grads
    would silently be those of full-precision matmuls."""

    class CheckpointFunction(original):  # type: ignore[misc, valid-type]
        minitrain_refuses = True

        @staticmethod
        def forward(ctx, run_function, preserve_rng_state, *args):
            if _innermost_simulation() is not None:
                raise ValueError(
                    "torch.utils.checkpoint with use_reentrant=True (torch's default) recomputes "
                    "outside the simulated low-precision matmuls; pass use_reentrant=False"
                )
            return original.forward(ctx, run_function, preserve_rng_state, *args)

    return CheckpointFunction


def _install_checkpoint_replay() -> None:
    import torch.utils.checkpoint as checkpoint

    original = getattr(checkpoint, "_checkpoint_without_reentrant_generator", None)
    if original is not None and not getattr(original, "minitrain_replays", False):
        checkpoint._checkpoint_without_reentrant_generator = _checkpoint_generator(original)
    reentrant = getattr(checkpoint, "CheckpointFunction", None)
    if reentrant is not None and not getattr(reentrant, "minitrain_refuses", False):
        checkpoint.CheckpointFunction = _refusing_reentrant(reentrant)


@contextlib.contextmanager
def simulate(r: Recipe | str, state: torch.Tensor | None = None) -> Iterator[Any]:
    """Run every ``F.linear`` / ``matmul`` / ``@`` / ``mm`` / ``bmm`` inside in low precision.

    ``state`` (from :func:`init_state`) turns on delayed scaling for the fp8 recipe: matmul
    ``i`` of the forward pass reads row ``i``; differentiate with respect to ``state`` to get
    the updated histories (the context's value has ``forward_history()``, the forward amaxes
    alone, for matmuls whose backward pass does not run). Without it, fp8 uses current
    scaling. Other ops (attention inside ``F.scaled_dot_product_attention``, norms, softmax)
    keep their precision, as in TE.

    >>> a = torch.tensor([[1.0, 3.3]])
    >>> with simulate("fp8"):
    ...     (a @ torch.eye(2)).tolist()  # x 448 / 3.3: 1.0 -> 135.8 -> 128 in e4m3 -> 0.943
    [[0.9428570866584778, 3.299999713897705]]
    """
    r = recipe(r)
    if state is not None and r.forward in BLOCK:
        raise ValueError("block formats take their scales from the blocks: pass state=None")
    _install_checkpoint_replay()
    mode = _Simulate(r, state)
    with mode:
        yield mode
    if state is not None and mode.calls < state.shape[0]:  # matmul i would read row i + k
        raise ValueError(
            f"the model ran {mode.calls} matmuls, fewer than the {state.shape[0]} its fp8 amax "
            "histories were counted for: delayed fp8 scaling needs the same matmuls in every "
            "forward pass (count them with count_matmuls(fn, *args), build the state with "
            "init_state)"
        )


def count_matmuls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """How many matmuls ``fn(*args, **kwargs)`` runs (one plain forward pass, in the grad mode
    a train step runs it in: a model may branch on ``torch.is_grad_enabled()``; plain tensor
    arguments build no graph).

    >>> count_matmuls(lambda x: x @ x @ x, torch.eye(2))
    2
    """
    mode = _Simulate(RECIPES["fp8"], None, count_only=True)
    with torch.enable_grad(), mode:
        fn(*args, **kwargs)
    return mode.calls


def init_state(r: Recipe | str, num_matmuls: int) -> torch.Tensor:
    """Empty amax histories ``(num_matmuls, 3, history_len)``: the first step scales by 1, as
    TE's fresh ``DelayedScaling`` does.

    >>> init_state("fp8", 4).shape
    torch.Size([4, 3, 16])
    """
    r = recipe(r)
    if r.forward in BLOCK:
        raise ValueError(f"{r.forward} keeps no amax history; simulate it with state=None")
    return torch.zeros(num_matmuls, 3, r.history_len)
