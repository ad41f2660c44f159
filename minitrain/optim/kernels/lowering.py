"""The one lowering: a chain shaped like a torch.optim update runs as one kernel call.

:func:`lower` recognises the chain

    [clip_by_global_norm] [scale(-1)] [add_decayed_weights] RULE [add_decayed_weights]
    [scale_by_learning_rate]

where RULE is a row of :data:`RULES`, and runs it as one kernel call per weight-decay group
over all leaves: the streaming C kernel on float32 CPU leaves (into recycled buffers
(:mod:`.pool`) or, donated, in place), else torch's fused CPU kernel where the rule has one
(bf16, fp16, fp64; float32 without a C compiler); vmapped members: :mod:`.members`.
Whenever it cannot take a call (grad, torch.compile, a torch mode, another device, leaves the
kernels cannot address, a traced hyperparameter, ...) it returns None and the chain, the
definition, runs; the kernels are tested equal to it (``docs/explanation/kernels.md``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain._torch import pytree as _pytree
from minitrain.optim._checks import _PLAIN, decay_flags, is_traced
from minitrain.optim.kernels import pool, streaming
from minitrain.optim.kernels.checks import pointers

__all__ = ["lower", "RULES"]


class Frame(NamedTuple):
    """What the chain does around its rule, as numbers for one update of one leaf group."""

    sign: float  # -1.0 when maximizing (times the clip's factor where the rule folds it)
    l2: float  # weight decay added to the grad before the rule
    lr: float | None  # None: the rule's output is the whole step
    decoupled: float  # weight decay applied to the params after the rule (AdamW)


class Rule(NamedTuple):
    """A row of :data:`RULES`: ``kernel(step, hyper, per_step, frame)`` gives the C kernel's rule
    name, hyperparameters and state buffers (``(rule transformation index, field)`` or None) in its
    slot order, None for hyperparameters it does not take; ``fused``: torch's kernel."""

    kernel: Callable[..., tuple[str, list, tuple] | None]
    fused: Callable[..., None] | None = None
    folds_sign: bool = False  # the C kernel multiplies the grads by ``frame.sign`` itself
    family: bool = False  # a family rule: its own step without scale_by_learning_rate
    decoupled: bool = True  # it takes decoupled weight decay (AdamW's)
    # what torch's CPU fused kernel takes (its fused SGD skips half-precision elements in
    # whole SIMD blocks)
    fused_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16,
                                             torch.float16)


def _adam(step, h, per_step, f):
    b1, b2, decoupled = h["beta1"], h["beta2"], f.decoupled != 0
    return "adam", [b1, b2, h["eps"], f.decoupled if decoupled else f.l2, f.lr,
                    f.lr / (1 - b1**step), math.sqrt(1 - b2**step), decoupled, h["amsgrad"],
                    f.sign], \
        ((0, "exp_avg"), (0, "exp_avg_sq"), (0, "max_exp_avg_sq") if h["amsgrad"] else None)


def _sgd(step, h, per_step, f):
    momentum = h.get("momentum", 0.0)
    return "sgd", [f.lr, momentum, h.get("dampening", 0.0), f.l2, h.get("nesterov", False),
                   step == 1, momentum != 0], ((0, "momentum_buffer") if momentum else None,)


def _adagrad(step, h, per_step, f):
    return "adagrad", [f.lr / (1 + (step - 1) * h["lr_decay"]), f.l2, h["eps"]], ((0, "sum"),)


def _rmsprop(step, h, per_step, f):
    if h.get("dampening", 0.0) != 0 or h.get("nesterov"):
        return None
    momentum = h.get("momentum", 0.0)
    return "rmsprop", [f.lr, h["alpha"], h["eps"], f.l2, momentum, h["centered"],
                       momentum != 0], ((0, "square_avg"), (1, "momentum_buffer") if momentum
                                        else None, (0, "grad_avg") if h["centered"] else None)


def _family(kernel):
    """A family rule (one transformation carrying its ``rule``): ``kernel(step, hyper,
    per_step)`` gives its C kernel's name, its hyperparameters after the frame the family's
    kernels share, and the state fields it reads and writes, in its slot order. Each is the
    step of the rule's per-leaf function (``nadam_leaf``, ...) with the step-dependent scalars
    computed here in float64; the tests hold each equal to its rule."""

    def planned(step, h, per_step, f):
        name, rule_hp, fields = kernel(step, h, per_step)
        lr = f.lr or 0.0
        frame = [f.sign, f.l2, lr, 1 - lr * f.decoupled, float(f.lr is not None)]
        return name, frame + list(rule_hp), tuple((0, field) for field in fields)

    return Rule(planned, folds_sign=True, family=True)


