"""The one lowering: a chain shaped like a torch.optim update runs as one kernel call.

:func:`lower` recognises the chain torch.optim's update is,

    [clip_by_global_norm] [scale(-1)] [add_decayed_weights] RULE [add_decayed_weights]
    [scale_by_learning_rate]

where RULE is a row of :data:`RULES` (Adam's ``scale_by_adam``, SGD's ``trace`` or nothing,
RMSprop's ``scale_by_rms`` with its ``trace``, the family's rules), and returns an update that
runs it as one pass per weight-decay group over all leaves:

* on contiguous float32 CPU leaves: the streaming C kernel (``minitrain::stream_update``), into
  recycled buffers, or in place when donated (the same kernel, so the same bits);
* elsewhere (CUDA, float64, half precision), where torch has a fused kernel for the rule
  (``_fused_adam(w)_``, ``_fused_sgd_``, ``_fused_adagrad_``): that
  kernel, in place when donated, else on copies.

Whenever it cannot take a call (under vmap, grad or torch.compile, a torch mode active, leaves
the kernels cannot address, a traced or differentiable hyperparameter, ...) the update returns
None and the chain itself runs: the chain is the definition, the kernels are tested equal to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import _torch, tree
from minitrain.optim import _flat
from minitrain.optim.kernels import pool, streaming
from minitrain.optim.kernels.checks import kernel_ready
from minitrain.optim.kernels.family import FAMILY

__all__ = ["lower", "RULES"]


class Frame(NamedTuple):
    """What the chain does around its rule, as numbers for one update of one leaf group."""

    sign: float  # -1.0 when maximizing (times the clip's factor where the rule folds it)
    l2: float  # weight decay added to the grad before the rule
    lr: float | None  # None: the rule's output is the whole step
    decoupled: float  # weight decay applied to the params after the rule (AdamW)


Spec = Callable[[int, dict, dict, Frame], "tuple[str, list[float], tuple] | None"]


class Rule(NamedTuple):
    """A row of :data:`RULES`: the kernel's hyperparameters for update ``step`` (None where
    this frame is one the kernel does not take), the state buffers it reads and writes in its
    slot order (``(rule transformation index, field)`` or None), and torch's fused kernel."""

    kernel: Spec | None
    fused: Callable[..., None] | None = None
    folds_sign: bool = False  # the kernel multiplies the grads by ``frame.sign`` itself
    fused_halves: bool = True  # torch's CPU fused kernel takes bfloat16 and float16 leaves


def _adam(step, h, per_step, f):
    if f.lr is None or (f.l2 and f.decoupled):
        return None
    b1, b2 = h["beta1"], h["beta2"]
    decoupled = f.decoupled != 0
    return "adam", [b1, b2, h["eps"], f.decoupled if decoupled else f.l2, f.lr,
                    f.lr / (1 - b1**step), math.sqrt(1 - b2**step), decoupled, h["amsgrad"],
                    f.sign], \
        ((0, "exp_avg"), (0, "exp_avg_sq"), (0, "max_exp_avg_sq") if h["amsgrad"] else None)


def _sgd(step, h, per_step, f):
    if f.lr is None or f.decoupled:
        return None
    momentum = h.get("momentum", 0.0)
    on = momentum != 0
    return "sgd", [f.lr, momentum, h.get("dampening", 0.0), f.l2, h.get("nesterov", False),
                   step == 1, on], ((0, "momentum_buffer") if on else None,)


def _adagrad(step, h, per_step, f):
    if f.lr is None or f.decoupled:
        return None
    return "adagrad", [f.lr / (1 + (step - 1) * h["lr_decay"]), f.l2, h["eps"]], ((0, "sum"),)


def _rmsprop(step, h, per_step, f):
    if f.lr is None or f.decoupled or h.get("dampening", 0.0) != 0 or h.get("nesterov"):
        return None
    momentum = h.get("momentum", 0.0)
    on = momentum != 0
    return "rmsprop", [f.lr, h["alpha"], h["eps"], f.l2, momentum, h["centered"], on], (
        (0, "square_avg"), (1, "momentum_buffer") if on else None,
        (0, "grad_avg") if h["centered"] else None)


def _family(step, h, per_step, f):
    name, rule_hp, fields = FAMILY[h["rule"].name](step, h, per_step)
    has_lr = f.lr is not None
    if f.decoupled and not has_lr:
        return None
    frame = [f.sign, f.l2, f.lr or 0.0, 1 - (f.lr or 0.0) * f.decoupled, float(has_lr)]
    return name, frame + list(rule_hp), tuple((0, field) for field in fields)


