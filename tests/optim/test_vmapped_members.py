"""Optimizers built and run inside ``vmap``, each member with its own numbers: every optimizer's
vmapped update (one kernel call over the stacked members where the chain lowers, the chain op
by op elsewhere) equals each member updated alone, with its own learning rate, weight decay,
step count and weight-decay mask."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from minitrain.optim.kernels import members, streaming
from tests.optim.conftest import (
    ATOL,
    KERNEL_ROUNDING,
    OPTAX_ONLY,
    OPTIMIZERS,
    RTOL,
    assert_equal,
    make_grads,
    make_params,
    run,
)

LRS = (0.1, 0.03, 0.01)
LOWERED = {"sgd-momentum", "sgd-nesterov", "sgd-dampening", "adam", "adam-amsgrad",
           "adam-decoupled", "adamw", "adamw-amsgrad", "adagrad", "rmsprop", "rmsprop-centered",
           "rmsprop-momentum", "rmsprop-centered-momentum", "adadelta", "adamax", "nadam",
           "nadam-decoupled", "radam", "radam-decoupled", "lion"}
"""The entries whose chain has a C kernel: their vmapped members run as one call (plain SGD is
two ops a leaf, cheaper than the call; schedule-free AdamW keeps its learning rate in its state,
which the kernel path reads as one number)."""
ids = str


def spy(monkeypatch, name: str) -> list:
    """The results of ``members.<name>`` in this test: None where the chain ran instead."""
    seen = []
    original = getattr(members, name)

    def spied(*args):
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(members, name, spied)
    return seen


@pytest.fixture
def calls(monkeypatch):
    return spy(monkeypatch, "run")


def stacked_run(entry, steps: int, **per_member):
    """Three members of ``entry`` vmapped, each building its optimizer from its own values
    (``per_member``: name -> three values), against each member run alone."""
    params = [make_params(entry, seed) for seed in range(3)]
    grads = [mt.tree.stack(g) for g in zip(*[make_grads(p, steps, seed=9 + i)
                                             for i, p in enumerate(params)], strict=True)]
    values = {key: torch.tensor(v) for key, v in per_member.items()}

    def step(p, state, g, numbers):
        return entry.make(**numbers).update(g, state, p)

    stacked = mt.tree.stack(params)
    state = torch.func.vmap(entry.make(**{k: v[0] for k, v in per_member.items()}).init)(stacked)
    for g in grads:
        stacked, state = torch.func.vmap(step)(stacked, state, g, values)
    alone = [run(entry.make(**{k: float(v[i]) for k, v in values.items()}), params[i],
                 [mt.tree.unstack(g)[i] for g in grads]) for i in range(3)]
    return mt.tree.unstack((stacked, state)), alone


@pytest.mark.parametrize("entry", OPTIMIZERS + OPTAX_ONLY, ids=ids)
def test_each_member_with_its_own_learning_rate_equals_that_member_alone(entry, calls):
    together, alone = stacked_run(entry, 3, lr=LRS)
    for i in range(3):
        assert_equal(together[i], alone[i], rtol=RTOL, atol=ATOL)
    if entry.name in LOWERED and streaming.available():
        assert calls and all(result is not None for result in calls)


@pytest.mark.parametrize("entry", [e for e in OPTIMIZERS if e.name in LOWERED
                                   and e.weight_decay], ids=ids)
def test_each_member_with_its_own_weight_decay_equals_that_member_alone(entry, calls):
    together, alone = stacked_run(entry, 2, lr=LRS, weight_decay=(0.01, 0.1, 0.5))
    for i in range(3):
        assert_equal(together[i], alone[i], **KERNEL_ROUNDING)
    assert not streaming.available() or all(result is not None for result in calls)


def test_members_at_different_steps_each_take_their_own():
    entry = next(e for e in OPTIMIZERS if e.name == "adam")
    params = mt.tree.stack([make_params(entry, seed) for seed in range(3)])
    grads = mt.tree.map(lambda p: torch.randn_like(p), params)
    opt = entry.make()
    state = torch.func.vmap(opt.init)(params)
    counts = torch.tensor([0, 4, 9])  # a member restored from another run's checkpoint
    state = (state[0], state[1]._replace(count=counts), state[2]._replace(count=counts))
    new, new_state = torch.func.vmap(opt.update)(grads, state, params)
    for i in range(3):
        member_state = mt.tree.unstack(state)[i]
        want = opt.update(mt.tree.unstack(grads)[i], member_state, mt.tree.unstack(params)[i])
        assert_equal(mt.tree.unstack((new, new_state))[i], want, **KERNEL_ROUNDING)


def test_a_weight_decay_mask_sees_each_members_leaf_not_the_stack():
    entry = next(e for e in OPTIMIZERS if e.name == "adamw")
    opt = entry.make(weight_decay=0.5, mask=lambda name, p: p.ndim >= 2)
    members_params = [make_params(entry, seed) for seed in range(2)]
    grads = [make_grads(p, 1, seed=3 + i)[0] for i, p in enumerate(members_params)]
    stacked = mt.tree.stack(members_params)
    state = torch.func.vmap(opt.init)(stacked)
    new, _ = torch.func.vmap(opt.update)(mt.tree.stack(grads), state, stacked)
    for i, p in enumerate(members_params):
        want, _ = opt.update(grads[i], opt.init(p), p)
        assert_equal(mt.tree.unstack(new)[i], want, **KERNEL_ROUNDING)


def test_under_grad_and_with_a_clip_the_chain_runs(calls):
    """A vmapped update the kernel cannot take (differentiated, clipped) gives the chain's."""
    entry = next(e for e in OPTIMIZERS if e.name == "sgd")
    params = mt.tree.stack([make_params(entry, seed, torch.float64) for seed in range(2)])
    opt = mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.clip_by_global_norm(0.5), mt.optim.scale_by_learning_rate(0.1)))
    grads = mt.tree.map(torch.ones_like, params)
    torch.func.vmap(opt.update)(grads, torch.func.vmap(opt.init)(params), params)

    def loss(p):
        new, _ = torch.func.vmap(entry.make().update)(grads, torch.func.vmap(
            entry.make().init)(p), p)
        return sum((t**2).sum() for t in mt.tree.leaves(new))

    by_func = torch.func.grad(loss)(params)
    want = mt.tree.map(lambda p, g: 2 * (p - 0.1 * g), params, grads)
    assert_equal(by_func, want, rtol=1e-12, atol=1e-12)
    assert all(result is None for result in calls)