def _adadelta(step, hyper, per_step):
    rho = hyper["rho"]
    return "adadelta", [rho, 1 - rho, hyper["eps"]], ("square_avg", "acc_delta")


def _adamax(step, hyper, per_step):
    beta1, beta2 = hyper["beta1"], hyper["beta2"]
    return "adamax", [1 - beta1, beta2, hyper["eps"], 1 - beta1**step], ("exp_avg", "exp_inf")


def _lion(step, hyper, per_step):
    return "lion", [1 - hyper["beta1"], 1 - hyper["beta2"]], ("exp_avg",)


def _nadam(step, hyper, per_step):
    # sqrt(1 - beta2^t) folded into the coefficients
    beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
    root = math.sqrt(1 - beta2**step)
    return "nadam", [1 - beta1, beta2, 1 - beta2, eps * root, per_step["grad_coef"] * root,
                     per_step["avg_coef"] * root], ("exp_avg", "exp_avg_sq")


def _radam(step, hyper, per_step):
    beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
    bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2**step / bias_correction2
    rectified = rho_t > 5.0
    factor = 0.0
    if rectified:
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                         / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        factor = rect * math.sqrt(bias_correction2) / bias_correction1
    return "radam", [1 - beta1, beta2, 1 - beta2, eps, float(rectified), bias_correction1,
                     factor], ("exp_avg", "exp_avg_sq")


def _schedule_free(step, hyper, per_step):
    # the new y is y plus the change (see _family.Rule)
    beta1, beta2 = hyper["beta1"], hyper["beta2"]
    lr_t, ckp1 = per_step["lr_t"], per_step["ckp1"]
    return "schedule_free_adamw", [
        beta2, 1 - beta2, per_step["bias_correction2"], hyper["eps"], hyper["weight_decay"],
        lr_t * (beta1 * (1 - ckp1) - 1), ckp1, lr_t], ("z", "exp_avg_sq")


def _steps(step, ps):
    return [torch.tensor(float(step), dtype=torch.float32, device=ps[0].device)] * len(ps)


def _fused_adam(ps, gs, buffers, step, h, f, maximize):
    kernel = _torch.fused_adamw_ if f.decoupled else _torch.fused_adam_
    kernel(ps, gs, buffers[0], buffers[1], buffers[2] or [], _steps(step, ps), lr=f.lr,
           beta1=h["beta1"], beta2=h["beta2"], weight_decay=f.decoupled or f.l2, eps=h["eps"],
           amsgrad=h["amsgrad"], maximize=maximize)


def _fused_sgd(ps, gs, buffers, step, h, f, maximize):
    _torch.fused_sgd_(ps, gs, buffers[0] or [], weight_decay=f.l2, lr=f.lr,
                      momentum=h.get("momentum", 0.0), dampening=h.get("dampening", 0.0),
                      nesterov=h.get("nesterov", False), maximize=maximize, is_first_step=step == 1)


def _fused_adagrad(ps, gs, buffers, step, h, f, maximize):
    _torch.fused_adagrad_(ps, gs, buffers[0], _steps(step, ps), lr=f.lr, lr_decay=h["lr_decay"],
                          weight_decay=f.l2, eps=h["eps"], maximize=maximize)


_FULL = (torch.float32, torch.float64)
RULES: dict[tuple[str, ...], Rule] = {
    ("scale_by_adam",): Rule(_adam, _fused_adam, folds_sign=True),
    (): Rule(_sgd, _fused_sgd, fused_dtypes=_FULL, decoupled=False),
    ("trace",): Rule(_sgd, _fused_sgd, fused_dtypes=_FULL, decoupled=False),
    ("scale_by_adagrad",): Rule(_adagrad, _fused_adagrad, decoupled=False),
    ("scale_by_rms",): Rule(_rmsprop, decoupled=False),
    ("scale_by_rms", "trace"): Rule(_rmsprop, decoupled=False),
    ("scale_by_adadelta",): _family(_adadelta),
    ("scale_by_adamax",): _family(_adamax),
    ("scale_by_lion",): _family(_lion),
    ("scale_by_nadam",): _family(_nadam),
    ("scale_by_radam",): _family(_radam),
    ("scale_by_schedule_free_adamw",): _family(_schedule_free),
}
"""Rules by the names of their transformations."""