def _fused_adam(ps, gs, buffers, step, h, f, maximize):
    kernel = _torch.fused_adamw_ if f.decoupled else _torch.fused_adam_
    steps = [torch.tensor(float(step), dtype=torch.float32, device=ps[0].device)] * len(ps)
    kernel(ps, gs, buffers[0], buffers[1], buffers[2] or [], steps, lr=f.lr,
           beta1=h["beta1"], beta2=h["beta2"], weight_decay=f.decoupled or f.l2, eps=h["eps"],
           amsgrad=h["amsgrad"], maximize=maximize)


def _fused_sgd(ps, gs, buffers, step, h, f, maximize):
    momentum = h.get("momentum", 0.0)
    _torch.fused_sgd_(ps, gs, buffers[0] or [], weight_decay=f.l2, momentum=momentum, lr=f.lr,
                       dampening=h.get("dampening", 0.0), nesterov=h.get("nesterov", False),
                      maximize=maximize, is_first_step=step == 1)


def _fused_adagrad(ps, gs, buffers, step, h, f, maximize):
    steps = [torch.tensor(float(step), dtype=torch.float32, device=ps[0].device)] * len(ps)
    _torch.fused_adagrad_(ps, gs, buffers[0], steps, lr=f.lr, lr_decay=h["lr_decay"],
                           weight_decay=f.l2, eps=h["eps"], maximize=maximize)


RULES: dict[tuple[str, ...], Rule] = {
    ("scale_by_adam",): Rule(_adam, _fused_adam, folds_sign=True),
    (): Rule(_sgd, _fused_sgd, fused_halves=False),
    ("trace",): Rule(_sgd, _fused_sgd, fused_halves=False),
    ("scale_by_adagrad",): Rule(_adagrad, _fused_adagrad),
    ("scale_by_rms",): Rule(_rmsprop),
    ("scale_by_rms", "trace"): Rule(_rmsprop),
}
"""Rules by the names of their transformations; the family's rules (each one transformation
carrying its ``rule``) take :func:`_family`'s frame."""

_FAMILY = Rule(_family, folds_sign=True)


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
    rule = RULES.get(rule_names)
    hyper: dict[str, Any] = {}
    for position in range(i, j):
        hyper.update(specs[position][1])
    if rule is None and rule_names[:1] == rule_names and rule_names and \
            rule_names[0] in FAMILY and "rule" in hyper:
        rule = _FAMILY
    if rule is None or (lr is None and rule is not _FAMILY) or \
            (l2 is not None and decoupled is not None):
        return None
    return Shape(clip, maximize, l2, rule, tuple(range(i, j)), hyper, decoupled, lr,
                 lr_position, len(names))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | Tensor):
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.requires_grad or _traced(value):
            return None
        return float(value.detach().reshape(()).item())
    return float(value)


def _traced(t: Tensor) -> bool:
    return torch.compiler.is_compiling() or _torch.is_functorch_wrapped_tensor(t) \
        or type(t) not in (Tensor, torch.nn.Parameter)


def lower(tx: Any) -> Callable[..., Any] | None:
    """``update(grads, state, params, donate) -> (params, state) | None`` running ``tx`` as a
    kernel where it has a recognised shape; None for any other chain. Building it allocates
    nothing.

    >>> import minitrain as mt
    >>> lower(mt.optim.scale(2.0)) is None, callable(lower(mt.optim.adamw().update.transformation))
    (True, True)
    """
    shape = _recognise(tx)
    if shape is None:
        return None
    decay_flags: dict[Any, list[bool]] = {}

    def update(grads, state, params, donate):
        return _run(shape, decay_flags, grads, state, params, donate)

    return update


def _numbers(shape: Shape) -> dict[str, Any] | None:
    """The rule's hyperparameters as Python numbers (None where one is traced or needs grad)."""
    out = {}
    for key, value in shape.hyper.items():
        if isinstance(value, Tensor):
            value = _number(value)
            if value is None:
                return None
        elif isinstance(value, float) and type(value) is not float:
            value = float(value)  # a subclass's __float__ is the caller's code: read it first
        out[key] = value
    return out


