"""The registry of every optimizer ``mt.optim`` exports (optax ``alias_test.py``'s
``_OPTIMIZERS_UNDER_TEST``): it drives the generic suite in ``test_alias.py`` and the
``optim_db`` suite in ``test_optim_db.py``.

Each :class:`Entry` names one configuration of one alias: ``entry.make(**kw)`` builds it
(``mt.optim.<alias>(**entry.kwargs, **kw)``) and ``entry.make_reference(params, **kw)`` builds
its independent reference over a list of ``nn.Parameter`` with the same arguments: a
``torch.optim`` class, lion-pytorch's ``Lion`` or schedulefree's ``AdamWScheduleFree``. Muon's
reference runs in its own harness (``tests/muon_harness.py``).

Below the registry: the small trees, runs and comparisons the registry's tests share. Test
modules import them as ``from tests.optim.conftest import OPTIMIZERS, ...``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from lion_pytorch import Lion
from schedulefree import AdamWScheduleFree

import minitrain as mt
from tests.muon_harness import muon_run_against_torch


class Entry(NamedTuple):
    """One optimizer configuration under test."""

    name: str  # the test id
    alias: str  # the mt.optim function
    kwargs: dict[str, Any]  # its arguments (torch.optim's names, the reference's too)
    reference: Callable[..., Any] | None  # a class: (params: list[Parameter], **kw)
    schedule: bool = True  # whether lr may be a schedule (the reference reads lr each step)
    weight_decay: bool = True  # whether it takes weight_decay
    matrices_only: bool = False  # Muon: 2-D params only
    harness: Callable[[], None] | None = None  # a step-for-step check of its own

    def make(self, **kw: Any) -> mt.optim.Optimizer:
        """``mt.optim.<alias>`` with the entry's arguments and ``kw``."""
        return getattr(mt.optim, self.alias)(**{**self.kwargs, **kw})

    def make_reference(self, params: list[torch.nn.Parameter], **kw: Any) -> Any:
        """The reference over ``params`` with the entry's arguments and ``kw``."""
        return self.reference(params, **{**self.kwargs, **kw})

    @property
    def torch_name(self) -> str | None:
        """The ``torch.optim`` class this alias follows (``optim_db``'s name), if any."""
        if self.alias == "muon":
            return "Muon"
        cls = self.reference
        return cls.__name__ if isinstance(cls, type) and cls.__module__.startswith(
            "torch.optim") else None

    @property
    def reference_maximizes(self) -> bool:
        """Whether the reference takes ``maximize`` (otherwise it is given negated grads)."""
        return "maximize" in inspect.signature(self.reference).parameters

    def __str__(self) -> str:
        return self.name


def _muon_harness() -> None:
    muon_run_against_torch(steps=3, shapes=((12, 8), (8, 16), (12, 8)))


OPTIMIZERS: list[Entry] = [
    Entry("sgd", "sgd", dict(lr=0.1), torch.optim.SGD),
    Entry("sgd-momentum", "sgd", dict(lr=0.1, momentum=0.9), torch.optim.SGD),
    Entry("sgd-nesterov", "sgd", dict(lr=0.1, momentum=0.9, nesterov=True), torch.optim.SGD),
    Entry("sgd-dampening", "sgd", dict(lr=0.1, momentum=0.9, dampening=0.3), torch.optim.SGD),
    Entry("adam", "adam", dict(lr=0.01), torch.optim.Adam),
    Entry("adam-amsgrad", "adam", dict(lr=0.01, amsgrad=True), torch.optim.Adam),
    Entry("adam-decoupled", "adam", dict(lr=0.01, decoupled_weight_decay=True),
          torch.optim.Adam),
    Entry("adamw", "adamw", dict(lr=0.01), torch.optim.AdamW),
    Entry("adamw-amsgrad", "adamw", dict(lr=0.01, amsgrad=True, betas=(0.8, 0.99)),
          torch.optim.AdamW),
    Entry("adagrad", "adagrad", dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
          torch.optim.Adagrad),
    Entry("rmsprop", "rmsprop", dict(lr=0.01), torch.optim.RMSprop),
    Entry("rmsprop-centered", "rmsprop", dict(lr=0.01, centered=True), torch.optim.RMSprop),
    Entry("rmsprop-momentum", "rmsprop", dict(lr=0.01, momentum=0.9), torch.optim.RMSprop),
    Entry("rmsprop-centered-momentum", "rmsprop", dict(lr=0.01, centered=True, momentum=0.5),
          torch.optim.RMSprop),
    Entry("adadelta", "adadelta", dict(lr=1.0), torch.optim.Adadelta),
    Entry("adafactor", "adafactor", dict(lr=0.01), torch.optim.Adafactor),
    Entry("adamax", "adamax", dict(lr=0.01), torch.optim.Adamax),
    Entry("nadam", "nadam", dict(lr=0.01), torch.optim.NAdam),
    Entry("nadam-decoupled", "nadam", dict(lr=0.01, decoupled_weight_decay=True),
          torch.optim.NAdam),
    Entry("radam", "radam", dict(lr=0.01), torch.optim.RAdam),
    Entry("radam-decoupled", "radam", dict(lr=0.01, decoupled_weight_decay=True),
          torch.optim.RAdam),
    Entry("lion", "lion", dict(lr=1e-3), Lion),
    Entry("muon", "muon", dict(lr=0.02), None, matrices_only=True, harness=_muon_harness),
    # schedule-free AdamW refuses a schedule (its warmup is its own)
    Entry("schedule_free_adamw", "schedule_free_adamw", dict(lr=0.01, warmup_steps=2),
          AdamWScheduleFree, schedule=False),
]