def vmapped_adam(lrs, counts=None):
    """Two or three adam members, vmapped with their own learning rates (and counts)."""
    entry = next(e for e in OPTIMIZERS if e.name == "adam")
    params = mt.tree.stack([make_params(entry, seed) for seed in range(len(lrs))])
    grads = mt.tree.map(lambda p: torch.randn_like(p), params)
    state = torch.func.vmap(entry.make().init)(params)
    if counts is not None:
        counts = torch.tensor(counts)
        state = (state[0], state[1]._replace(count=counts), state[2]._replace(count=counts))
    new = torch.func.vmap(lambda p, s, g, lr: entry.make(lr=lr).update(g, s, p))(
        params, state, grads, torch.tensor(lrs))
    for i, lr in enumerate(lrs):
        if lr >= 0 and (counts is None or counts[i] >= 0):
            want = entry.make(lr=lr).update(mt.tree.unstack(grads)[i],
                                            mt.tree.unstack(state)[i],
                                            mt.tree.unstack(params)[i])
            assert_equal(mt.tree.unstack(new)[i], want, **KERNEL_ROUNDING)


@pytest.mark.parametrize("bad", [-0.1, float("nan")])
def test_a_member_with_a_learning_rate_the_kernel_refuses_takes_the_chain(bad, calls):
    """One member's learning rate that building alone would refuse (inside vmap nothing can
    read it): every member takes the chain, as before the kernel path; the others are right."""
    vmapped_adam((0.1, bad, 0.01))
    assert calls == [None]


@pytest.mark.parametrize("count", [-1, 2**40])
def test_a_hand_edited_count_in_one_member(count, calls):
    """A negative count (which an update alone refuses) takes the chain; a huge one is that
    member's own step, in the kernel."""
    vmapped_adam((0.1, 0.01), counts=[3, count])
    assert calls == [None if count < 0 else calls[0]] and (count < 0 or calls[0] is not None)