class Shape(NamedTuple):
    """Where each part of a recognised chain sits (indices into the chain's transformations)."""

    clip: Any  # max_norm, or None
    maximize: bool
    l2: tuple[Any, Any] | None  # (weight_decay, mask)
    rule: Rule
    positions: tuple[int, ...]  # the rule's transformations
    hyper: dict[str, Any]
    decoupled: tuple[Any, Any] | None
    lr: Any  # a number, a tensor, a schedule; None without scale_by_learning_rate
    lr_position: int | None
    length: int  # how many transformations the chain holds


def _spec(tx: Any) -> tuple[str, dict] | None:
    return getattr(getattr(tx, "update", None), "minitrain_spec", None)


def _recognise(tx: Any) -> Shape | None:
    found = _spec(tx)
    if found is None or found[0] != "chain":
        return None
    specs = [_spec(inner) for inner in found[1]["transforms"]]
    if any(s is None for s in specs):
        return None
    names = [name for name, _ in specs]
    i, j = 0, len(names)
    clip = lr = l2 = decoupled = lr_position = None
    if names[:1] == ["clip_by_global_norm"]:
        clip, i = specs[0][1]["max_norm"], 1
    maximize = names[i:i + 1] == ["scale"] and _number(specs[i][1]["step_size"]) == -1.0
    i += maximize
    if names[i:i + 1] == ["add_decayed_weights"]:
        l2, i = (specs[i][1]["weight_decay"], specs[i][1]["mask"]), i + 1
    if j > i and names[j - 1] == "scale_by_learning_rate" and specs[j - 1][1]["sign"] == -1:
        lr, lr_position, j = specs[j - 1][1]["learning_rate"], j - 1, j - 1
    if j > i and names[j - 1] == "add_decayed_weights":
        decoupled, j = (specs[j - 1][1]["weight_decay"], specs[j - 1][1]["mask"]), j - 1
    rule_names = tuple(names[i:j])
    hyper = {key: value for _, arguments in specs[i:j] for key, value in arguments.items()}
    rule = RULES.get(rule_names)
    if rule is None or (rule.family and "rule" not in hyper) or \
            (lr is None and not rule.family) or (l2 is not None and decoupled is not None) or \
            (decoupled is not None and (lr is None or not rule.decoupled)):
        return None
    return Shape(clip, maximize, l2, rule, tuple(range(i, j)), hyper, decoupled, lr,
                 lr_position, len(names))


