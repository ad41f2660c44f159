"""Every optimizer of the registry (``tests/optim/conftest.py``) through the same checks, as
optax's ``alias_test.py`` runs its ``_OPTIMIZERS_UNDER_TEST``.

* the reference, step for step (torch.optim, lion-pytorch, schedulefree; Muon's harness), in a
  few configurations: the defaults, weight decay, ``maximize``, a schedule, and a differentiable
  update (leaves that require grad, under grad mode); random trees by hypothesis;
* pytree kinds (dict, list, tuple, NamedTuple, nested, empty) and mixed dtypes;
* purity (a pure update writes none of its inputs and returns none of their memory),
  ``donate=True`` equal to the pure update, the update equal to its chain's, bit for bit, and
  threads sharing one optimizer;
* accounting: ``state_bytes`` equals the init state's bytes and the reference's state, and the
  accounting Counter counts every update alike;
* transforms of the update: ``vmap`` over a stacked ensemble, ``torch.func.grad`` through it,
  a checkpoint round trip, ``learning_rate`` following a schedule.

Hostile inputs run over the same registry in ``test_alias_hostile.py``. States are walked,
never unpacked by field: an alias's state is whatever its ``init`` returns.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import minitrain as mt
from tests.optim.conftest import (
    ATOL,
    BY_NAME,
    DECAYED,
    KERNEL_ROUNDING,
    OPTAX_ONLY,
    OPTIMIZERS,
    REFERENCED,
    ROUNDING,
    RTOL,
    SCHEDULABLE,
    SCHEDULED,
    TAKES_VALUE,
    Entry,
    assert_equal,
    clones,
    make_grads,
    make_params,
    run,
    run_reference,
    tensors,
)
from tests.optim_db_harness import SCALAR_KEYS, named_buffers

STEPS = 6  # RAdam's rectified branch starts at update 6

ids = str


# --------------------------------------------------------------------------------------------
# The registry


def exported_optimizers() -> set[str]:
    """Every function ``mt.optim`` exports that builds an Optimizer from its defaults."""
    found = set()
    for name in mt.optim.__all__:
        value = getattr(mt.optim, name)
        if not inspect.isfunction(value) or any(
                p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                for p in inspect.signature(value).parameters.values()):
            continue
        try:
            built = value()
        except Exception:  # noqa: BLE001  (a function that needs arguments builds nothing)
            continue
        if isinstance(built, mt.optim.Optimizer):
            found.add(name)
    return found


def test_the_registry_holds_every_optimizer_mt_optim_exports():
    exported = exported_optimizers()
    registered = {entry.alias for entry in OPTIMIZERS + OPTAX_ONLY} | set(TAKES_VALUE)
    assert exported - registered == set(), "add these to tests/optim/conftest.py's OPTIMIZERS"
    assert registered - exported == set(), "the registry names what mt.optim does not export"
    assert len(BY_NAME) == len(OPTIMIZERS), "registry names must be unique"


# --------------------------------------------------------------------------------------------
# Against the reference, step for step


def check_buffers(params: Any, state: Any, optimizer: Any) -> None:
    """Every per-leaf buffer the reference keeps equals the state's buffer of that name."""
    buffers = {field: dict(mt.tree.named_leaves(tree))
               for field, tree in named_buffers(state).items()}
    names = [name for name, _ in mt.tree.named_leaves(params)]
    for name, p in zip(names, optimizer.param_groups[0]["params"], strict=True):
        for key, value in optimizer.state[p].items():
            if key in SCALAR_KEYS or not isinstance(value, torch.Tensor):
                continue
            assert key in buffers, f"the state has no {key!r} (it has {sorted(buffers)})"
            torch.testing.assert_close(buffers[key][name].detach(), value, rtol=RTOL, atol=ATOL)


def halving(lr: float) -> mt.optim.Schedule:
    return mt.optim.step_schedule(lr, step_size=2, gamma=0.5)


CONFIGS = {  # name: (the entries it applies to, options)
    "defaults": (REFERENCED, {}),
    "weight_decay": (DECAYED, {"weight_decay": 0.1}),
    "maximize": (REFERENCED, {"maximize": True}),
    "schedule": (SCHEDULED, {"lr": halving}),
    "differentiable": (REFERENCED, {}),
}
CASES = [pytest.param(entry, config, id=f"{entry}-{config}")
         for config, (entries, _) in CONFIGS.items() for entry in entries]