def test_a_sweep_over_adams_learning_rate_runs_its_members_in_one_call(calls):
    """minitrain sweep's members hold their learning rate as a swept value: the kernel reads
    each member's, and every member ends where its own run ends."""
    from minitrain.train import Experiment, fit
    from minitrain.train.sweep import build_ensemble, fit_sweep, member_grid

    def build(config: dict) -> Experiment:
        def init(generator):
            return {"w": torch.randn(4, 3, generator=generator), "b": torch.zeros(3)}

        def next_batch(generator):
            return torch.randn(5, 4, generator=generator), torch.randn(5, 3, generator=generator)

        def loss(params, batch):
            return ((batch[0] @ params["w"] + params["b"] - batch[1]) ** 2).mean()

        return Experiment(init=init, loss=loss, next_batch=next_batch, steps=config["steps"],
                          optimizer=mt.optim.adam(lr=config["lr"]), name="adam-sweep")

    backend, lrs = mt.get_backend("cpu"), [0.1, 0.03, 0.01]
    grid = member_grid({"steps": 4, "lr": 0.1}, {}, {"lr": lrs}, [0])
    swept = mt.tree.unstack(fit_sweep(build_ensemble(build, grid), backend,
                                      progress=False).params)
    assert calls and all(result is not None for result in calls)
    for lr, params in zip(lrs, swept, strict=True):
        alone = fit(build({"steps": 4, "lr": lr}), backend, progress=False).params
        assert_equal(params, alone, **KERNEL_ROUNDING)


@pytest.mark.parametrize("layout", ["members on dim 1", "vmap in vmap"])
def test_members_the_kernel_cannot_address_as_slices_take_the_chain(layout, calls):
    """Members stacked on another dim (strided slices) or vmapped twice (a batched tensor
    inside): the chain's update, equal to each member's alone."""
    entry = next(e for e in OPTIMIZERS if e.name == "adam")
    params = [make_params(entry, seed) for seed in range(4)]
    grads = [make_grads(p, 1, seed=7 + i)[0] for i, p in enumerate(params)]
    opt = entry.make()
    if layout == "members on dim 1":
        dims = mt.tree.map(lambda t: 1 if t.dim() >= 2 else 0, mt.tree.stack(params))
        p, g = (mt.tree.map(lambda t, d: t.movedim(0, d).contiguous(), mt.tree.stack(x), dims)
                for x in (params, grads))
        new = mt.tree.unstack(torch.func.vmap(lambda p, g: opt.update(g, opt.init(p), p)[0],
                                              in_dims=(dims, dims))(p, g))
    else:
        p, g = (mt.tree.map(lambda t: t.reshape(2, 2, *t.shape[1:]), mt.tree.stack(x))
                for x in (params, grads))
        inner = torch.func.vmap(lambda p, g: opt.update(g, opt.init(p), p)[0])
        new = mt.tree.unstack(mt.tree.map(lambda t: t.reshape(4, *t.shape[2:]),
                                          torch.func.vmap(inner)(p, g)))
    for i in range(4):
        assert_equal(new[i], opt.update(grads[i], opt.init(params[i]), params[i])[0],
                     **KERNEL_ROUNDING)
    assert calls and all(result is None for result in calls)


@pytest.fixture
def sgd_calls(monkeypatch):
    """The results of ``members.traced_sgd`` on traced leaves (it passes others on)."""
    seen, original = [], members.traced_sgd
    wrapped = mt._torch.is_functorch_wrapped_tensor

    def spied(shape, grads, state, params):
        result = original(shape, grads, state, params)
        if any(wrapped(t) or t.requires_grad for t in mt.tree.leaves((grads, params))):
            seen.append(result)
        return result

    monkeypatch.setattr(members, "traced_sgd", spied)
    return seen


def _maml_tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g),
            "s": torch.randn((), generator=g)}


def _query_loss(p: dict, x: torch.Tensor) -> torch.Tensor:
    return ((x @ p["w"] + p["b"]) * p["s"]).pow(2).mean()


SGD_CONTEXTS = ("vmap-params", "vmap-tasks", "grad", "requires-grad")


def _adapted(context: str, update, start: dict, xs: torch.Tensor):
    """One inner step ``update(params, grads)`` in ``context``, and the outer gradient of the
    query loss after it with respect to ``start`` (second order where ``start`` is traced)."""
    def inner(p, x):
        return update(p, mt.grad(_query_loss)(p, x))

    def outer(p, x):
        return _query_loss(inner(p, x), x)

    if context == "vmap-params":  # members' params stacked, as an ensemble's
        stacked = mt.tree.stack([start, mt.tree.map(torch.neg, start)])
        return mt.vmap(inner)(stacked, xs[:2]), None
    if context == "vmap-tasks":  # shared params, tasks vmapped, as MAML's meta-loss
        meta = mt.value_and_grad(lambda p: mt.vmap(outer, in_dims=(None, 0))(p, xs).mean())
        return mt.vmap(inner, in_dims=(None, 0))(start, xs), meta(start)[1]
    if context == "grad":
        return inner(start, xs[0]), mt.grad(outer)(start, xs[0])
    leaves = mt.tree.map(lambda t: t.clone().requires_grad_(), start)
    adapted = inner(leaves, xs[0])
    grads = torch.autograd.grad(_query_loss(adapted, xs[0]), list(leaves.values()))
    return mt.tree.map(torch.detach, adapted), dict(zip(leaves, grads, strict=True))


