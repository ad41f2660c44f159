"""The optimizer interface and the machinery every optimizer shares.

An optimizer is a NamedTuple ``(init, update)`` of pure functions (optax ``_src/base.py``):
``state = opt.init(params)`` and ``params, state = opt.update(grads, state, params)``. Each
optimizer module supplies its math twice over the same state layout:

* a **fast path** over lists of leaves grouped by ``(device, dtype, decays)``, written with
  ``torch._fused_*`` / ``torch._foreach_*`` kernels that update buffers in place. Without
  donation it runs on fresh copies, so the inputs are never touched. CPU float32 leaves take
  :mod:`minitrain.optim.kernels.streaming` instead where it builds: one pass that writes the new values
  into recycled buffers with streaming stores, or in place when donated (the same kernel, so
  pure and donated updates agree bit for bit);
* a **plain path**, per leaf with ordinary tensor ops and no in-place writes, which works under
  ``torch.func.vmap``, ``torch.compile`` and autograd.

``impl="auto"`` (the default) takes the plain path when any leaf or hyperparameter is a functorch
wrapped tensor (vmap, grad), when ``torch.compile`` is tracing, or when grad mode is on and a
leaf requires grad; otherwise the fast path. ``impl="fast"`` / ``impl="plain"`` force one.
``impl="compiled"`` chooses like ``"auto"``, but a pure (not donated) fast-path update runs the
plain path's math over all leaves as one ``torch.compile`` (inductor) graph, which fuses it into
one pass that reads params, grads and state once and writes the new ones straight into
recycled buffers: the fewest passes over memory a pure update can make. The first update of
each new set of leaf shapes compiles (seconds).

Donation: ``opt.update(grads, state, params, donate=True)`` lets the fast path write the new
params and state into the buffers of ``params`` and ``state`` (JAX's ``donate_argnums``). The
caller must not read the donated inputs afterwards. The plain path ignores the flag and stays
pure; donation is a permission, never an obligation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim import _flat
from minitrain.optim.kernels import streaming
from minitrain.optim.kernels.pool import (  # noqa: F401  (BufferPool's names, re-exported)
    _CAN_COUNT_STORAGE_USES,
    BufferPool,
    buffer_pool_bytes,
    clear_buffer_pools,
)
from minitrain.optim._collection import holding_collection
from minitrain.optim._host import _PLAIN_TENSOR_TYPES, is_traced, updates_done, zero_count
from minitrain.optim._layout import (  # noqa: F401  (re-exported for the optimizer modules)
    CACHE_BATCH_BYTES,
    Layout,
    LayoutCache,
    WeightDecayMask,
    check_grads,
    check_params,
    decay_flags,
    fast_batches,
)
from minitrain.optim.kernels.checks import (
    check_state_shapes,
    donatable,
    fast_path_inputs,
    kernel_ready,
    naming_bad_grads,
)
from minitrain.optim.kernels.streaming import LateScalar
from minitrain.tree import Grads, OptState, Params

__all__ = [
    "Optimizer",
    "Schedule",
    "ScalarOrSchedule",
    "WeightDecayMask",
    "Impl",
    "learning_rate",
    "clear_buffer_pools",
    "buffer_pool_bytes",
]

Schedule = Callable[[Any], Any]
"""A learning-rate schedule: ``step -> lr``, for a Python int or a 0-d integer tensor step."""
ScalarOrSchedule = float | Tensor | Schedule
Impl = Literal["auto", "fast", "plain", "compiled"]

class Optimizer(NamedTuple):
    """A pair of pure functions: ``init(params) -> state``, ``update(grads, state, params)``.

    ``update`` returns ``(new_params, new_state)`` and accepts ``donate=True`` (see the module
    docstring).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.sgd(lr=0.5)
    >>> params = {"w": torch.tensor([1.0, 2.0])}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params)
    >>> params["w"]
    tensor([0.5000, 1.5000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Params, OptState]]


