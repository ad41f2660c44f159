"""Tensor lifetimes of one traced step: what is allocated when, what frees it, the peak.

:class:`Lifetimes` is a ``TorchDispatchMode`` that sits beneath :class:`~minitrain.accounting.
Counter` (so it sees every op the counter counts, decomposed ones included) and above the fake
tensor mode. Each storage is allocated once, at the first op that outputs it (its
``nbytes``), and freed when its last reference dies (a ``weakref.finalize`` on the storage,
which PyTorch keeps as one Python object per storage). A storage first met as an op *input*
was made outside the step (module buffers, constants): it counts from then on, as a buffer.
Several storages may stand for one allocation (:meth:`Lifetimes.alias`: the same tensor seen
as a fake tensor in the forward pass and as a meta tensor in the update).

Categories are decided at the end (:meth:`Lifetimes.categories`), when it is known which
tensors were saved for backward and which became grads or new params, then the event log is
replayed (:func:`replay`) into a timeline and the peak.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.module_tracker import ModuleTracker

from minitrain import _torch
from minitrain._torch import TorchDispatchMode
from minitrain.accounting.op_formulas import tensors
from minitrain.accounting.timeline import CATEGORIES, innermost

__all__ = ["Allocation", "Lifetimes", "Replay", "replay"]

_SAMPLE = -1  # an event marking "sample the live bytes after this op"


@dataclass
class Allocation:
    """One storage (or several aliases of one) over its life in the step."""

    index: int
    nbytes: int
    phase: str  # phase of the op that created it ("input" for step inputs)
    op: str  # the op that created it ("" for step inputs and buffers)
    module: str  # innermost module active at creation
    shape: tuple[int, ...]
    dtype: str
    category: str | None = None  # fixed at registration (inputs) or decided at the end
    saved: bool = False  # alive when the backward pass started, made by the forward pass
    handles: int = 0  # live storages standing for it


def _storage(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return None


def _returns_nothing(func: Any) -> bool:
    return not func._schema.returns


class Lifetimes(TorchDispatchMode):
    """Record allocations and frees of every storage, op by op (see the module docstring).

    ``phase`` is set by the caller between phases; the backward pass is detected by the
    autograd engine running the op (its first op closes the forward pass and marks every
    storage the forward pass made and that is still alive as saved for backward).
    """

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[Allocation] = []
        self.events: list[tuple[int, int]] = []  # (allocation index, +1/-1) or (_SAMPLE, op)
        self.ops: list[tuple[str, str, str]] = []  # per op: (name, phase, module)
        self.phase = "forward"
        self.backward_started = False
        self._by_storage: dict[int, Allocation] = {}
        self._modules = ModuleTracker()
        self._backward_module = ""
        self._finalizers: list[weakref.finalize] = []

    # -- context: the module tracker goes with the mode ------------------------------------
    def __enter__(self) -> Lifetimes:
        self._modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._modules.__exit__(*exc)

    def module(self) -> str:
        return innermost(set(self._modules.parents))

    # -- bookkeeping -------------------------------------------------------------------------
    def register(self, tree: Any, category: str) -> None:
        """Count the storages of ``tree`` as live from now on, in ``category``."""
        for t in tensors(tree):
            self._see(t, phase="input", op="", category=category)

    def alias(self, new: Any, old: Any) -> None:
        """Let each tensor of ``new`` stand for the allocation of its twin in ``old``."""
        for a, b in zip(tensors(new), tensors(old), strict=True):
            target = self._find(b)
            storage = _storage(a)
            if target is None or storage is None or storage._cdata in self._by_storage:
                continue
            self._hold(storage, target)

    def _find(self, t: torch.Tensor) -> Allocation | None:
        storage = _storage(t)
        return None if storage is None else self._by_storage.get(storage._cdata)

    def _hold(self, storage: Any, allocation: Allocation) -> None:
        key = storage._cdata
        self._by_storage[key] = allocation
        allocation.handles += 1
        self._finalizers.append(weakref.finalize(storage, self._release, key))

    def _see(self, t: torch.Tensor, *, phase: str, op: str, category: str | None) -> None:
        storage = _storage(t)
        if storage is None or storage._cdata in self._by_storage:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        allocation = Allocation(
            index=len(self.allocations), nbytes=nbytes, phase=phase, op=op,
            module=self.module(), shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
            category=category,
        )
        self.allocations.append(allocation)
        self._hold(storage, allocation)
        self.events.append((allocation.index, 1))

    def _release(self, key: int) -> None:
        allocation = self._by_storage.pop(key, None)
        if allocation is None:
            return
        allocation.handles -= 1
        if allocation.handles == 0:
            self.events.append((allocation.index, -1))

    def close(self) -> None:
        """Stop watching: storages that outlive the step no longer call back."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def live(self) -> list[Allocation]:
        """Allocations alive now."""
        return list({id(a): a for a in self._by_storage.values()}.values())

    def mark_saved(self) -> None:
        """The forward pass ends: what it made and is still alive was saved for backward."""
        self.backward_started = True
        for allocation in self.live():
            if allocation.phase == "forward" and allocation.category is None:
                allocation.saved = True

    def categorize(self, tree: Any, category: str) -> None:
        """Put the allocations behind ``tree`` (grads, new params...) in ``category``,
        unless an input category already holds them (a donated update writes in place)."""
        for t in tensors(tree):
            allocation = self._find(t)
            if allocation is not None and allocation.phase != "input":
                allocation.category = category

    def _op_module(self, inputs: list[torch.Tensor]) -> str:
        """The module of an op: the active one in the forward pass; in the backward pass (where
        module hooks do not fire under ``torch.func`` transforms), the module whose saved
        tensors the op reads, or else the one the last such op read."""
        if self.phase != "backward":
            return self.module()
        modules = [a.module for a in map(self._find, inputs) if a is not None and a.saved]
        if modules:
            self._backward_module = innermost(set(modules))
        return self._backward_module or self.module()

    # -- the mode ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.backward_started and _torch.current_autograd_node() is not None:
            self.mark_saved()
            self.phase = "backward"
        inputs = tensors((args, kwargs))
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:
            # An in-place kernel with no meta implementation (torch's _fused_sgd_,
            # _fused_adagrad_): on meta tensors an in-place write changes no shape, no byte.
            if not (inputs and all(t.is_meta for t in inputs) and _returns_nothing(func)):
                raise
            out = None
        name = str(func._overloadpacket)
        self.ops.append((name, self.phase, self._op_module(inputs)))
        for t in inputs:
            self._see(t, phase="input", op="", category="buffers")
        for t in tensors(out):
            self._see(t, phase=self.phase, op=name, category=None)
        self.events.append((_SAMPLE, len(self.ops) - 1))
        return out