@pytest.mark.parametrize("context", SGD_CONTEXTS)
def test_traced_plain_sgd_is_torch_optim_sgds_one_op_a_leaf(context, sgd_calls):
    """Plain SGD under vmap, grad or requiring grad takes one ``add(alpha=-lr)`` a leaf, the
    op torch.optim.SGD runs: the same bits as that op, the same second-order gradient, and the
    state the chain would give (its count advanced, its lr kept)."""
    start, lr = _maml_tree(0), 0.05
    xs = torch.randn(3, 5, 3, generator=torch.Generator().manual_seed(1))
    opt, states = mt.optim.sgd(lr=lr), []

    def ours(p, g):
        state = opt.init(p)
        new, state = opt.update(g, state, p)
        states.append(state)
        return new

    def by_hand(p, g):
        return {k: torch.add(p[k], g[k], alpha=-lr) for k in p}

    (got, got_grads), (want, want_grads) = _adapted(context, ours, start, xs), \
        _adapted(context, by_hand, start, xs)
    assert sgd_calls and all(result is not None for result in sgd_calls)
    for key in want:
        assert torch.equal(got[key], want[key]), key
        if want_grads is not None:
            torch.testing.assert_close(got_grads[key], want_grads[key], rtol=1e-6, atol=1e-7)
    lr_state = states[0][-1]
    assert int(torch.as_tensor(lr_state.count).reshape(-1)[0]) == 1
    assert float(torch.as_tensor(lr_state.lr).reshape(-1)[0]) == pytest.approx(lr)


@pytest.mark.parametrize("build", [
    lambda: mt.optim.sgd(lr=0.05, momentum=0.9), lambda: mt.optim.sgd(lr=0.05, weight_decay=0.1),
    lambda: mt.optim.sgd(lr=0.05, maximize=True),
    lambda: mt.optim.sgd(lr=lambda count: 0.05 / (1 + count)),
    lambda: mt.optim.sgd(lr=torch.tensor(0.05)),
], ids=["momentum", "weight-decay", "maximize", "schedule", "tensor-lr"])
def test_every_other_sgd_takes_the_chain_under_grad(build, sgd_calls):
    """Momentum, weight decay, maximize, a schedule or a tensor lr: the chain runs, and gives
    what the same optimizer gives eagerly."""
    opt, start = build(), _maml_tree(0)
    grads = mt.tree.map(torch.ones_like, start)

    def step(p):
        return opt.update(grads, opt.init(p), p)[0]

    traced = mt.vmap(step)(mt.tree.stack([start, start]))
    assert all(result is None for result in sgd_calls)
    for key, want in step(start).items():
        torch.testing.assert_close(traced[key][1], want)


def test_traced_sgd_with_unlike_grads_names_the_leaf():
    """A grad of another dtype than its param under grad: the chain's one-line error."""
    opt, start = mt.optim.sgd(lr=0.1), _maml_tree(0)

    def step(p):
        bad = {**mt.tree.map(torch.zeros_like, p), "b": torch.zeros(4, dtype=torch.float64)}
        return _query_loss(opt.update(bad, opt.init(p), p)[0], torch.ones(2, 3))

    with pytest.raises(ValueError, match="'b'"):
        mt.grad(step)(start)


@pytest.mark.parametrize("context", ["eager", "vmap"])
def test_a_learning_rate_state_edited_into_a_tuple_is_refused_in_one_line(context):
    """A state part replaced by a plain tuple (every tuple has a ``count`` method): the chain's
    one-line refusal, under vmap as eagerly."""
    opt, start = mt.optim.sgd(lr=0.1), _maml_tree(0)

    def step(p):
        state = opt.init(p)
        state = (state[0], tuple(state[1]))
        return opt.update(mt.tree.map(torch.ones_like, p), state, p)[0]

    with pytest.raises(ValueError, match="expected a ScaleByLearningRateState, got tuple"):
        step(start) if context == "eager" else mt.vmap(step)(mt.tree.stack([start, start]))
