"""Every matmul of a model in a simulated low-precision format, checkpointing included.

Inside :func:`simulate`, a ``TorchFunctionMode`` routes ``F.linear``, ``matmul``, ``@``, ``mm``
and ``bmm`` through :mod:`minitrain.precision.matmuls`, so any model runs unchanged (also under
``vmap``). Matmul ``i`` of a forward pass reads row ``i`` of the amax histories of delayed fp8
scaling (:func:`init_state`, :func:`count_matmuls`); :func:`recompute_context` makes
``torch.utils.checkpoint`` recompute inside the simulation.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from minitrain import _torch
from minitrain.precision.matmuls import BLOCK, RECIPES, Recipe, bypassing, recipe, recording_matmul

__all__ = ["count_matmuls", "init_state", "recompute_context", "simulate"]

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
            torch.bmm, torch.Tensor.bmm}


def _levels(t: torch.Tensor, batched: bool) -> list[int]:
    """The functorch levels of ``t``'s vmap (``batched``) or grad wrappers."""
    levels = []
    while _torch.is_functorch_wrapped_tensor(t):
        if _torch.is_batchedtensor(t) == batched:
            levels.append(_torch.maybe_get_level(t))
        t = _torch.get_unwrapped(t)
    return levels


def _vmapped_inside(history: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether an operand is batched by a ``vmap`` inside the function that differentiates
    ``history`` (per-example grads): its gradient would sum over the batch (levels grow inward)."""
    grad_level = max(_levels(history, batched=False), default=0)
    return any(level > grad_level for t in operands for level in _levels(t, batched=True))


def _is_float(*tensors: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors)


def _mismatch(ran: str, counted: int) -> ValueError:
    return ValueError(
        f"the model ran {ran} the {counted} its fp8 amax histories were counted for: delayed "
        "fp8 scaling needs the same matmuls in every forward pass (count them with "
        "count_matmuls(fn, *args), build the state with init_state)"
    )


class _Simulate(TorchFunctionMode):
    """Routes every float matmul through the recipe; ``count_only`` counts them instead."""

    def __init__(self, r: Recipe, state: torch.Tensor | None, count_only: bool = False,
                 first_call: int = 0):
        super().__init__()
        self.recipe, self.state, self.count_only, self.calls = r, state, count_only, first_call
        self.recorded: dict[int, torch.Tensor] = {}  # matmul index -> its forward amaxes

    def forward_history(self) -> torch.Tensor | None:
        """The state (detached) with the forward amaxes this pass saw recorded, None without
        one: for a matmul whose output never reaches the loss, whose gradient holds nothing
        (TE records forward amaxes in the forward pass)."""
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
            raise _mismatch("more matmuls than", self.state.shape[0])
        return self.state[index]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if bypassing():
            return func(*args, **kwargs)
        linear = func is F.linear
        if not ((linear or (func in _MATMULS and not kwargs)) and _is_float(*args[:2])):
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        history = self._history(a, b)
        if self.count_only:
            return func(*args, **kwargs)
        _refuse_reentrant_checkpoint()
        # F.linear(x, weight, bias) is x @ weight.T, the bias added in fp32
        y, recorded = recording_matmul(a, b.mT if linear else b, self.recipe, history)
        if recorded is not None:
            self.recorded[self.calls - 1] = recorded
        bias = args[2] if linear and len(args) > 2 else kwargs.get("bias")
        return y if bias is None else y + bias


def _innermost() -> _Simulate | None:
    """The innermost simulation this thread is in (the function mode stack is per thread)."""
    modes = [mode for mode in _torch.get_current_function_mode_stack()
             if isinstance(mode, _Simulate) and not mode.count_only]
    return modes[-1] if modes else None


class _Replay:
    """The recomputation's context: ``recompute`` (the caller's), then a simulation from the
    region's first matmul (the same history rows, the same saved tensors); fresh on every
    entry (a graph kept with ``retain_graph`` recomputes once per backward pass)."""

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


def recompute_context(context_fn: Callable[[], tuple[Any, Any]] | None = None
                      ) -> tuple[Any, Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that recomputes the region inside the simulation it ran in, so grads and histories equal
    the run without checkpointing bit for bit (without it, torch's checkpoint stops with a
    ``CheckpointError``). ``context_fn``: the caller's own, kept around it.

    >>> from torch.utils.checkpoint import checkpoint
    >>> w = torch.randn(32, 32, requires_grad=True)
    >>> with simulate("fp8"):
    ...     y = checkpoint(lambda x: torch.relu(x @ w), torch.randn(4, 32), use_reentrant=False,
    ...                    context_fn=recompute_context)
    >>> y.sum().backward()  # recomputes x @ w in fp8, as the forward pass ran it
    """
    if context_fn is None:
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
    else:
        forward, recompute = context_fn()
    mode = _innermost()
    if mode is None or torch.compiler.is_compiling():
        return forward, recompute
    return forward, _Replay(recompute, mode)