def _run(shape, decay_flags, grads, state, params, donate):
    if torch.compiler.is_compiling() or not streaming.quiet():
        return None  # compiled, or a torch mode watching (the FLOP counter, fake tensors)
    p_leaves, structure = _flat.flatten(params)
    g_leaves, g_structure = _flat.flatten(grads)
    if g_structure != structure or not p_leaves or not isinstance(state, tuple) or \
            len(state) != shape.length:
        return None
    rule_states = [state[i] for i in shape.positions]
    if any(not hasattr(s, "count") for s in rule_states) or \
            (shape.lr_position is not None and not hasattr(state[shape.lr_position], "lr")):
        return None
    counts = [s.count for s in rule_states] or [state[shape.lr_position].count]
    done = [_number(c) if type(c) is Tensor and not c.is_meta else None for c in counts]
    if None in done or min(done) < 0 or any(d != int(d) for d in done) or \
            any(_traced(t) for t in (*p_leaves, *g_leaves)):
        return None  # under vmap, grad or a compiler, or a hand-edited count: the chain
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*p_leaves, *g_leaves)):
        return None
    hyper = _numbers(shape)
    # Every number before the checks below: reading a subclass's value runs the caller's code.
    wd = _number((shape.l2 or shape.decoupled or (0.0, None))[0])
    max_norm = None if shape.clip is None else _number(shape.clip)
    if hyper is None or wd is None or (shape.clip is not None and max_norm is None):
        return None
    step = int(done[0]) + 1
    per_step, kept = _advance(shape, rule_states, step)
    if per_step is None:
        return None
    lr = None
    if shape.lr is not None:
        lr_count = _number(state[shape.lr_position].count)
        if lr_count is None:
            return None
        lr_count = int(lr_count)
        lr = shape.lr(lr_count) if callable(shape.lr) and not isinstance(shape.lr, Tensor) \
            else shape.lr
        lr = _number(lr)
        if lr is None or not lr >= 0:
            return None
    buffers, fields = _buffers(shape, rule_states, hyper, per_step, step)
    if buffers is None or not kernel_ready(p_leaves, g_leaves, {str(k): v for k, v in enumerate(
            buffers) if v is not None}, donate):
        return None
    clip = 1.0
    if shape.clip is not None:
        clip = _clip_factor(g_leaves, max_norm)
    flags = _flags(decay_flags, shape, params)
    ran = _kernels(shape, p_leaves, g_leaves, buffers, step, hyper, per_step, lr, clip, wd,
                   flags, donate)
    if ran is None:
        return None
    new_params, new_buffers = ran
    return _flat.unflatten(structure, new_params), _new_state(
        shape, state, rule_states, fields, new_buffers, kept, structure, step, lr)


def _advance(shape: Shape, rule_states: list, step: int):
    """Per-step arguments and next scalars of a family rule that keeps scalars in its state."""
    rule = shape.hyper.get("rule")
    if rule is not None and any(isinstance(v, Tensor) and _number(v) is None
                                for v in rule.state_hyperparams):
        return None, None  # a hyperparameter held in the state is traced or needs grad
    if rule is None or not rule.scalars:
        return {}, {}
    old = {key: _number(getattr(rule_states[0], key)) for key in rule.scalars}
    if any(v is None for v in old.values()):
        return None, None
    new_scalars, per_step = rule.advance(step, **old)
    per_step = {k: _number(v) if isinstance(v, Tensor) else v for k, v in per_step.items()}
    if any(v is None for v in (*per_step.values(), *new_scalars.values())) or any(
            isinstance(v, Tensor) and _number(v) is None for v in new_scalars.values()):
        return None, None
    kept = {key: torch.as_tensor(float(new_scalars[key]), dtype=getattr(
        rule_states[0], key).dtype, device="cpu") for key in rule.scalars}
    return per_step, kept


def _buffers(shape, rule_states, hyper, per_step, step):
    """The state leaves the kernel reads, in its slot order, and their ``(position, field)``."""
    found = shape.rule.kernel(step, hyper, per_step, Frame(1.0, 0.0, 1.0, 0.0))
    if found is None:
        return None, None
    fields = found[2]
    buffers = []
    for field in fields:
        if field is None:
            buffers.append(None)
            continue
        value = getattr(rule_states[field[0]], field[1], ())
        if value == ():
            return None, None
        buffers.append(tree.leaves(value))
    return buffers, fields


def _clip_factor(g_leaves: list[Tensor], max_norm: float) -> float:
    """``clip_by_global_norm``'s factor, ``min(1, max_norm / (norm + 1e-6))``, with its ops."""
    if streaming.usable(g_leaves):
        norm = streaming.global_norm(g_leaves)
    else:
        norm = torch.linalg.vector_norm(torch.stack(_torch.foreach_norm(g_leaves)))
    return float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def _flags(cache: dict, shape: Shape, params: Any) -> list[bool]:
    """Per leaf, whether weight decay applies (the mask is read once per tree structure)."""
    from minitrain.optim._checks import decay_flags

    decay = shape.l2 or shape.decoupled
    if decay is None or _number(decay[0]) == 0:
        return [False] * len(tree.leaves(params))
    key = tree.structure(params)
    if key not in cache:
        cache[key] = decay_flags(decay[1], params)
    return cache[key]