def _number(value: Any) -> float | None:
    """``value`` as a Python float; None for a tensor that is traced, needs grad, is a
    subclass or holds more than one element, and for anything but a number or a tensor."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | Tensor):
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.requires_grad or type(value) not in _PLAIN or \
                is_traced(value):
            return None
        return float(value.item())
    return float(value)


def lower(tx: Any) -> Callable[..., Any] | None:
    """``update(grads, state, params, donate) -> (params, state) | None`` running ``tx`` as a kernel
    where it has a recognised shape; None for any other chain. Building it allocates nothing.

    >>> import minitrain as mt
    >>> lower(mt.optim.scale(2.0)) is None, callable(lower(mt.optim.adamw().update.transformation))
    (True, True)
    """
    shape = _recognise(tx)
    if shape is None:
        return None
    groups: dict[Any, list[list[int]]] = {}  # per params structure: its weight-decay groups

    def update(grads, state, params, donate):
        return _run(shape, groups, grads, state, params, donate)

    update.shape = shape  # type: ignore[attr-defined]
    return update


class Read(NamedTuple):
    """The numbers of one update, read from its chain and state before any check."""

    step: int
    hyper: dict[str, Any]
    wd: float
    max_norm: float | None
    lr: float | None
    lr_count: int | None
    per_step: dict[str, Any]
    kept: dict[str, Tensor]


def _read(shape: Shape, state: tuple, rule_states: list) -> Read | None:
    """Every number the update needs (reading a subclass's value runs the caller's code, so
    all of it comes before the checks); None where one is traced, needs grad or is no count."""
    counts = [s.count for s in rule_states] or [state[shape.lr_position].count]
    done = [_number(c) if type(c) is Tensor and not c.is_meta else None for c in counts]
    if None in done or min(done) < 0 or any(d != int(d) for d in done):
        return None  # a hand-edited count, or one under vmap or grad: the chain
    numbers = {k: _number(v) for k, v in shape.hyper.items() if isinstance(v, Tensor | float)}
    if None in numbers.values():
        return None
    hyper = {**shape.hyper, **numbers}
    wd = _number((shape.l2 or shape.decoupled or (0.0, None))[0])
    max_norm = None if shape.clip is None else _number(shape.clip)
    if wd is None or (shape.clip is not None and max_norm is None):
        return None
    step = int(done[0]) + 1
    per_step, kept = _advance(shape, rule_states, step)
    if per_step is None:
        return None
    lr = lr_count = None
    if shape.lr is not None:
        lr_count = _number(state[shape.lr_position].count)
        if lr_count is None:
            return None
        lr, lr_count = shape.lr, int(lr_count)
        lr = _number(lr(lr_count) if callable(lr) and not isinstance(lr, Tensor) else lr)
        if lr is None or not lr >= 0:
            return None
    return Read(step, hyper, wd, max_norm, lr, lr_count, per_step, kept)


def _advance(shape: Shape, rule_states: list, step: int):
    """Per-step arguments and next scalars of a family rule that keeps scalars in its state;
    ``(None, None)`` where one, or a hyperparameter the state holds, is traced or needs grad."""
    rule = shape.hyper.get("rule")
    if rule is None:
        return {}, {}
    if any(isinstance(v, Tensor) and _number(v) is None for v in rule.state_hyperparams):
        return None, None
    if not rule.scalars:
        return {}, {}
    old = {key: _number(getattr(rule_states[0], key)) for key in rule.scalars}
    if None in old.values():
        return None, None
    new_scalars, per_step = rule.advance(step, **old)
    per_step = {k: _number(v) if isinstance(v, Tensor) else v for k, v in per_step.items()}
    new = {key: _number(new_scalars[key]) for key in rule.scalars}
    if None in (*per_step.values(), *new.values()):
        return None, None
    return per_step, {key: torch.as_tensor(value, dtype=getattr(rule_states[0], key).dtype,
                                           device="cpu") for key, value in new.items()}


def _run(shape, groups, grads, state, params, donate):
    if torch.compiler.is_compiling() or not streaming.quiet() or _torch.forward_ad_active() or \
            getattr(shape.lr, "ndim", 0) == 1:  # (a learning rate per member: .members)
        return None  # compiled, a torch mode watching (the FLOP counter), or dual tensors
    p_leaves, structure = _pytree.tree_flatten(params)
    g_leaves, g_structure = _pytree.tree_flatten(grads)
    if g_structure != structure or not p_leaves or not isinstance(state, tuple) or \
            len(state) != shape.length:
        return None
    rule_states = [state[i] for i in shape.positions]
    if any(not hasattr(s, "count") for s in rule_states) or \
            (shape.lr_position is not None and not hasattr(state[shape.lr_position], "lr")):
        return None
    wrapped = _torch.is_functorch_wrapped_tensor
    if any(type(t) not in _PLAIN or wrapped(t) or t.requires_grad for t in (*p_leaves, *g_leaves)):
        return None  # vmapped (.members), under grad, a subclass, a differentiable update
    read = _read(shape, state, rule_states)
    if read is not None and read.wd != 0 and structure not in groups:
        # the mask is the caller's code too: read once per tree structure, before the checks
        flags = decay_flags((shape.l2 or shape.decoupled)[1], params)
        groups[structure] = [[i for i, f in enumerate(flags) if f is on] for on in (True, False)]
    if read is None or not streaming.quiet():
        return None  # the caller's code (a subclass's value, a mask) may have entered a mode
    buffers, fields = _buffers(shape, rule_states, read)
    use_c = all(p.dtype is torch.float32 for p in p_leaves) and streaming.available()
    if buffers is None or not use_c and (shape.rule.fused is None or any(
            p.dtype not in shape.rule.fused_dtypes for p in p_leaves)):
        return None
    rows = [p_leaves, g_leaves, *buffers]
    # checked once, after every read; donated, no written storage meets another or a grad's
    found = pointers(rows, read=1 if donate else None)
    if found is None and donate:  # leaves that meet: into new buffers
        donate, found = False, pointers(rows)
    if found is None:
        return None
    ran = _kernels(shape, rows, found, read, groups[structure] if read.wd else None, donate, use_c)
    if ran is None:
        return None
    new_params, new_buffers = ran
    return tree.unflatten(structure, new_params), _new_state(
        shape, state, fields, new_buffers, structure, [read],
        lambda values, dtype: torch.scalar_tensor(values[0], dtype=dtype, device="cpu"))


def _buffers(shape, rule_states, read):
    """The state leaves the kernel reads, in its slot order, and their ``(position, field)``."""
    found = shape.rule.kernel(read.step, read.hyper, read.per_step, Frame(1.0, 0.0, 1.0, 0.0))
    if found is None:
        return None, None
    buffers = []
    for field in found[2]:
        value = None if field is None else getattr(rule_states[field[0]], field[1], None)
        if field is not None and value is None:
            return None, None
        buffers.append(None if value is None else _pytree.tree_leaves(value))
    return buffers, found[2]


def _clip(gs, found, read, use_c):
    """``clip_by_global_norm``'s factor, ``min(1, max_norm / (norm + 1e-6))``, with its ops."""
    if use_c:
        sizes = [g.numel() for g in gs]
        norm = streaming.norm(streaming.sums_of_squares(found[1], sizes), sizes)
    else:
        norm = torch.linalg.vector_norm(torch.stack(_torch.foreach_norm(gs)))
    return float(torch.clamp(read.max_norm / (norm + 1e-6), max=1.0))


