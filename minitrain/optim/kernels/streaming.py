"""One-pass CPU updates with streaming stores, in C.

A pure update built on torch's in-place fused kernels copies params and state first: two passes
over memory. One pass into fresh buffers with non-temporal stores (which aten and inductor do
not emit) skips even the read for ownership of each output line. ``_streaming.c`` (the rules of
the torch.optim family) is built and loaded by :mod:`minitrain._native` (``MINITRAIN_STREAMING=0``
turns it off). Every tensor is checked before its pointer reaches C (:func:`.checks.pointers`).

>>> params, grads = [torch.ones(4)], [torch.full((4,), 2.0)]
>>> hp = [0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # SGD: lr, momentum, dampening, wd, nesterov, ...
>>> rows = [params, grads, None]
>>> if available():
...     new_params, _ = run("sgd", hp, rows, pointers(rows), lambda r: [t.clone() for t in r])
... else:  # no C compiler here: the same result by hand
...     new_params = [params[0] - 0.5 * grads[0]]
>>> new_params[0], params[0]
(tensor([0., 0., 0., 0.]), tensor([1., 1., 1., 1.]))
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Sequence
from typing import SupportsFloat

import torch
from torch import Tensor

from minitrain import _torch
from minitrain._native import BuildError, _library
from minitrain.optim.kernels.checks import pointers

__all__ = ["RULES", "BuildError", "available", "launch", "norm", "quiet", "run", "sums_of_squares"]

RULES = {"adam": (0, 10), "sgd": (1, 7), "adagrad": (2, 3), "rmsprop": (3, 7), "nadam": (4, 11),
         "radam": (5, 12), "adamax": (6, 9), "lion": (7, 7), "schedule_free_adamw": (8, 13),
         "adadelta": (9, 8)}
"""Rule name -> its index in ``_streaming.c``'s table and how many hyperparameters it reads."""

_TAKES = dict(RULES.values())

OPTIONAL = {0: {4: 8}, 1: {2: 6}, 3: {3: 6, 4: 5}}
"""Per rule index: the input rows it can go without (Adam's max_exp_avg_sq, SGD's and RMSprop's
momentum buffer, RMSprop's grad_avg), each with the hyperparameter that turns its use on."""

STREAMING_BYTES = 80 * 2**20
"""A pure update writes with streaming stores once it touches this many bytes (inputs and
outputs); below, plain stores, whose lines stay in the last-level cache for the next update
(``benchmarks/optim.py --breakdown`` times both)."""


def available() -> bool:
    """Whether the streaming kernels are built and loaded (building them on first call).

    >>> isinstance(available(), bool)
    True
    """
    return _library() is not None


def quiet() -> bool:
    """Whether no torch mode watches the torch calls made here: no ``TorchDispatchMode`` (the
    accounting ``Counter``, ``FlopCounterMode``, fake tensors) and no ``TorchFunctionMode`` but
    torch's default-device one; where one watches, the kernels give way to torch's ops.

    >>> quiet()
    True
    """
    if _torch.get_current_dispatch_mode() is not None:
        return False
    return not _torch.is_torch_function_mode_enabled() or all(
        isinstance(mode, _torch.DeviceContext) for mode in _torch.get_current_function_mode_stack())


