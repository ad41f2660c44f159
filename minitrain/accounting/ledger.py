"""Live memory over one step, by category: the ledger of every storage's life.

A :class:`Ledger` counts each storage from the first op that makes or reads it to the death of
its last reference, and replays its event log at the end for the peak and what each category
held then. A storage's category: the one given (``Counter.track``, ``categorize``);
``activations`` if saved for backward (by a pack hook, else made by the forward pass and alive
when the backward starts); else ``temporaries``.

>>> import torch, minitrain as mt
>>> from minitrain.accounting import Counter
>>> w = torch.ones(256, 256)
>>> with Counter(watch_saved=True) as c:
...     c.track(w, category="params")
...     loss, grads = mt.value_and_grad(lambda w: w.tanh().sum())(w)
>>> c.live_at_backward  # the tanh output saved, the 0-d loss a temporary
{'params': 262144, 'activations': 262144, 'temporaries': 8}
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from minitrain import _torch
from minitrain.accounting.op_formulas import tensors
from minitrain.errors import UserError

__all__ = ["CATEGORIES", "Allocation", "Ledger", "Replay", "innermost"]

CATEGORIES = ("params", "grads", "optimizer_state", "batch", "buffers", "activations",
              "temporaries")
_OP = -1  # an event "op number i has run"


def innermost(parents: set[str]) -> str:
    """The deepest module path among ``parents`` (``"Global"`` outside any module)."""
    return max(parents, key=lambda p: (p != "Global", p.count("."), len(p)), default="Global")


@dataclass
class Allocation:
    """One storage (or the twins standing for it) over its life in the step."""

    index: int
    nbytes: int
    phase: str  # of the op that made it; "input" for what the step was given
    op: str  # the op that made it ("" for inputs)
    module: str  # the innermost module active then
    shape: tuple[int, ...]
    dtype: str
    category: str | None = None
    saved: bool = False  # saved for the backward pass
    handles: int = 0  # live storages standing for it


@dataclass
class Replay:
    """The event log replayed: the peak, its op and what each category holds."""

    peak_bytes: int = 0
    peak_op: int = -1
    at_peak: dict[str, int] = field(default_factory=dict)
    largest: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))


class Ledger:
    """Live storages and their event log (see the module docstring). ``fake``: count meta and
    fake storages (a prediction); ``inputs``: the category of a storage first met as an op's
    input (made before the step)."""

    def __init__(self, *, fake: bool = False, inputs: str | None = None) -> None:
        self.fake, self.inputs = fake, inputs
        self.allocations: list[Allocation] = []
        self.events: list[tuple[int, int]] = []  # (allocation, +1 or -1) or (_OP, op index)
        self.ops: list[tuple[str, str, str]] = []  # per op: (name, phase, module)
        self.live = self.peak = 0
        self.any_saved = False
        self._by_storage: dict[int, Allocation] = {}
        self._finalizers: list[weakref.finalize] = []
        self._backward_module = ""

    def _storage(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return None
        while _torch.is_functorch_wrapped_tensor(t):  # the tensor a dispatch mode sees
            t = _torch.get_unwrapped(t)
        if t.layout != torch.strided or (t.is_meta and not self.fake):
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            return None
        if storage.nbytes() == 0 or (not self.fake and storage.data_ptr() == 0):
            return None
        return storage

    def find(self, t: torch.Tensor) -> Allocation | None:
        storage = self._storage(t)
        return None if storage is None else self._by_storage.get(storage._cdata)

    def add(self, t: torch.Tensor, *, phase: str, op: str = "", module: str = "Global",
            category: str | None = None) -> Allocation | None:
        """Count ``t``'s storage as live from now on (once; ``category`` given to a new one)."""
        storage = self._storage(t)
        if storage is None or storage._cdata in self._by_storage:
            return None if storage is None else self._by_storage[storage._cdata]
        nbytes = storage.nbytes()
        allocation = Allocation(len(self.allocations), nbytes, phase, op, module, tuple(t.shape),
                                str(t.dtype).removeprefix("torch."), category)
        self.allocations.append(allocation)
        self._hold(storage, allocation)
        self.events.append((allocation.index, 1))
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return allocation

    def alias(self, new: Any, old: Any) -> None:
        """Let each tensor of ``new`` stand for the allocation of its twin in ``old``."""
        for a, b in zip(tensors(new), tensors(old), strict=True):
            target, storage = self.find(b), self._storage(a)
            if target is not None and storage is not None and (
                    storage._cdata not in self._by_storage):
                self._hold(storage, target)

    def _hold(self, storage: Any, allocation: Allocation) -> None:
        key = storage._cdata
        self._by_storage[key] = allocation
        allocation.handles += 1
        self._finalizers.append(weakref.finalize(storage, self._release, key))

    def _release(self, key: int) -> None:
        allocation = self._by_storage.pop(key, None)
        if allocation is None:
            return
        allocation.handles -= 1
        if allocation.handles == 0:
            self.events.append((allocation.index, -1))
            self.live -= allocation.nbytes

    def categorize(self, t: torch.Tensor, category: str) -> None:
        """Put the live storage of ``t`` in ``category``, unless it was an input of the step."""
        check_category(category)
        allocation = self.find(t)
        if allocation is not None and allocation.phase != "input":
            allocation.category = category

    def saved(self, t: torch.Tensor, phase: str) -> None:
        """Autograd saved ``t`` for the backward pass (a pack hook saw it)."""
        allocation = self.add(t, phase=phase)
        if allocation is not None:
            allocation.saved = self.any_saved = True

    def backward_starts(self) -> None:
        """Without a pack hook, what the forward pass made and is alive now is saved."""
        if not self.any_saved:
            for allocation in self.live_allocations():
                if allocation.phase == "forward" and allocation.category is None:
                    allocation.saved = True

    def op(self, name: str, phase: str, module: str, inputs: Sequence[torch.Tensor],
           outputs: Sequence[torch.Tensor]) -> None:
        """One op has run: its inputs and outputs are live."""
        for t in inputs:
            self.add(t, phase="input" if self.inputs else phase, module=module,
                     category=self.inputs)
        for t in outputs:
            self.add(t, phase=phase, op=name, module=module)
        self.ops.append((name, phase, self._op_module(inputs, phase, module)))
        self.events.append((_OP, len(self.ops) - 1))

    def _op_module(self, inputs: Sequence[torch.Tensor], phase: str, module: str) -> str:
        """In the backward pass, where module hooks do not fire under ``torch.func``, the module
        whose saved tensors the op reads, or else the one the last such op read."""
        if phase != "backward":
            return module
        modules = {a.module for a in map(self.find, inputs) if a is not None and a.saved}
        if modules:
            self._backward_module = innermost(modules)
        return self._backward_module or module

    def live_allocations(self) -> list[Allocation]:
        return list({id(a): a for a in self._by_storage.values()}.values())

    def live_by_category(self) -> dict[str, int]:
        """Bytes of the live storages by category (categories holding none left out)."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for allocation in self.live_allocations():
            totals[category(allocation)] += allocation.nbytes
        return _nonzero(totals)

    def close(self) -> None:
        """Stop watching: storages that outlive the step no longer call back."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def replay(self) -> Replay:
        """The highest total of live bytes, its op, and the bytes of each category then."""
        kinds = [category(a) for a in self.allocations]
        result, live, total, last_op = Replay(), dict.fromkeys(CATEGORIES, 0), 0, -1
        for index, sign in self.events:
            if index == _OP:
                last_op = sign
                continue
            kind, nbytes = kinds[index], sign * self.allocations[index].nbytes
            live[kind] += nbytes
            total += nbytes
            result.largest[kind] = max(result.largest[kind], live[kind])
            if total > result.peak_bytes:
                # An allocation belongs to the op whose outputs are being registered: the next
                # op when inside one, else the last op seen.
                result.peak_bytes, result.at_peak = total, _nonzero(live)
                result.peak_op = min(last_op + 1, len(self.ops) - 1)
        return result


def _nonzero(totals: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in totals.items() if v}


def check_category(name: str) -> None:
    if name not in CATEGORIES:
        raise UserError(f"unknown category {name!r}; choose one of {CATEGORIES}")


def category(allocation: Allocation) -> str:
    """The final category of an allocation."""
    if allocation.category is not None:
        return allocation.category
    return "activations" if allocation.saved else "temporaries"