@pytest.mark.parametrize(("entry", "config"), CASES)
def test_matches_the_reference_step_for_step(entry, config):
    options = dict(CONFIGS[config][1])
    lrs = None
    if "lr" in options:
        lrs = options["lr"] = options["lr"](entry.kwargs["lr"])
    differentiable = config == "differentiable"
    params = make_params(entry)
    grads_seq = make_grads(params, STEPS)
    want, reference = run_reference(entry, params, grads_seq, lrs=lrs,
                                     **{k: v for k, v in options.items() if k != "lr"})
    opt = entry.make(**options)
    ours = mt.tree.map(lambda p: p.clone().requires_grad_(differentiable), params)
    state = opt.init(ours)
    with torch.set_grad_enabled(differentiable):
        for step, grads in enumerate(grads_seq):
            ours, state = opt.update(grads, state, ours)
            for got, expected in zip(mt.tree.leaves(ours), want[step], strict=True):
                torch.testing.assert_close(got.detach(), expected, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, step=step: f"update {step + 1}: {m}")
    assert all(p.requires_grad == differentiable for p in mt.tree.leaves(ours))
    check_buffers(params, state, reference)


@pytest.mark.parametrize("entry", [e for e in OPTIMIZERS if e.harness is not None], ids=ids)
def test_matches_its_harness_step_for_step(entry):
    entry.harness()


@settings(max_examples=30, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_hypothesis_random_trees_match_the_reference(data, seed):
    """Leaves of random shapes, 0-size dims included, in random containers."""
    entry = data.draw(st.sampled_from(REFERENCED), label="entry")
    shapes = data.draw(st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1,
                                max_size=4), label="shapes")
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(tuple(shape), generator=g) for shape in shapes]
    params = {"head": leaves[0], "layers": [{"weight": leaf} for leaf in leaves[1:]]}
    grads_seq = make_grads(params, 3, seed + 1)
    try:
        want, reference = run_reference(entry, params, grads_seq)
    except ZeroDivisionError:  # torch's Adafactor divides by the size of a 0-size leaf
        assume(False)
    ours, state = run(entry.make(), params, grads_seq)
    for got, expected in zip(mt.tree.leaves(ours), want[-1], strict=True):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    check_buffers(params, state, reference)


# --------------------------------------------------------------------------------------------
# Pytree kinds


class Pair(NamedTuple):
    first: Any
    second: Any