class Replay:
    """The event log replayed by category: ``timeline``, the peak and what it holds."""

    def __init__(self) -> None:
        self.timeline: list[tuple[int, str, dict[str, int]]] = []
        self.peak_bytes = 0
        self.peak_op = -1
        self.at_peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.largest: dict[str, int] = dict.fromkeys(CATEGORIES, 0)  # per category, any time


def category(allocation: Allocation) -> str:
    """The final category of an allocation."""
    if allocation.category is not None:
        return allocation.category
    return "activations" if allocation.saved else "temporaries"


def replay(lifetimes: Lifetimes) -> Replay:
    """Live bytes per category after every op, and the highest total (and its op)."""
    result = Replay()
    live = dict.fromkeys(CATEGORIES, 0)
    total = 0
    last_op = -1
    kinds = [category(a) for a in lifetimes.allocations]
    for index, sign in lifetimes.events:
        if index == _SAMPLE:
            last_op = sign
            _, phase, _ = lifetimes.ops[sign]
            result.timeline.append((sign, phase, {k: v for k, v in live.items() if v}))
            continue
        nbytes = lifetimes.allocations[index].nbytes
        kind = kinds[index]
        live[kind] += sign * nbytes
        total += sign * nbytes
        result.largest[kind] = max(result.largest[kind], live[kind])
        if total > result.peak_bytes:
            result.peak_bytes = total
            # An allocation belongs to the op whose outputs are being registered: the next
            # sample's op when inside an op, else the last op seen.
            result.peak_op = last_op + 1 if last_op + 1 < len(lifetimes.ops) else last_op
            result.at_peak = dict(live)
    return result
