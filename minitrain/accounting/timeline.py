"""Live memory over one step, by category: the counter's record of every storage's life.

:class:`LiveStorages` is the counter's ledger of live storages (each counted once, freed when
its last reference dies). With ``record=True`` it also keeps every storage's life (the op index
at which it was first seen and the one before which it died), so that after the step
:meth:`LiveStorages.timeline` gives the live bytes of each category after every op, in the
format of :attr:`minitrain.accounting.predict.StepPrediction.timeline`:
``[(op_index, phase, {category: bytes}), ...]``. A storage's category is, in order:

1. the one it was given: ``Counter.track(tree, category=...)`` at the start (params, optimizer
   state, batch) or ``Counter.categorize(tree, ...)`` later (grads, new params and state);
2. ``activations`` if autograd saved it for the backward pass: a ``saved_tensors_hooks`` pack
   hook sees every saved tensor inside :func:`minitrain.value_and_grad` and ``grad`` (a
   checkpointed region saves nothing but its inputs); where no hook ran (plain autograd),
   what the forward pass made and is alive when the backward pass starts;
3. ``grads`` if the backward pass made it and it outlived the backward pass (when no storage
   was put in ``grads`` by ``categorize``);
4. ``temporaries`` otherwise.

Phases: ``forward`` until the first op of the backward pass, ``backward`` while the autograd
engine runs, ``update`` after it, unless named by ``Counter.set_phase`` (``minitrain profile``
marks ``clip`` and ``update`` as ``predict_step`` does).

:func:`minitrain.accounting.plots.plot_memory_timeline` draws them.

>>> import torch, minitrain as mt
>>> from minitrain.accounting import Counter
>>> w = torch.ones(256, 256)
>>> with Counter(record_timeline=True) as c:
...     c.track(w, category="params")
...     loss, grads = mt.value_and_grad(lambda w: w.tanh().sum())(w)
>>> [(i, phase, sorted(live)) for i, phase, live in c.timeline()][:2]  # detach (an alias), tanh
[(0, 'forward', ['params']), (1, 'forward', ['activations', 'params'])]
>>> max(live.get("grads", 0) for _, _, live in c.timeline()) == 256 * 256 * 4
True
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minitrain import _torch
from minitrain.errors import UserError

__all__ = ["CATEGORIES", "LiveStorages", "Timeline", "innermost", "timeline_summary"]

CATEGORIES = (
    "params", "grads", "optimizer_state", "batch", "buffers", "activations", "temporaries",
)
# (op_index, phase, {category: live bytes}) after each op, categories with no bytes left out.
Timeline = list[tuple[int, str, dict[str, int]]]



def innermost(parents: set[str]) -> str:
    """The deepest module path among ``parents`` (``"Global"`` outside any module)."""
    return max(parents, key=lambda p: (p != "Global", p.count("."), len(p)), default="Global")


@dataclass
class _Life:
    nbytes: int
    born: int  # index of the first op after which it is live
    phase: str
    died: int | None = None  # index of the first op after which it is no longer live
    category: str | None = None
    saved: bool = False


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under ``torch.func``'s wrappers (the one the dispatch mode sees)."""
    while _torch.is_functorch_wrapped_tensor(t):
        t = _torch.get_unwrapped(t)
    return t


class LiveStorages:
    """Bytes of live storages, each counted once; freed storages leave through a finalizer."""

    def __init__(self, record: bool = False) -> None:
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.record = record
        self.lives: list[_Life] = []
        self.phases: list[str] = []  # phase of each op sampled so far
        self._index: dict[int, int] = {}  # storage address -> index into lives
        self.any_saved = False

    def _key(self, t: torch.Tensor) -> tuple[Any, int] | None:
        t = _plain(t)
        if t.is_meta or t.layout != torch.strided:
            return None
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() == 0:
            return None
        return storage, storage.data_ptr()

    def add(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count ``t``'s storage as live from now on (once), in ``category`` if given."""
        found = self._key(t)
        if found is None:
            return
        storage, key = found
        if key not in self.sizes:
            nbytes = storage.nbytes()
            self.sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
            if self.record:
                self._index[key] = len(self.lives)
                phase = self.phases[-1] if self.phases else "forward"
                self.lives.append(_Life(nbytes, born=len(self.phases), phase=phase))
        if category is not None:
            self.categorize(t, category)

    def categorize(self, t: torch.Tensor, category: str) -> None:
        """Put the live storage of ``t`` in ``category`` unless it already has one."""
        if category not in CATEGORIES:
            raise UserError(f"unknown category {category!r}; choose one of {CATEGORIES}")
        found = self._key(t)
        if self.record and found is not None and found[1] in self._index:
            life = self.lives[self._index[found[1]]]
            life.category = life.category or category

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saved ``t`` for the backward pass (called by the pack hook)."""
        self.add(t)
        found = self._key(t)
        if self.record and found is not None and found[1] in self._index:
            self.lives[self._index[found[1]]].saved = self.any_saved = True

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)
        index = self._index.pop(key, None)
        if index is not None:
            self.lives[index].died = len(self.phases)

    def sample(self, phase: str) -> None:
        """One op has run (its outputs are counted): a point of the timeline."""
        if self.record:
            self.phases.append(phase)

    def _category(self, life: _Life, backward_start: int, backward_end: int) -> str:
        if life.category is not None:
            return life.category
        if life.saved:
            return "activations"
        if not self.any_saved and life.phase == "forward" and life.born < backward_start and (
            life.died is None or life.died > backward_start
        ):  # no hook saw the saved tensors (plain autograd): alive when the backward starts
            return "activations"
        if self._guess_grads and life.phase == "backward" and (
            life.died is None or life.died > backward_end
        ):
            return "grads"
        return "temporaries"

    def timeline(self) -> Timeline:
        """Live bytes by category after every op sampled (needs ``record=True``)."""
        if not self.record:
            raise UserError("no timeline was recorded; use Counter(record_timeline=True)")
        steps = len(self.phases)
        # Without grads named by categorize(), they are what the backward made and outlived it.
        self._guess_grads = all(life.category != "grads" for life in self.lives)
        backward = [i for i, phase in enumerate(self.phases) if phase == "backward"]
        backward_start, backward_end = (backward[0], backward[-1] + 1) if backward else (steps,) * 2
        change: dict[str, list[int]] = {c: [0] * (steps + 1) for c in CATEGORIES}
        for life in self.lives:
            delta = change[self._category(life, backward_start, backward_end)]
            born = min(life.born, steps)
            died = steps if life.died is None else min(life.died, steps)
            if died > born:
                delta[born] += life.nbytes
                delta[died] -= life.nbytes
        live = dict.fromkeys(CATEGORIES, 0)
        out: Timeline = []
        for index, phase in enumerate(self.phases):
            for c in CATEGORIES:
                live[c] += change[c][index]
            out.append((index, phase, {c: b for c, b in live.items() if b}))
        return out


def timeline_summary(timeline: Sequence[tuple[int, str, dict[str, int]]]) -> dict[str, Any]:
    """Peak of a timeline: ``{"peak_bytes", "peak_op_index", "peak_phase", "at_peak"}``."""
    if not timeline:
        return {"peak_bytes": 0, "peak_op_index": None, "peak_phase": None, "at_peak": {}}
    index, phase, live = max(timeline, key=lambda sample: sum(sample[2].values()))
    return {"peak_bytes": sum(live.values()), "peak_op_index": index, "peak_phase": phase,
            "at_peak": dict(live)}