def _kernels(shape, ps, gs, buffers, step, hyper, per_step, lr, clip, wd, flags, donate):
    """Each weight-decay group's kernel call; None where no kernel takes these leaves."""
    rule = shape.rule
    tensors = [*ps, *gs, *(t for row in buffers if row is not None for t in row)]
    use_c = streaming.usable(tensors)  # the same kernel pure and donated: the same bits
    if not use_c and (rule.fused is None or not _fusable(ps, rule.fused_halves)):
        return None
    sign = -clip if shape.maximize else clip
    # What the grads are multiplied by first: the C kernels of folding rules take the sign
    # (and the clip's factor) themselves, torch's fused kernels negate for maximize.
    scale = (1.0 if rule.folds_sign else sign) if use_c else clip
    if scale != 1.0:
        gs = list(_torch.foreach["mul"](gs, scale))
    plans = []
    for on in (True, False):
        group = [i for i, flag in enumerate(flags) if flag is on]
        if not group:
            continue
        l2 = wd if on and shape.l2 is not None else 0.0
        decoupled = wd if on and shape.decoupled is not None else 0.0
        frame = Frame(sign if use_c and rule.folds_sign else 1.0, l2, lr, decoupled)
        found = rule.kernel(step, hyper, per_step, frame)
        if found is None:
            return None
        plans.append((group, frame, found))
    new_ps, new_buffers = list(ps), [list(row) if row is not None else None for row in buffers]
    outputs = None if donate or not use_c else pool.current()
    if outputs is not None:
        outputs.begin_update()
    for group, frame, (name, hp, _) in plans:
        p_group = [ps[i] for i in group]
        g_group = [gs[i] for i in group]
        b_group = [None if row is None else [row[i] for i in group] for row in buffers]
        if use_c:
            out_p, *out_b = streaming.update(name, hp, [p_group, g_group, *b_group], outputs)
        else:
            out_p, out_b = _fused(rule, p_group, g_group, b_group, step, hyper, frame,
                                  shape.maximize, donate)
        for position, i in enumerate(group):
            new_ps[i] = out_p[position]
            for row, out in zip(new_buffers, out_b, strict=True):
                if row is not None:
                    row[i] = out[position]
    return new_ps, new_buffers


def _fusable(ps: list[Tensor], halves: bool) -> bool:
    """torch's fused kernels on CUDA, and on the CPU for float32 and float64, and bfloat16 and
    float16 where the rule's kernel takes them (its CPU fused SGD skips half-precision elements
    in whole SIMD blocks)."""
    dtypes = (torch.float32, torch.float64) + ((torch.bfloat16, torch.float16) if halves else ())
    return all(p.is_cuda or p.dtype in dtypes for p in ps)


def _fused(rule, ps, gs, buffers, step, hyper, frame, maximize, donate):
    if not donate:
        ps = _copies(ps)
        buffers = [None if row is None else _copies(row) for row in buffers]
    rule.fused(ps, gs, buffers, step, hyper, frame, maximize)
    return ps, buffers


def _copies(tensors: list[Tensor]) -> list[Tensor]:
    copies = [torch.empty_like(t) for t in tensors]
    _torch.foreach["copy_"](copies, tensors)
    return copies


def _new_state(shape, state, rule_states, fields, new_buffers, kept, structure, step, lr):
    new_state = list(state)
    by_position: dict[int, dict[str, Any]] = {}
    for field, leaves in zip(fields, new_buffers, strict=True):
        if field is not None:
            by_position.setdefault(field[0], {})[field[1]] = _flat.unflatten(structure, leaves)
    for index, (position, inner) in enumerate(zip(shape.positions, rule_states, strict=True)):
        count = torch.tensor(step, dtype=torch.int64, device="cpu")
        extra = kept if index == 0 else {}
        new_state[position] = inner._replace(count=count, **by_position.get(index, {}), **extra)
    if shape.lr_position is not None:
        inner = state[shape.lr_position]
        new_state[shape.lr_position] = inner._replace(
            count=torch.tensor(int(inner.count) + 1, dtype=torch.int64, device="cpu"),
            lr=torch.tensor(lr, dtype=torch.float32, device="cpu"))
    return tuple(new_state)
