"""The lowering under ``vmap``: the members' updates as one kernel call on the stacked leaves.

Under ``vmap`` the chain runs op by op, each op paying vmap's dispatch. The update rules are
elementwise, so member ``m``'s update is the kernel over slice ``m`` of each stacked leaf with
member ``m``'s numbers (its step, learning rate, swept hyperparameters): one C call over all
slices, a row of hyperparameters per slice, into stacked buffers that become the batched
results. Anything else (a clip, whose norm is per member; a leaf under another transform; a
traced number) returns None and the chain runs. Plain SGD under any transform is one op a leaf
(:func:`traced_sgd`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import decay_flags, f32_tensor, storage_holds
from minitrain.optim.kernels import lowering, pool, streaming
from minitrain.optim.kernels.checks import pointers

__all__ = ["run", "plain_sgd_lr", "traced_sgd"]

_PLAIN = (Tensor, torch.nn.Parameter)


def run(shape: Any, grads: Any, state: tuple, params: Any,
        donate: bool = False) -> tuple[Any, tuple] | None:
    """The new ``(params, state)`` of vmapped members, each updated as the chain would update
    it, or of stacked members outside vmap at a learning rate each (a 1-D ``lr``; ``donate``:
    written in place where no written leaf meets another or a grad); None where the members
    cannot run as one kernel call (the chain then runs)."""
    # plain SGD (no rule, no state) is two ops a leaf under vmap: less than the call's own cost
    if torch.compiler.is_compiling() or not shape.positions or shape.clip is not None or not \
            streaming.quiet() or not streaming.available() or \
            (shape.maximize and not shape.rule.folds_sign):
        return None
    top = _torch.peek_interpreter_stack()
    if top is None or top.key() != _torch.vmap_transform:
        return _per_member(shape, grads, state, params, donate)
    level = top.level()

    def take(value: Any) -> Any:  # a batched tensor's members, stacked on dim 0
        if not isinstance(value, Tensor) or _torch.maybe_get_level(value) != level:
            return value
        inner, dim = _torch.unwrap_batched(value, level)
        return inner.movedim(dim, 0) if dim else inner

    p_leaves, structure = _pytree.tree_flatten(params)
    g_leaves = _pytree.tree_leaves(grads)
    if not p_leaves or len(g_leaves) != len(p_leaves) or any(
            _torch.maybe_get_level(t) != level for t in (*p_leaves, *g_leaves)):
        return None
    ps, gs = [take(p) for p in p_leaves], [take(g) for g in g_leaves]
    hyper = {}  # each member's swept hyperparameters (a swept value resolves to its members)
    for value in (*shape.hyper.values(), shape.lr, *(pair[0] for pair in (
            shape.l2, shape.decoupled) if pair is not None)):
        if isinstance(value, Tensor) and value.dim() == 0:
            stacked = take(value if type(value) in _PLAIN else value.detach())
            if stacked.dim() == 1:
                hyper[id(value)] = stacked.tolist()
            elif type(value) not in _PLAIN:
                return None  # a subclass whose value the kernel cannot read
    # the states the update reads, their leaves stacked; each member's counts as Python numbers
    read_at = [i for i in (*shape.positions, shape.lr_position) if i is not None]
    stacked_state = list(state)
    numbers: dict[int, list] = {}
    for i in read_at:
        fields = {}
        for key, value in state[i]._asdict().items():
            fields[key] = _pytree.tree_map(take, value)
            if isinstance(value, Tensor) and value.dim() == 0 and fields[key] is not value and \
                    (i in shape.positions or key == "count"):  # (the lr state's lr is not read)
                numbers[id(fields[key])] = fields[key].tolist()
        stacked_state[i] = state[i]._replace(**fields)
    return _stacked(shape, (ps, gs, params, structure), state, stacked_state, numbers, hyper,
                    lambda t: _torch.add_batch_dim(t, 0, level), lambda values, dtype:
                    _torch.add_batch_dim(torch.tensor(values, dtype=dtype, device="cpu"), 0, level))


def _per_member(shape: Any, grads: Any, state: tuple, params: Any,
                donate: bool) -> tuple[Any, tuple] | None:
    """Stacked members outside vmap, member ``m`` (slice ``m`` of each leaf) at ``lr[m]``."""
    lr = shape.lr
    if not isinstance(lr, Tensor) or type(lr) not in _PLAIN or lr.dim() != 1 or \
            lr.requires_grad or _torch.is_functorch_wrapped_tensor(lr) or \
            _torch.forward_ad_active() or not isinstance(state, tuple) or \
            len(state) != shape.length:
        return None
    p_leaves, structure = _pytree.tree_flatten(params)
    g_leaves, g_structure = _pytree.tree_flatten(grads)
    if g_structure != structure or not p_leaves or p_leaves[0].shape[:1] != lr.shape:
        return None  # (the chain names the fault)
    found = _stacked(shape, (p_leaves, g_leaves, params, structure), state, list(state), {},
                     {id(lr): lr.tolist()}, lambda t: t,
                     lambda values, dtype: torch.scalar_tensor(values[0], dtype=dtype), donate)
    if found is None:
        return None
    new_state = list(found[1])
    new_state[shape.lr_position] = new_state[shape.lr_position]._replace(lr=f32_tensor(lr))
    return found[0], tuple(new_state)


def _stacked(shape: Any, leaves: tuple, state: tuple, stacked_state: list, numbers: dict,
             hyper: dict, wrap: Any, number: Any, donate: bool = False) -> tuple[Any, tuple] | None:
    """The members' update as one kernel call over ``leaves`` (stacked params, grads, the
    params and their structure), its results ``wrap``-ped; the new state's numbers
    ``number(values, dtype)`` makes. ``donate``: into the params and buffers, where no written
    storage meets another or a grad's (else into new ones)."""
    ps, gs, params, structure = leaves
    size = ps[0].shape[0]
    reads = _reads(shape, stacked_state, numbers, hyper, size)
    if reads is None:
        return None
    rule_states = [stacked_state[i] for i in shape.positions]
    buffers, fields = lowering._buffers(shape, rule_states, reads[0])
    decay = shape.l2 or shape.decoupled
    flags = [True] * len(ps) if decay is None or (decay[1] is None and not any(
        r.wd for r in reads)) else decay_flags(decay[1], params)  # a mask sees a member's leaf
    if buffers is None or any(t.shape[:1] != (size,) for t in (*ps, *gs)):
        return None
    rows = [ps, gs, *buffers]
    found = pointers(rows, dtype=torch.float32, read=1 if donate else None)
    if found is None and donate:  # leaves that meet: into new buffers
        donate, found = False, pointers(rows, dtype=torch.float32)
    if found is None:
        return None
    if donate:
        results, written = [ps, *buffers], [found[0], *found[2:]]
    else:
        outputs = pool.current()
        outputs.begin_update()
        results = [None if row is None else outputs(row) for row in (ps, *buffers)]
        written = pointers(results, like=ps)
    hp = _hyperparameter_rows(shape, reads, flags)
    if written is None or hp is None:
        return None
    streaming.launch(hp[0], hp[1], [*found, *written],
                     [t.numel() // size for t in ps for _ in range(size)], False, members=size)
    if donate:  # written in place: their versions bumped, as an in-place op's are
        torch.autograd.graph.increment_version([t for row in results if row is not None
                                                for t in row])
    new = [None if row is None else [wrap(t) for t in row] for row in results]
    return tree.unflatten(structure, new[0]), lowering._new_state(
        shape, state, fields, new[1:], structure, reads, number)


def _reads(shape: Any, stacked_state: list, numbers: dict[int, list], hyper: dict[int, list],
           size: int) -> list | None:
    """Each member's :class:`~.lowering.Read` (one read where only learning rates differ)."""
    lr_values = hyper.get(id(shape.lr))
    others = [values for key, values in hyper.items() if key != id(shape.lr)]
    reads, seen = [], {}
    for m in range(size):
        signature = tuple(values[m] for values in (*numbers.values(), *others))
        read = seen.get(signature)
        if read is None:
            def pick(value: Any, m: int = m) -> Any:
                found = hyper.get(id(value)) if isinstance(value, Tensor) else None
                return value if found is None else found[m]

            member_state = list(stacked_state)
            for i in (*shape.positions, shape.lr_position):
                if i is not None and numbers:
                    member_state[i] = stacked_state[i]._replace(**{
                        key: value[m] for key, value in stacked_state[i]._asdict().items()
                        if id(value) in numbers})
            read = seen[signature] = lowering._read(
                _member_shape(shape, pick), tuple(member_state),
                [member_state[i] for i in shape.positions])
            if read is None:
                return None
        elif lr_values is not None:
            if not lr_values[m] >= 0:
                return None
            read = read._replace(lr=float(lr_values[m]))
        reads.append(read)
    return reads


def _member_shape(shape: Any, pick: Any) -> Any:
    """``shape`` with each batched hyperparameter replaced by one member's."""
    return shape._replace(
        hyper={key: pick(value) for key, value in shape.hyper.items()}, lr=pick(shape.lr),
        l2=shape.l2 and (pick(shape.l2[0]), shape.l2[1]),
        decoupled=shape.decoupled and (pick(shape.decoupled[0]), shape.decoupled[1]))


def _hyperparameter_rows(shape: Any, reads: list, flags: list[bool]) -> tuple[int, list] | None:
    """The kernel's index and hyperparameters of each member (where every leaf's weight decay
    is alike), else of each (leaf, member) slice, leaf by leaf."""
    sign, rows, names = -1.0 if shape.maximize else 1.0, {}, set()
    for on in set(flags):
        for m, read in enumerate(reads):
            wd = read.wd if on else 0.0
            frame = lowering.Frame(sign, wd if shape.l2 is not None else 0.0, read.lr,
                                   wd if shape.decoupled is not None else 0.0)
            name, hp, _ = shape.rule.kernel(read.step, read.hyper, read.per_step, frame)
            rows[on, m] = [float(v) for v in hp]
            names.add(name)
    if len(names) != 1:
        return None
    return streaming.RULES[names.pop()][0], [rows[on, m] for on in (
        flags[:1] if len(set(flags)) == 1 else flags) for m in range(len(reads))]


def plain_sgd_lr(shape: Any) -> float | None:
    """The lr of plain SGD (a constant lr; no momentum, weight decay, clip or maximize), whose
    update is ``p.add(g, alpha=-lr)`` a leaf, torch.optim.SGD's one op; None for any other
    shape, and where the compiler traces or a torch mode watches (they see the chain)."""
    if shape is None or type(shape.lr) is not float or shape.positions or shape.clip is not None \
            or shape.maximize or shape.decoupled is not None or torch.compiler.is_compiling() or \
            (shape.l2 is not None and lowering._number(shape.l2[0]) != 0.0) or \
            not streaming.quiet():
        return None
    return shape.lr


def traced_sgd(shape: Any, grads: Any, state: tuple, params: Any) -> tuple[Any, tuple] | None:
    """:func:`plain_sgd_lr`'s update on leaves under ``vmap`` or ``grad`` or requiring grad
    (MAML's inner loop), for the chain's scale, add and checks; None for anything else (first,
    so a traced SGD skips the kernels' checks)."""
    lr = plain_sgd_lr(shape)
    if lr is None or not isinstance(state, tuple) or len(state) != shape.length:
        return None
    p_leaves, structure = _pytree.tree_flatten(params)
    g_leaves, g_structure = _pytree.tree_flatten(grads)
    leaves, wrapped = [*p_leaves, *g_leaves], _torch.is_functorch_wrapped_tensor
    if not any(isinstance(t, Tensor) and (wrapped(t) or t.requires_grad) for t in leaves):
        return None  # untraced: the kernel's
    lr_state = state[shape.lr_position]

    def dense(t: Any) -> bool:  # traced, or a plain strided tensor its storage holds
        return isinstance(t, Tensor) and (wrapped(t) or type(t) in _PLAIN and
                                          t.layout is torch.strided and storage_holds(t))

    if g_structure != structure or getattr(lr_state, "_fields", None) != ("count", "lr") or \
            not all(map(dense, leaves)) or not all(
            p.is_floating_point() and g.dtype == p.dtype and g.shape == p.shape
            for p, g in zip(p_leaves, g_leaves, strict=True)):
        return None  # the chain checks and names the fault
    new_state = list(state)
    new_state[shape.lr_position] = lr_state._replace(
        count=lr_state.count + 1, lr=torch.scalar_tensor(lr, dtype=torch.float32))
    return tree.unflatten(structure, [torch.add(p, g, alpha=-lr) for p, g in zip(
        p_leaves, g_leaves, strict=True)]), tuple(new_state)