OPTAX_ONLY: list[Entry] = [
    Entry("lamb", "lamb", dict(lr=0.01, weight_decay=0.1), None),
    Entry("lars", "lars", dict(lr=0.1, weight_decay=0.01), None),
    Entry("adabelief", "adabelief", dict(lr=0.01, weight_decay=0.1), None),
    Entry("yogi", "yogi", dict(lr=0.01), None),
]
"""optax's aliases, which have no torch.optim reference and no row in the accounting's table
of state sizes: the generic checks that need neither run over them in
``test_optax_transforms.py``, with their optax references. ``polyak_sgd`` takes the loss
(``value=``) and is checked there alone."""
TAKES_VALUE = ["polyak_sgd"]

BY_NAME = {entry.name: entry for entry in OPTIMIZERS}
REFERENCED = [entry for entry in OPTIMIZERS if entry.reference is not None]
SCHEDULABLE = [entry for entry in OPTIMIZERS if entry.schedule]
SCHEDULED = [entry for entry in REFERENCED if entry.schedule]
DECAYED = [entry for entry in REFERENCED if entry.weight_decay]

# Against a reference: another order of the same float32 ops, over steps of up to ~0.5 that
# cancel (RMSprop's early steps), so 1e-5 absolute.
RTOL, ATOL = 1e-5, 1e-5
ROUNDING = dict(rtol=1e-6, atol=1e-7)  # two paths of minitrain's own that may round apart


# --------------------------------------------------------------------------------------------
# Trees, grads, runs and the reference


def make_params(entry: Entry, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A small tree of mixed shapes (0-d to 3-d); of matrices for Muon."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=dtype)

    if entry.matrices_only:
        return {"w": leaf(4, 3), "b": [leaf(3, 5), leaf(5, 3)], "t": leaf(6, 2)}
    return {"w": leaf(4, 3), "b": [leaf(5), leaf()], "t": leaf(2, 3, 4)}


def make_grads(params: Any, steps: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [mt.tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)
            for _ in range(steps)]


def clones(tree: Any) -> Any:
    return mt.tree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in mt.tree.leaves(tree) if isinstance(t, torch.Tensor)]


def run(opt: mt.optim.Optimizer, params: Any, grads_seq: list, **kw) -> tuple[Any, Any]:
    state = opt.init(params)
    for grads in grads_seq:
        params, state = opt.update(grads, state, params, **kw)
    return params, state


KERNEL_ROUNDING = dict(rtol=1e-6, atol=1e-6)
"""How far a kernel's update may stand from its chain's after a few steps: the kernels order
their float32 operations otherwise (a fused multiply-add, a bias correction folded into the
step), which moves a result by an ulp or two."""