def _kernels(shape, rows, found, read, groups, donate, use_c):
    """Each weight-decay group's kernel call: the new params and state rows; None where the
    kernel cannot take them."""
    rule, (ps, gs, *buffers) = shape.rule, rows
    clip = 1.0 if shape.clip is None else _clip(gs, found, read, use_c)
    sign = -clip if shape.maximize else clip
    # What the grads are multiplied by first: the C kernels of folding rules take the sign
    # (and the clip's factor) themselves, torch's fused kernels negate for maximize.
    scale = (1.0 if rule.folds_sign else sign) if use_c else clip
    if scale != 1.0:
        gs = list(_torch.foreach["mul"](gs, scale))
        scaled = pointers([gs], like=ps)
        if scaled is None:
            return None
        found = [found[0], scaled[0], *found[2:]]
    plans = []
    for on, group in zip((True, False), groups or (range(len(ps)), None), strict=True):
        if group:
            l2 = read.wd if on and shape.l2 is not None else 0.0
            decoupled = read.wd if on and shape.decoupled is not None else 0.0
            frame = Frame(sign if use_c and rule.folds_sign else 1.0, l2, read.lr, decoupled)
            plans.append((group, frame, rule.kernel(read.step, read.hyper, read.per_step, frame)))
    outputs = None if donate or not use_c else pool.current()  # None: in place, or torch's
    if outputs is not None:
        outputs.begin_update()
    new_rows = [None if row is None else list(row) for row in (ps, *buffers)]
    for group, frame, (name, hp, _) in plans:
        whole = len(group) == len(ps)  # every leaf (no weight-decay mask): the rows as they are
        picked, at = ([ps, gs, *buffers], found) if whole else (
            [None if row is None else [row[i] for i in group] for row in table]
            for table in ((ps, gs, *buffers), found))
        results = streaming.run(name, hp, picked, at, outputs) if use_c else _fused(
            shape, picked, read, frame, donate)
        if results is None or whole:
            return None if results is None else (results[0], results[1:])
        for new, out in zip(new_rows, results, strict=True):
            if new is not None:
                for position, i in enumerate(group):
                    new[i] = out[position]
    return new_rows[0], new_rows[1:]


def _fused(shape, rows, read, frame, donate):
    """torch's fused kernel over one group's rows: in place when donated, else on copies."""
    ps, gs, *buffers = rows
    if not donate:
        ps, buffers = [t.clone() for t in ps], [
            None if row is None else [t.clone() for t in row] for row in buffers]
    shape.rule.fused(ps, gs, buffers, read.step, read.hyper, frame, shape.maximize)
    return [ps, *buffers]


def _new_state(shape, state, fields, new_buffers, structure, reads, number):
    """The state after the update of ``reads`` (the one, or each vmapped member's): the new
    buffers, and the counts, learning rate and kept scalars ``number(values, dtype)`` makes."""
    new_state = list(state)
    by_position: dict[int, dict[str, Any]] = {}
    for field, leaves in zip(fields, new_buffers, strict=True):
        if field is not None:
            by_position.setdefault(field[0], {})[field[1]] = tree.unflatten(structure, leaves)
    for index, position in enumerate(shape.positions):
        kept = {key: number([float(r.kept[key]) for r in reads], value.dtype)
                for key, value in reads[0].kept.items()} if index == 0 else {}
        new_state[position] = state[position]._replace(
            count=number([r.step for r in reads], torch.int64), **by_position.get(index, {}),
            **kept)
    if shape.lr_position is not None:
        new_state[shape.lr_position] = state[shape.lr_position]._replace(
            count=number([r.lr_count + 1 for r in reads], torch.int64),
            lr=number([r.lr for r in reads], torch.float32))
    return tuple(new_state)