KINDS = {  # four leaves into a tree
    "dict": lambda a, b, c, d: {"a": a, "b": b, "c": c, "d": d},
    "list": lambda a, b, c, d: [a, b, c, d],
    "tuple": lambda a, b, c, d: (a, b, c, d),
    "namedtuple": lambda a, b, c, d: Pair(a, [b, c, d]),
    "nested": lambda a, b, c, d: {"x": [a, {"y": (b,)}], "z": Pair(c, {"e": [d]})},
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_every_kind_of_pytree_updates_as_a_flat_list(entry, kind):
    leaves = mt.tree.leaves(make_params(entry))
    grads_seq = make_grads(leaves, 2)
    flat, flat_state = run(entry.make(), leaves, grads_seq)
    build = KINDS[kind]
    tree, tree_state = run(entry.make(), build(*leaves), [build(*g) for g in grads_seq])
    assert mt.tree.structure(tree) == mt.tree.structure(build(*leaves))
    assert_equal(mt.tree.leaves(tree), flat)
    assert_equal(tensors(tree_state), tensors(flat_state))


@pytest.mark.parametrize("empty", [{}, []], ids=["dict", "list"])
@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_an_empty_pytree_updates_to_an_empty_one_or_is_refused_in_one_line(entry, empty):
    opt = entry.make()
    try:
        new, state = run(opt, empty, [empty, empty])
    except ValueError as error:
        assert "\n" not in str(error), error
        return
    assert new == empty and type(new) is type(empty)
    assert mt.tree.leaves(opt.update(empty, state, new)[0]) == []


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_tree_of_mixed_dtypes_updates_each_leaf_as_alone(entry):
    params = make_params(entry)
    params["w"] = params["w"].double()
    params["b"][0] = params["b"][0].bfloat16()
    grads_seq = make_grads(params, 2)
    together, _ = run(entry.make(), params, grads_seq)
    for (name, got), leaf, *grads in zip(mt.tree.named_leaves(together),
                                         mt.tree.leaves(params),
                                         *[mt.tree.leaves(g) for g in grads_seq], strict=True):
        (alone,), _ = run(entry.make(), [leaf], [[g] for g in grads])
        assert got.dtype == leaf.dtype, name
        torch.testing.assert_close(got, alone, **ROUNDING)


# --------------------------------------------------------------------------------------------
# Purity, donation, the chain


def versions(tree: Any) -> list[int]:
    return [t._version for t in tensors(tree)]


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_pure_update_writes_none_of_its_inputs(entry):
    opt = entry.make()
    params = make_params(entry)
    state = opt.init(params)
    for grads in make_grads(params, 3):
        inputs = (params, grads, state)
        before, seen = clones(inputs), versions(inputs)
        new_params, new_state = opt.update(grads, state, params)
        assert versions(inputs) == seen
        assert_equal(inputs, before)
        params, state = new_params, new_state


def storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors(tree) if t.numel()}


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_pure_update_returns_no_memory_the_caller_holds(entry):
    """Nothing returned shares memory with an input, and what earlier updates returned (held
    whole, or only a view of it) is never written by a later one."""
    opt = entry.make()
    params = make_params(entry)
    state = opt.init(params)
    held, copies = [], []
    for step, grads in enumerate(make_grads(params, 4)):
        new_params, new_state = opt.update(grads, state, params)
        assert not storages((new_params, new_state)) & storages((params, grads, state))
        params, state = new_params, new_state
        held.append((params, state) if step % 2 else params["w"][1:])
        copies.append(clones(held[-1]))
    for kept, copy in zip(held, copies, strict=True):
        assert_equal(kept, copy)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_donated_update_equals_the_pure_one(entry):
    params = make_params(entry)
    grads_seq = make_grads(params, 3)
    pure = run(entry.make(), params, grads_seq)
    donated = run(entry.make(), clones(params), grads_seq, donate=True)
    assert_equal(donated, pure, **KERNEL_ROUNDING)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_the_update_equals_its_chain_to_rounding(entry):
    """``opt.update`` (which may run a fused kernel) against the transformation it was built
    from, run op by op, then ``apply_updates``: a kernel orders its float32 ops otherwise."""
    opt = entry.make()
    chain = opt.update.transformation
    params = make_params(entry)
    ours, state = params, opt.init(params)
    by_chain, chain_state = params, chain.init(params)
    for grads in make_grads(params, 3):
        ours, state = opt.update(grads, state, ours)
        updates, chain_state = chain.update(grads, chain_state, by_chain)
        by_chain = mt.optim.apply_updates(by_chain, updates)
    assert_equal((ours, state), (by_chain, chain_state), **KERNEL_ROUNDING)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_threads_sharing_one_optimizer_update_as_one_thread_alone(entry):
    opt = entry.make()
    runs = [(make_params(entry, seed), make_grads(make_params(entry, seed), 3, seed + 10))
            for seed in range(3)]
    alone = [run(opt, params, grads_seq) for params, grads_seq in runs]
    together: dict[int, Any] = {}

    def work(index: int) -> None:
        together[index] = run(opt, *runs[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert_equal([together[i] for i in range(len(runs))], alone)


# --------------------------------------------------------------------------------------------
# Accounting


def buffer_bytes(state: Any) -> int:
    return sum(t.nbytes for tree in named_buffers(state).values() for t in tensors(tree))


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_state_bytes_equal_the_init_states_buffers(entry):
    params = make_params(entry)
    state = entry.make().init(params)
    assert mt.accounting.state_bytes(entry.alias, params, **entry.kwargs) == buffer_bytes(state)
    shapes = mt.tree.map(lambda p: tuple(p.shape), params)
    assert mt.accounting.state_bytes(entry.alias, shapes, **entry.kwargs) == buffer_bytes(state)


@pytest.mark.parametrize("entry", REFERENCED, ids=ids)
def test_state_bytes_equal_the_references_state(entry):
    params = make_params(entry)
    _, reference = run_reference(entry, params, make_grads(params, 1))
    kept = sum(value.nbytes for leaf_state in reference.state.values()
               for key, value in leaf_state.items()
               if isinstance(value, torch.Tensor) and key not in SCALAR_KEYS)
    assert mt.accounting.state_bytes(entry.alias, params, **entry.kwargs) == kept


def test_state_bytes_of_an_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(ValueError, match="adafactor"):
        mt.accounting.state_bytes("adamwx", [(2,)])


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_the_counter_counts_an_update_alike_every_time_it_is_made(entry):
    """The first update of a new optimizer and the same update made again count the same
    FLOPs (nothing an update learns on first use is counted), and every op is known."""
    from minitrain.accounting import Counter

    params = make_params(entry)
    grads = make_grads(params, 1)[0]
    counts = []
    for _ in range(2):
        opt = entry.make()
        with Counter() as counter:
            opt.update(grads, opt.init(params), params)
        counts.append((counter.flops, dict(counter.unknown)))
    assert counts[0] == counts[1] and counts[0][1] == {}
    assert counts[0][0] > 0


# --------------------------------------------------------------------------------------------
# vmap, grad, checkpoints, learning_rate


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_updates_under_vmap_over_a_stacked_ensemble_equal_each_member(entry):
    members = [make_params(entry, seed) for seed in range(3)]
    grads_seq = [mt.tree.stack(g) for g in zip(*[make_grads(p, 2, seed=9 + i)
                                                for i, p in enumerate(members)], strict=True)]
    opt = entry.make()
    stacked = mt.tree.stack(members)
    state = torch.func.vmap(opt.init)(stacked)
    for grads in grads_seq:
        stacked, state = torch.func.vmap(opt.update)(grads, state, stacked)
    for i, member in enumerate(members):
        alone, alone_state = run(entry.make(), member,
                                 [mt.tree.unstack(g)[i] for g in grads_seq])
        assert_equal(mt.tree.unstack((stacked, state))[i], (alone, alone_state),
                     rtol=RTOL, atol=ATOL)


def one_update_loss(entry: Entry, params: Any) -> torch.Tensor:
    """The squared norm of the params after one update whose grads depend on the params."""
    opt = entry.make()
    shift = make_params(entry, seed=5, dtype=torch.float64)
    grads = mt.tree.map(lambda p, s: 2.0 * p + s, params, shift)
    new, _ = opt.update(grads, opt.init(params), params)
    return sum((p**2).sum() for p in mt.tree.leaves(new))


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_the_update_is_differentiable_by_torch_func_grad_as_by_autograd(entry):
    params = make_params(entry, dtype=torch.float64)
    by_func = torch.func.grad(lambda p: one_update_loss(entry, p))(params)
    leaves = mt.tree.map(lambda p: p.clone().requires_grad_(), params)
    by_autograd = torch.autograd.grad(one_update_loss(entry, leaves), mt.tree.leaves(leaves))
    for a, b in zip(mt.tree.leaves(by_func), by_autograd, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if entry.reference is None:
        return  # Muon's Newton-Schulz rounds to bfloat16: no finite differences
    direction = make_params(entry, seed=6, dtype=torch.float64)
    h = 1e-6
    with torch.no_grad():
        fd = (one_update_loss(entry, mt.tree.map(lambda p, d: p + h * d, params, direction))
              - one_update_loss(entry, mt.tree.map(lambda p, d: p - h * d, params, direction))
              ) / (2 * h)
    directional = sum((g * d).sum() for g, d in zip(mt.tree.leaves(by_func),
                                                     mt.tree.leaves(direction), strict=True))
    torch.testing.assert_close(directional, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=ids)
def test_a_state_round_trips_through_a_checkpoint(entry, tmp_path):
    opt = entry.make()
    params = make_params(entry)
    grads_seq = make_grads(params, 3)
    params, state = run(opt, params, grads_seq[:2])
    path = mt.checkpoint.save(tmp_path, 2, params, state)
    template = make_params(entry, seed=7)
    loaded = mt.checkpoint.load(path, template, opt.init(template))
    assert_equal((loaded.params, loaded.opt_state), (params, state))
    assert_equal(opt.update(grads_seq[2], loaded.opt_state, loaded.params),
                 opt.update(grads_seq[2], state, params))


@pytest.mark.parametrize("entry", SCHEDULABLE, ids=ids)
def test_learning_rate_is_the_schedules_value_at_the_last_update(entry):
    schedule = halving(entry.kwargs["lr"])
    opt = entry.make(lr=schedule)
    params = make_params(entry)
    state = opt.init(params)
    assert mt.optim.learning_rate(state) == pytest.approx(schedule(0), rel=1e-6)
    for step, grads in enumerate(make_grads(params, 4)):
        params, state = opt.update(grads, state, params)
        assert mt.optim.learning_rate(state) == pytest.approx(schedule(step), rel=1e-6)