def assert_equal(a: Any, b: Any, **tolerance) -> None:
    """Same tree structure; leaf for leaf the same dtype and values (bits unless a tolerance)."""
    assert mt.tree.structure(a) == mt.tree.structure(b)
    for (name, x), (_, y) in zip(mt.tree.named_leaves(a), mt.tree.named_leaves(b), strict=True):
        if not isinstance(x, torch.Tensor):
            assert x == y, name
            continue
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(x.detach(), y.detach(), equal_nan=True,
                                   **(tolerance or dict(rtol=0, atol=0)),
                                   msg=lambda m, name=name: f"{name}: {m}")


def run_reference(entry: Entry, params: Any, grads_seq: list, *, lrs=None, maximize=False,
                  **kw) -> tuple[list[list[torch.Tensor]], Any]:
    """The reference's leaves after each update (its lr set to ``lrs(k)`` before update k, as an
    LRScheduler stepped after each update sets it), and the reference itself; ``maximize`` by
    negated grads where the reference has no such argument."""
    leaves = [torch.nn.Parameter(p.clone()) for p in mt.tree.leaves(params)]
    negate = maximize and not entry.reference_maximizes
    optimizer = entry.make_reference(leaves, **kw, **({"maximize": True} if maximize and
                                                      not negate else {}))
    if hasattr(optimizer, "train"):  # schedule-free: train mode
        optimizer.train()
    after = []
    for k, grads in enumerate(grads_seq):
        if lrs is not None:
            for group in optimizer.param_groups:
                group["lr"] = lrs(k)
        for p, g in zip(leaves, mt.tree.leaves(grads), strict=True):
            p.grad = -g.clone() if negate else g.clone()
        optimizer.step()
        after.append([p.detach().clone() for p in leaves])
    return after, optimizer


# --------------------------------------------------------------------------------------------
# Small runs shared by test_transforms.py and test_wrappers.py

SMALL_SHAPES = [(4, 3), (5,), ()]


def small_data(seed: int, steps: int) -> tuple[list, list]:
    """Params of :data:`SMALL_SHAPES` and ``steps`` lists of grads for them."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in SMALL_SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SMALL_SHAPES] for _ in range(steps)]
    return params, grads


def torch_run(cls, kwargs, params, grads) -> list[torch.Tensor]:
    """The params after ``cls(**kwargs, foreach=False)`` steps over ``grads``."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = cls(ps, **kwargs, foreach=False)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def tx_run(tx, params, grads, requires_grad=False, lowered=True):
    """Run ``as_optimizer(tx)`` (which may lower ``tx`` to fused kernels) or, with
    ``lowered=False``, the transformation itself then ``apply_updates``."""
    opt = mt.optim.as_optimizer(tx)
    params = [p.clone().requires_grad_(requires_grad) for p in params]
    state = opt.init(params)
    for step_grads in grads:
        if lowered:
            params, state = opt.update(step_grads, state, params)
        else:
            updates, state = tx.update(step_grads, state, params)
            params = mt.optim.apply_updates(params, updates)
    return [p.detach() for p in params], state


# --------------------------------------------------------------------------------------------
# Inputs whose memory is shared, for test_muon_cases.py and test_adafactor_cases.py

CASE_SHAPE = (32, 8)  # 256 elements: the kernels take it


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape or CASE_SHAPE, generator=torch.Generator().manual_seed(seed))


def warm_state(make: Callable[[], Any], params: dict) -> Any:
    """``make()``'s state after one update on independent clones (non-zero moments)."""
    opt = make()
    grads = {k: randn(7 + i, *v.shape) for i, (k, v) in enumerate(params.items())}
    return opt.update(grads, opt.init(clones(params)), clones(params))[1]


def assert_like_clones(make: Callable[[], Any], grads, state, params, donate, exact=True):
    """The update of these (aliased) inputs against the pure update of independent clones;
    a pure update must leave every input as it was."""
    expected = make().update(clones(grads), clones(state), clones(params))
    before = [t.clone() for t in tensors((grads, state, params))]
    got = make().update(grads, state, params, donate=donate)
    tolerance = dict(rtol=0, atol=0) if exact else {}
    for new, ref in zip(tensors(got), tensors(expected), strict=True):
        torch.testing.assert_close(new, ref, equal_nan=True, **tolerance)
    if not donate:
        for now, then in zip(tensors((grads, state, params)), before, strict=True):
            torch.testing.assert_close(now, then, rtol=0, atol=0, equal_nan=True)
