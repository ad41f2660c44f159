"""Live memory over one step, by category: the counter's record and its picture.

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

:func:`plot_memory_timeline` draws one or more timelines (predicted, measured) as stacked areas
over the op index, phases marked; it needs matplotlib (``pip install 'minitrain[plot]'``).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minitrain import _torch

__all__ = ["CATEGORIES", "LiveStorages", "Timeline", "plot_memory_timeline", "timeline_summary"]

CATEGORIES = (
    "params", "grads", "optimizer_state", "batch", "buffers", "activations", "temporaries",
)
# (op_index, phase, {category: live bytes}) after each op, categories with no bytes left out.
Timeline = list[tuple[int, str, dict[str, int]]]

_COLORS = {
    "params": "#4e79a7", "grads": "#f28e2b", "optimizer_state": "#59a14f", "batch": "#b07aa1",
    "buffers": "#9c755f", "activations": "#e15759", "temporaries": "#bab0ac",
}


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
            raise ValueError(f"unknown category {category!r}; choose one of {CATEGORIES}")
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
            raise ValueError("no timeline was recorded; use Counter(record_timeline=True)")
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


def _phase_spans(timeline: Timeline) -> list[tuple[str, int, int]]:
    spans: list[tuple[str, int, int]] = []
    for index, phase, _ in timeline:
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], index)
        else:
            spans.append((phase, index, index))
    return spans


def plot_memory_timeline(
    timelines: Mapping[str, Timeline], path: str, *, title: str = "live memory over one step"
) -> str:
    """Draw each timeline (label -> timeline) as stacked areas of live bytes by category over
    the op index, one panel each on a shared y axis, phases marked; returns ``path``.

    Needs matplotlib (``pip install 'minitrain[plot]'``); without it a one-line ``ValueError``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "the memory picture needs matplotlib; install it with: pip install 'minitrain[plot]'"
        ) from None
    panels = [(label, t) for label, t in timelines.items() if t]
    if not panels:
        raise ValueError("plot_memory_timeline needs at least one non-empty timeline")
    used = [c for c in CATEGORIES if any(c in live for _, t in panels for _, _, live in t)]
    top = max(sum(live.values()) for _, t in panels for _, _, live in t)
    unit, scale = next((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1))
                       if top >= s or s == 1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels) + 0.6), dpi=120,
                             squeeze=False)
    for ax, (label, timeline) in zip(axes[:, 0], panels, strict=True):
        xs = [index for index, _, _ in timeline]
        ys = [[live.get(c, 0) / scale for _, _, live in timeline] for c in used]
        ax.stackplot(xs, ys, labels=used, colors=[_COLORS[c] for c in used], step="post")
        totals = [sum(live.values()) for _, _, live in timeline]
        peak = max(range(len(totals)), key=totals.__getitem__)
        ax.plot([xs[peak]], [totals[peak] / scale], "k.", markersize=8)
        right = xs[peak] > xs[0] + 0.6 * (xs[-1] - xs[0])  # label left of a peak on the right
        ax.annotate(f"peak {totals[peak] / scale:.3g} {unit} ({timeline[peak][1]})",
                    (xs[peak], totals[peak] / scale), textcoords="offset points",
                    xytext=(-6 if right else 6, 4), ha="right" if right else "left", fontsize=8)
        for phase, start, end in _phase_spans(timeline):
            if start:
                ax.axvline(start, color="black", linestyle="--", linewidth=0.7)
            ax.text((start + end) / 2, top / scale * 1.1, phase, ha="center", va="bottom",
                    fontsize=8)
        ax.set_ylim(0, top / scale * 1.22)
        ax.set_xlim(xs[0], max(xs[-1], xs[0] + 1))
        ax.set_ylabel(f"live {unit}")
        ax.set_title(label, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("op index")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=min(len(used), 4))
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path)
    plt.close(fig)
    return path


def timeline_summary(timeline: Sequence[tuple[int, str, dict[str, int]]]) -> dict[str, Any]:
    """Peak of a timeline: ``{"peak_bytes", "peak_op_index", "peak_phase", "at_peak"}``."""
    if not timeline:
        return {"peak_bytes": 0, "peak_op_index": None, "peak_phase": None, "at_peak": {}}
    index, phase, live = max(timeline, key=lambda sample: sum(sample[2].values()))
    return {"peak_bytes": sum(live.values()), "peak_op_index": index, "peak_phase": phase,
            "at_peak": dict(live)}