def _refuse_reentrant_checkpoint() -> None:
    """A reentrant ``torch.utils.checkpoint`` runs its region under ``no_grad`` and recomputes
    it with no hook to re-enter the simulation: its grads would silently be full precision."""
    if torch.is_grad_enabled():
        return
    checkpoint = sys.modules.get("torch.utils.checkpoint")  # not imported: none is running
    reentrant = getattr(checkpoint, "CheckpointFunction", None)
    code = getattr(getattr(reentrant, "forward", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            raise ValueError(
                "torch.utils.checkpoint with use_reentrant=True recomputes outside the simulated "
                "low-precision matmuls; pass use_reentrant=False and "
                "context_fn=minitrain.precision.recompute_context"
            )
        frame = frame.f_back


@contextlib.contextmanager
def simulate(r: Recipe | str, state: torch.Tensor | None = None) -> Iterator[Any]:
    """Run every ``F.linear`` / ``matmul`` / ``@`` / ``mm`` / ``bmm`` inside in low precision.

    ``state`` (:func:`init_state`) turns on delayed fp8 scaling: matmul ``i`` reads row ``i``,
    and the gradient with respect to ``state`` is the updated histories (the context's
    ``forward_history()`` has the forward amaxes alone). Other ops keep their precision, as in TE.

    >>> with simulate(RECIPES["fp8"]):  # x 448 / 3.3: 1.0 -> 135.8 -> 128 in e4m3 -> 0.943
    ...     (torch.tensor([[1.0, 3.3]]) @ torch.eye(2)).tolist()
    [[0.9428570866584778, 3.299999713897705]]
    """
    r = recipe(r)
    if state is not None and r.forward in BLOCK:
        raise ValueError("block formats take their scales from the blocks: pass state=None")
    with _Simulate(r, state) as mode:
        yield mode
    if state is not None and mode.calls < state.shape[0]:  # matmul i would read row i + k
        raise _mismatch(f"{mode.calls} matmuls, fewer than", state.shape[0])


def count_matmuls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """How many matmuls ``fn(*args, **kwargs)`` runs (one plain forward pass, grad enabled as
    in a train step).

    >>> count_matmuls(lambda x: x @ x @ x, torch.eye(2))
    2
    """
    mode = _Simulate(RECIPES["fp8"], None, count_only=True)
    with torch.enable_grad(), mode:
        fn(*args, **kwargs)
    return mode.calls


def init_state(r: Recipe | str, num_matmuls: int) -> torch.Tensor:
    """Empty amax histories ``(num_matmuls, 3, history_len)``: the first step scales by 1, as
    TE's does.

    >>> init_state("fp8", 4).shape
    torch.Size([4, 3, 16])
    """
    r = recipe(r)
    if r.forward in BLOCK:
        raise ValueError(f"{r.forward} keeps no amax history; simulate it with state=None")
    return torch.zeros(num_matmuls, 3, r.history_len)