def learning_rate(state: OptState) -> float:
    """The lr of the most recent update (before the first update: the lr it will use).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.adamw(lr=mt.optim.linear_warmup_schedule(1.0, warmup_steps=4))
    >>> params = {"w": torch.ones(2)}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> mt.optim.learning_rate(state)
    0.25
    """
    found = _find_lr(state)
    if found is None:
        raise ValueError(
            f"learning_rate() expects the state of an mt.optim optimizer, got {type(state)!r}"
        )
    return float(found)


def _find_lr(state: Any) -> Any:
    """The ``lr`` field of a state, or the first one inside a chain's tuple of states or a
    ``multi_transform``'s dict of them, in order (also an injected ``lr`` / ``learning_rate``
    hyperparameter)."""
    if hasattr(state, "lr") and isinstance(state.lr, Tensor):
        return state.lr
    hyper = getattr(state, "hyperparams", None)
    if isinstance(hyper, dict):
        for key in ("lr", "learning_rate"):
            if key in hyper:
                return hyper[key]
    inners = state.values() if isinstance(state, dict) else state
    if isinstance(state, tuple | list | dict):
        for inner in inners:
            found = _find_lr(inner)
            if found is not None:
                return found
    return None


# --------------------------------------------------------------------------------------------
# Validation


def check_hyperparameter(name: str, value: Any, low: float, high: float = math.inf,
                         *, low_open: bool = False, high_open: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` when a concrete ``value`` is outside its range.

    Values that cannot be read without tracing (vmapped or compiled tensors) are not checked.
    """
    number = _concrete_number(name, value)
    if number is None:
        return
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if math.isnan(number) or too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(
            f"invalid {name}={number!r}: it must lie in {left}{low}, {high}{right}; "
            f"pass a value in that range"
        )


def _concrete_number(name: str, value: Any) -> float | None:
    """``value`` as a float; None where it cannot be read without tracing (and for a tensor
    subclass of several elements, such as a sweep's per-member values)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Tensor):
        if is_traced(value) or value.numel() != 1 and type(value) is not Tensor:
            return None
        if value.numel() != 1:
            raise ValueError(f"invalid {name}: a tensor of shape {tuple(value.shape)}; pass a "
                             f"number or a one-element tensor")
        if value.is_complex() or value.is_meta:  # no real value to read
            raise ValueError(f"invalid {name}: a {value.dtype} tensor on {value.device.type}; "
                             f"pass a real number or a one-element real tensor holding data")
        return float(value.detach().reshape(()).item())
    raise ValueError(f"invalid {name}={value!r}: pass a number or a one-element tensor")


def check_lr(lr: ScalarOrSchedule) -> None:
    """Check a learning rate given as a number or tensor (a schedule is checked per step)."""
    if callable(lr) and not isinstance(lr, Tensor):
        return
    check_hyperparameter("lr", lr, 0.0)


def check_impl(impl: str) -> None:
    if impl not in ("auto", "fast", "plain", "compiled"):
        raise ValueError(
            f"invalid impl={impl!r}: choose 'auto', 'fast', 'plain' or 'compiled'"
        )


# --------------------------------------------------------------------------------------------
# Path choice


def use_plain_path(impl: str, tensors: Sequence[Tensor], hyperparameters: Sequence[Any]) -> bool:
    """Whether this update must (or is asked to) take the plain tensor-ops path: under a
    compiler or functorch transform, or with grad mode on and a leaf or tensor hyperparameter
    that requires grad (a differentiable lr: the fast path's kernels would detach it)."""
    if impl in ("fast", "plain"):
        return impl == "plain"
    if torch.compiler.is_compiling():
        return True
    if any(is_traced(value) for value in hyperparameters):
        return True
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for t in tensors:  # is_traced, inlined: an update checks every leaf
        if type(t) in _PLAIN_TENSOR_TYPES:
            if wrapped(t):
                return True
        elif is_traced(t):
            return True
    return torch.is_grad_enabled() and (
        any(t.requires_grad for t in tensors)
        or any(isinstance(v, Tensor) and v.requires_grad for v in hyperparameters)
    )


def scalar(value: Any) -> Any:
    """A concrete 0-d tensor hyperparameter as a Python float; anything else unchanged."""
    if isinstance(value, Tensor) and value.numel() == 1 and not is_traced(value):
        return float(value.detach().reshape(()).item())
    return value


# --------------------------------------------------------------------------------------------
# The shared update driver


class Rule(NamedTuple):
    """What one optimizer contributes to :func:`make_optimizer`.

    ``plain_step(p, g, buffers, step, lr, weight_decay) -> (p, buffers)`` updates one leaf with
    out-of-place tensor ops; ``fast_step(ps, gs, buffers, step, lr, weight_decay, outputs) ->
    (ps, buffers)`` updates a batch of same-(device, dtype) leaves with fused / foreach kernels,
    in place when ``outputs`` is None (donation) and otherwise into ``outputs(like)`` buffers.
    ``buffers`` maps a state field name to a tensor (plain) or a list of tensors (fast);
    ``step`` counts this update, starting at 1.
    """

    buffers: tuple[str, ...]
    init_buffer: Callable[[str, Tensor], Tensor]
    plain_step: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    fast_step: Callable[..., tuple[list[Tensor], dict[str, list[Tensor]]]]
    fused: bool = True  # fast_step is one fused kernel (one pass over memory)
    # What plain_step receives as ``step``: computed once per update from the step number, so
    # that step-derived scalars (bias corrections) are one shared node in a traced graph, which
    # inductor computes once instead of inside every leaf's loop.
    step_scalars: Callable[[Any], Any] = lambda step: step
    # The streaming kernel this rule runs on CPU float32 leaves: ``streaming(step, lr,
    # weight_decay) -> (kernel rule, hyperparameters, buffer names in the kernel's slot order
    # (None for a slot left empty))``; None where only ``fast_step`` applies (maximize). An
    # update whose leaves kernel_ready accepted then calls the kernel directly (_stream_update).
    streaming: Callable[[int, float, float], tuple[str, list, tuple]] | None = None


def make_optimizer(
    state_type: type,
    rule: Rule,
    lr: ScalarOrSchedule,
    weight_decay: float | Tensor,
    mask: WeightDecayMask,
    impl: str,
    hyperparameters: Sequence[Any] = (),
) -> Optimizer:
    """Build ``Optimizer(init, update)`` for a state NamedTuple and an update :class:`Rule`.

    ``state_type`` has fields ``count`` (updates done, 0-d int64), ``lr`` (0-d float32) and one
    field per name in ``rule.buffers`` (a pytree like params); any other field holds ``()``.
    """
    check_lr(lr)
    check_impl(impl)
    traced_candidates = [lr, weight_decay, *hyperparameters]
    pool = BufferPool()
    plans = LayoutCache(mask, 2 + len(rule.buffers), rule.fused)
    compiled_step = CompiledStep(rule.plain_step, rule.step_scalars) if impl == "compiled" else None

    def init(params: Params) -> OptState:
        check_params(params)
        buffers = {
            name: tree.map(lambda p, name=name: rule.init_buffer(name, p), params)
            for name in rule.buffers
        }
        unused = {field: () for field in state_type._fields[2:] if field not in buffers}
        count = zero_count()
        return state_type(count=count, lr=_lr_tensor(_lr_at(lr, 0)), **buffers, **unused)

    def update(
        grads: Grads, state: OptState, params: Params, *, donate: bool = False
    ) -> tuple[Params, OptState]:
        param_leaves, spec = _flat.flatten(params)
        grad_leaves, grad_spec = _flat.flatten(grads)
        _check_state_type(state, state_type)
        buffer_leaves = {name: _flat.flatten(getattr(state, name))[0] for name in rule.buffers}
        _check_state_leaves(buffer_leaves, len(param_leaves))
        # The layout first: building one runs the caller's weight-decay mask, which must not
        # run between the one-pass check below and a kernel.
        layout = plans.layout(params, spec, param_leaves, grads, grad_spec, grad_leaves)
        # The schedule's value next, once per update, for the same reason (a traced count
        # leaves it to the plain path).
        done = updates_done(state.count)
        step_lr = lr if done is None else _lr_at(lr, done)
        # A count (or a tensor hyperparameter) of a tensor subclass runs the caller's code when
        # read: all of them before the one-pass check (which decides donation too).
        counted = type(state.count) is Tensor
        candidates = [step_lr, *traced_candidates]  # a schedule's value may need its grad
        plain = counted and use_plain_path(impl, [state.count], candidates)
        ready = counted and kernel_ready(param_leaves, grad_leaves, buffer_leaves, donate)
        if not ready:
            check_state_shapes(buffer_leaves, param_leaves, params)
            donate = donate and donatable(param_leaves, grad_leaves, buffer_leaves.values())
            tensors = [*param_leaves, *grad_leaves, state.count]
            plain = use_plain_path(impl, tensors, candidates)
        if not plain and not ready:
            safe = fast_path_inputs(param_leaves, grad_leaves, buffer_leaves, params)
            plain = safe is None  # params the kernels cannot address: ordinary tensor ops
            if safe is not None:
                grad_leaves, buffer_leaves = safe
        if plain:
            new_params, new_buffers, count, lr_tensor = _plain_update(
                rule, param_leaves, grad_leaves, buffer_leaves, layout.decays, state.count, step_lr,
                weight_decay, done,
            )
        elif compiled_step is not None and not donate:
            with pool.lock:
                new_params, new_buffers, count, lr_tensor = _compiled_update(
                    compiled_step, param_leaves, grad_leaves, buffer_leaves, layout.decays,
                    state.count, step_lr, weight_decay, pool, done,
                )
        elif ready and _streams(rule, param_leaves):
            with pool.lock:
                new_params, new_buffers, count, lr_tensor, launches = _stream_update(
                    rule, param_leaves, grad_leaves, buffer_leaves, layout, state.count, step_lr,
                    weight_decay, None if donate else pool, done,
                )
                # Built before kernels that sweep the caches (after them the same Python takes
                # longer) where that runs none of the caller's code, which could change a buffer
                # the kernels point into: this optimizer's state type, containers _flat rebuilds.
                built = layout.sweeps_caches and type(state) is state_type and _flat.plain(spec)
                out = built and _results(state, spec, new_params, new_buffers, count, lr_tensor)
                for launch in launches:
                    launch()
                if built:
                    return out
        else:
            with pool.lock:
                new_params, new_buffers, count, lr_tensor = _fast_update(
                    rule, param_leaves, grad_leaves, buffer_leaves, layout, state.count, step_lr,
                    weight_decay, None if donate else pool, done=done,
                )
        return _results(state, spec, new_params, new_buffers, count, lr_tensor)

    return Optimizer(init, naming_bad_grads(holding_collection(update)))


def _results(state, spec, params, buffers, count, lr) -> tuple[Params, OptState]:
    trees = {name: _flat.unflatten(spec, leaves) for name, leaves in buffers.items()}
    return _flat.unflatten(spec, params), state._replace(count=count, lr=lr, **trees)


def _check_state_type(state: Any, state_type: type) -> None:
    if not isinstance(state, state_type):
        raise ValueError(
            f"expected a {state_type.__name__} from this optimizer's init, got "
            f"{type(state).__name__}; pass the state returned by opt.init(params)"
        )


def _check_state_leaves(buffers: dict[str, list], n_leaves: int) -> None:
    for name, leaves in buffers.items():
        if len(leaves) != n_leaves:
            raise ValueError(
                f"state.{name} has {len(leaves)} leaves but params has {n_leaves}; "
                f"create the state with opt.init(params)"
            )


def _lr_at(lr: ScalarOrSchedule, count: Any) -> Any:
    """The lr for the update that follows ``count`` earlier updates."""
    if callable(lr) and not isinstance(lr, Tensor):
        value = lr(count)
        check_hyperparameter("lr (from the schedule)", value, 0.0)
        return value
    return lr


def _lr_tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(torch.float32)
    value = float(value)
    if abs(value) <= _FLOAT32_MAX:
        # torch.tensor's value on a shorter path (half the time an update starts with cold
        # caches); scalar_tensor refuses what float32 cannot hold, which torch.tensor makes inf.
        return torch.scalar_tensor(value, dtype=torch.float32, device="cpu")
    return torch.tensor(value, dtype=torch.float32, device="cpu")


_FLOAT32_MAX = torch.finfo(torch.float32).max


def step_number(count: Tensor) -> Any:
    """The 1-based number of the update being made: a Python int, or a float64 tensor when
    ``count`` is traced (bias corrections then keep torch.optim's double precision)."""
    if is_traced(count):
        return count.to(torch.float64) + 1
    return int(count) + 1


def _plain_update(rule, params, grads, buffers, decays, count, lr, weight_decay, done=None):
    """``done``: ``int(count)`` as the update read it (None where the count is traced): read
    again here, a count of a tensor subclass would run the caller's code after the checks."""
    if done is None and not is_traced(count):
        done = int(count)
    step_lr = _lr_at(lr, count if done is None else done)
    step = rule.step_scalars(step_number(count) if done is None else done + 1)
    new_params = []
    new_buffers: dict[str, list[Tensor]] = {name: [] for name in rule.buffers}
    for index, (p, g, decay) in enumerate(zip(params, grads, decays, strict=True)):
        leaf_buffers = {name: leaves[index] for name, leaves in buffers.items()}
        new_p, leaf_buffers = rule.plain_step(
            p, g, leaf_buffers, step, step_lr, weight_decay if decay else 0.0
        )
        # 0-d leaves would otherwise promote to the float64 of a traced bias correction.
        new_params.append(new_p.to(p.dtype))
        for name, value in leaf_buffers.items():
            new_buffers[name].append(value.to(p.dtype))
    return new_params, new_buffers, count + 1, _lr_tensor(step_lr)


def _fast_update(rule, params, grads, buffers, layout, count, lr, weight_decay, pool,
                 values=None, done=None):
    """The rule's batched fast step over each batch; ``values``: :func:`_step_values` already
    taken (so a schedule runs once per update); ``done``: ``int(count)`` already read."""
    donate = pool is None
    if pool is not None:
        pool.begin_update()
    done, step_lr, decay_value = values or _step_values(count, lr, weight_decay, done)
    new_params = list(params)
    new_buffers = {name: list(leaves) for name, leaves in buffers.items()}
    with torch.no_grad():
        for batch in layout.donated_batches if donate else layout.batches:
            batch_params, batch_buffers = rule.fast_step(
                [params[i] for i in batch],
                [grads[i] for i in batch],
                {name: [leaves[i] for i in batch] for name, leaves in buffers.items()},
                done + 1,
                step_lr,
                decay_value if layout.decays[batch[0]] else 0.0,
                pool,
            )
            _scatter(batch, batch_params, batch_buffers, new_params, new_buffers)
        new_count = _next_count(count, done, donate)
    return new_params, new_buffers, new_count, _lr_tensor(step_lr)


def _scatter(batch: list[int], batch_params: list, batch_buffers: dict[str, list],
             new_params: list, new_buffers: dict[str, list]) -> None:
    """Put a batch's results back at its leaves' positions."""
    for position, index in enumerate(batch):
        new_params[index] = batch_params[position]
        for name, leaves in batch_buffers.items():
            new_buffers[name][index] = leaves[position]


def _next_count(count: Tensor, done: int, donate: bool) -> Tensor:
    """The state's new update count: the donated count incremented in place, else a new one."""
    if donate:
        return count.add_(1)
    return torch.scalar_tensor(done + 1, dtype=torch.int64, device="cpu")


def _streams(rule: Rule, params: list[Tensor]) -> bool:
    """Whether the rule can call its streaming kernel directly on these leaves (which
    kernel_ready accepted: plain contiguous CPU tensors, grads and state of their params'
    shapes and dtypes): float32 params, and the kernels built and not hidden from a counter."""
    if rule.streaming is None or not streaming.usable(()):
        return False
    float32 = torch.float32
    return all(p.dtype is float32 for p in params)


def _stream_update(rule, params, grads, buffers, layout, count, lr, weight_decay, pool,
                   done=None):
    """:func:`_fast_update` for leaves the streaming kernels take as they are: each batch is one
    kernel call, with no per-leaf checks beyond kernel_ready's (its outputs come from the pool,
    which hands out buffers of each param's shape, or are the donated inputs themselves)."""
    donate = pool is None
    values = _step_values(count, lr, weight_decay, done)
    done, step_lr, decay_value = values
    batches = layout.donated_batches if donate else layout.batches
    specs = [rule.streaming(done + 1, step_lr, decay_value if layout.decays[batch[0]] else 0.0)
             for batch in batches]
    plain_values = _plain_values([lr, weight_decay, *(
        v for spec in specs for v in spec[1] if not isinstance(v, LateScalar))])
    specs = [(kernel, [v if isinstance(v, LateScalar) else float(v) for v in hyperparameters],
              names) for kernel, hyperparameters, names in specs]
    # The state's new lr and count are made before the kernels, not after: the first torch ops
    # after a pass that swept the caches cost about 0.1 ms more (measured: the Python after a
    # donated AdaGrad kernel of 8 x 1024² took 0.21-0.25 ms with them, 0.08-0.14 ms without).
    # The lr first: a tensor lr's cast may run the caller's code, which the check below covers.
    lr_tensor = _lr_tensor(step_lr)
    # A hyperparameter of a tensor subclass (or a schedule, where the caller did not take its
    # value first) ran the caller's code after kernel_ready accepted the leaves: check them
    # again, or that code could resize a storage and send the kernel out of bounds, and refuse
    # a torch mode that code entered, which would see (and could act on) the torch calls made
    # before the kernel. (Failing, the rule's fast step runs, whose kernels check every leaf
    # themselves.)
    if not plain_values and not (streaming.usable(()) and kernel_ready(params, grads, buffers)):
        return (*_fast_update(rule, params, grads, buffers, layout, count, lr, weight_decay, pool,
                              values), [])
    # A new tensor even when donated: should the kernel fail (out of memory), the state it was
    # given keeps its count.
    new_count = _next_count(count, done, donate=False)
    if pool is not None:
        pool.begin_update()
    new_params = list(params)
    new_buffers = {name: list(leaves) for name, leaves in buffers.items()}
    launches = []
    for batch, (kernel, hyperparameters, names) in zip(batches, specs, strict=True):
        slots = [[params[i] for i in batch], [grads[i] for i in batch],
                 *[None if name is None else [buffers[name][i] for i in batch] for name in names]]
        (batch_params, *batch_buffers), launch = streaming.prepare(
            kernel, hyperparameters, slots, pool, verified=True)
        launches.append(launch)
        _scatter(batch, batch_params, {name: leaves for name, leaves in zip(
            names, batch_buffers, strict=True) if name is not None}, new_params, new_buffers)
    return new_params, new_buffers, new_count, lr_tensor, launches


def _step_values(count: Tensor, lr: ScalarOrSchedule, weight_decay: Any,
                 done: int | None = None) -> tuple[int, Any, Any]:
    """The updates done so far (``done``, where ``int(count)`` was read already: on a cache
    swept by the last update each ``item()`` costs tens of microseconds), this update's lr (the
    schedule's value) and weight decay, as Python numbers where they are concrete."""
    done = int(count) if done is None else done
    return done, scalar(_lr_at(lr, done)), scalar(weight_decay)


def _plain_values(values: list) -> bool:
    """Whether reading these hyperparameters runs none of the caller's code: numbers or plain
    tensors, not a schedule or a tensor subclass.

    >>> _plain_values([0.1, torch.tensor(0.9), True]), _plain_values([lambda step: 0.1])
    (True, False)
    """
    return all(type(value) in (int, float, bool, Tensor) for value in values)


class CompiledStep:
    """A rule's ``plain_step`` over lists of leaves, compiled (lazily, once per set of leaf
    shapes) to write its results into given buffers.

    ``copy_`` into graph inputs lets inductor emit loops that read each input once and store
    each result straight into its output buffer, with no intermediate tensors: one pass over
    memory per update. One graph covers all leaves, so an update is one compiled call.
    """

    def __init__(self, plain_step: Callable[..., Any], step_scalars: Callable[[Any], Any]) -> None:
        self.plain_step = plain_step
        self.step_scalars = step_scalars
        self.kernel: Callable[..., None] | None = None

    def __call__(self, ps, gs, buffers, step, lr, weight_decays, ps_out, buffers_out) -> None:
        if self.kernel is None:
            self.kernel = torch.compile(self._into, dynamic=False, fullgraph=True)
        self.kernel(ps, gs, buffers, step, lr, weight_decays, ps_out, buffers_out)

    def _into(self, ps, gs, buffers, step, lr, weight_decays, ps_out, buffers_out) -> None:
        step = self.step_scalars(step)
        for index, (p, g, weight_decay) in enumerate(zip(ps, gs, weight_decays, strict=True)):
            leaf_buffers = {name: leaves[index] for name, leaves in buffers.items()}
            new_p, new_buffers = self.plain_step(p, g, leaf_buffers, step, lr, weight_decay)
            ps_out[index].copy_(new_p)
            for name, value in new_buffers.items():
                buffers_out[name][index].copy_(value)


def _compiled_update(kernel, params, grads, buffers, decays, count, lr, weight_decay, pool,
                     done=None):
    pool.begin_update()
    done = int(count) if done is None else done
    step_lr = scalar(_lr_at(lr, done))
    # 0-d tensors, not Python numbers, so that a new step or lr does not trigger a recompile.
    step = torch.tensor(done + 1, dtype=torch.float64, device="cpu")
    lr_tensor = torch.tensor(step_lr, dtype=torch.float64, device="cpu")
    decay_tensor = torch.tensor(scalar(weight_decay), dtype=torch.float64, device="cpu")
    no_decay = torch.zeros((), dtype=torch.float64, device="cpu")
    new_params = [pool.empty_like(p) for p in params]
    new_buffers = {name: [pool.empty_like(b) for b in leaves] for name, leaves in buffers.items()}
    with torch.no_grad():
        kernel(params, grads, buffers, step, lr_tensor,
               [decay_tensor if decay else no_decay for decay in decays],
               new_params, new_buffers)
    new_count = torch.tensor(done + 1, dtype=torch.int64, device="cpu")
    return new_params, new_buffers, new_count, _lr_tensor(step_lr)


Outputs = Callable[[list[Tensor]], list[Tensor]] | None
"""How a fast step gets its output buffers: ``None`` when donating (write into the inputs),
else a function returning fresh buffers shaped like the given tensors."""


def owned(tensors: list[Tensor], outputs: Outputs) -> list[Tensor]:
    """The tensors themselves when donated, else copies in fresh buffers a kernel may update."""
    if outputs is None:
        return tensors
    copies = outputs(tensors)
    torch._foreach_copy_(copies, tensors)
    return copies


def step_tensors(step: int, like: list[Tensor]) -> list[Tensor]:
    """``state_steps`` for a fused kernel: one float32 step tensor per leaf, on its device."""
    step_tensor = torch.tensor(float(step), dtype=torch.float32, device=like[0].device)
    return [step_tensor] * len(like)