def launch(rule: int, hyperparameters: list[float] | list[list[float]],
           rows: list[list[int] | None], sizes: list[int], nontemporal: bool,
           members: int = 1) -> None:
    """The C call: rule ``rule`` (:data:`RULES`' index) over rows
    of data pointers (``[params, grads, *buffers, *outputs]``, None for an absent row) that
    :func:`.checks.pointers` gave for float32 leaves of ``sizes`` elements; one list of
    hyperparameters for all leaves, or a list per leaf. With ``members``, a row holds a pointer
    per stacked leaf, ``sizes`` each member's slice (leaf ``l``'s member ``m`` starts ``m *
    sizes[l * members + m]`` elements in), and there may be a hyperparameter list per member."""
    per_leaf = [hyperparameters] if not hyperparameters or not isinstance(
        hyperparameters[0], list) else hyperparameters
    takes, count = _TAKES.get(rule, len(per_leaf[0])), len(per_leaf)
    if set(map(len, per_leaf)) != {takes} or count not in (1, len(sizes), members) or \
            members < 1 or len(sizes) % members:
        raise ValueError(f"streaming rule {rule!r} takes {takes} hyperparameters (for all "
                         f"leaves, per leaf or per member), got {[len(hp) for hp in per_leaf]} "
                         f"for {len(sizes)} leaves of {members} members; pass them in the "
                         f"order _streaming.c lists")  # (an unknown rule is C's to refuse)
    # The arrays are named: C reads them after the expression that made them.
    hp = array.array("d", list(itertools.chain.from_iterable(per_leaf)))
    inputs = (len(rows) + 1) // 2  # then the outputs of the params and buffers
    for index in [i for i, row in enumerate(rows) if row is None]:
        slot = index if index < inputs else (0 if index == inputs else index - inputs + 1)
        flag = OPTIONAL.get(rule, {}).get(slot)
        if flag is None or any(hp[flag::takes]):  # (a flag's value in every list: nonzero)
            raise ValueError(f"streaming rule {rule!r} reads row {slot}; pass it")
    counts = array.array("q", sizes)
    addresses = array.array("Q", bytes(8 * len(sizes) // members * len(rows)))  # leaf by leaf
    for r, row in enumerate(rows):  # (a row of another length is refused here)
        if row is not None:
            addresses[r::len(rows)] = array.array("Q", row)
    strides = (0, 0) if count == 1 else (takes * members, takes) if count == len(sizes) else \
        (0, takes)  # (the leaf's row and the member's within it, or the member's alone)
    status = _library().minitrain_update(
        rule, hp.buffer_info()[0], *strides, addresses.buffer_info()[0], counts.buffer_info()[0],
        len(sizes), members, len(rows), torch.get_num_threads(), int(nontemporal))
    if status != 0:
        raise RuntimeError(f"streaming update {rule!r} failed with status {status}")


def run(rule: str, hyperparameters: Sequence[SupportsFloat], rows: list[list[Tensor] | None],
        found: list[list[int] | None],
        outputs: Callable[[list[Tensor]], list[Tensor]] | None) -> list[list[Tensor] | None] | None:
    """One update of ``rule``: the new ``[params, *buffers]`` from ``rows``, ``[params, grads,
    *buffers]`` in ``_streaming.c``'s order (None for a buffer the rule does not use), which the
    caller checked (``found``: their :func:`.checks.pointers` addresses). Into ``outputs(like)``
    buffers (checked here; None where they do not fit) or, ``outputs`` None, in place."""
    results = [row if row is None or outputs is None else outputs(row)
               for row in (rows[0], *rows[2:])]  # the params and buffers it writes
    # every pointer handed to C is checked
    addresses = [found[0], *found[2:]] if outputs is None else pointers(results, like=rows[0])
    if addresses is None:
        return None
    touched = len(rows) + len(results) - list(rows).count(None) - results.count(None)
    nontemporal = outputs is not None and \
        4 * touched * sum(p.numel() for p in rows[0]) >= STREAMING_BYTES
    launch(RULES[rule][0], [float(v) for v in hyperparameters], [*found, *addresses],
           [p.numel() for p in rows[0]], nontemporal)
    if outputs is None:  # written in place: bump their versions, as an in-place op does
        torch.autograd.graph.increment_version([t for row in results if row is not None
                                                for t in row])
    return results


def sums_of_squares(addresses: list[int], sizes: list[int]) -> Tensor:
    """Per leaf, ``sum(x * x)`` (float32 lanes added in float64: the same for any number of
    threads) over float32 leaves at checked ``addresses`` (:func:`.checks.pointers`) of
    ``sizes`` elements: the global-norm clip's one pass over the grads."""
    out = torch.zeros(len(sizes), dtype=torch.float64, device="cpu")
    starts, counts = array.array("Q", addresses), array.array("q", sizes)
    status = _library().minitrain_sumsq(starts.buffer_info()[0], counts.buffer_info()[0],
                                       len(sizes), max(1, torch.get_num_threads()), out.data_ptr())
    if status != 0:
        raise RuntimeError(f"streaming sum of squares failed with status {status}")
    return out


def norm(squares: Tensor, sizes: list[int]) -> Tensor:
    """The global norm from per-leaf float64 sums of squares of leaves of ``sizes`` elements,
    in ``clip_grad_norm_``'s form: each leaf's norm in float32 (that of one element its
    magnitude, as torch's, whose square may overflow float32), then the norm of those norms (a
    0-d float32 tensor)."""
    single = torch.tensor([n == 1 for n in sizes], device="cpu")
    leaf_norms = torch.where(single, squares.sqrt(), squares.to(torch.float32).sqrt())
    return torch.linalg.vector_norm(leaf_norms.to(torch.float32), 2)
