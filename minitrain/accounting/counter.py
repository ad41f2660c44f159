"""Count FLOPs, bytes moved and live memory of every aten op, per op and per module.

:class:`Counter` is a ``TorchDispatchMode``: backward and update count like the forward.
FLOPs: matmuls, convolutions and attention as ``FlopCounterMode``, other ops by the tables
below or :data:`FORMULA_OPS`; an op without a formula goes into ``unknown``, never a silent
zero. Bytes: inputs read and outputs written; views move nothing. Memory: :mod:`.ledger`.

>>> import torch
>>> a, b = torch.ones(64, 32), torch.ones(32, 16)
>>> with Counter() as c:
...     y = (a @ b).relu()
>>> c.flops, c.matmul_flops, c.bytes_read, c.bytes_written   # mm 2·64·32·16, relu 64·16
(66560, 65536, 14336, 8192)
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from minitrain import _torch
from minitrain._torch import TorchDispatchMode
from minitrain.accounting.hardware import HardwareError, dtype_name
from minitrain.accounting.ledger import Ledger, check_category, innermost
from minitrain.accounting.op_formulas import FORMULA_OPS, arguments, tensors
from minitrain.func import saved_tensor_hooks_inside
from minitrain.tree import size

__all__ = ["Counter", "DATA_MOVEMENT", "FORMULA_OPS", "OpRecord", "OpTotals", "POINTWISE_FLOPS",
           "REDUCTION_FLOPS"]

# FLOPs per output element of elementwise ops: one per arithmetic operation or elementary
# function in the op's definition (torch docs). Comparisons and logical ops count one.
POINTWISE_FLOPS: dict[str, int] = {
    **dict.fromkeys(
        ["add", "sub", "rsub", "mul", "div", "neg", "abs", "reciprocal", "sqrt", "rsqrt",
         "exp", "exp2", "expm1", "log", "log2", "log1p", "sin", "cos", "tanh", "erf", "sign",
         "sgn", "square", "pow", "relu", "threshold_backward", "maximum", "minimum", "clamp",
         "clamp_min", "clamp_max", "where", "eq", "ne", "lt", "le", "gt", "ge", "logical_not",
         "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or",
         "bitwise_xor", "floor", "ceil", "round", "trunc", "fmod", "remainder", "masked_fill",
         "leaky_relu", "hardtanh"],
        1,
    ),
    "addcmul": 3,  # self + value·t1·t2
    "addcdiv": 3,  # self + value·t1/t2
    "lerp": 3,  # self + weight·(end - self)
    "xlogy": 3,  # x == 0 ? 0 : x·log(y): compare, log, multiply
    "sigmoid": 4,  # 1/(1 + exp(-x))
    "sigmoid_backward": 3,  # g·y·(1 - y)
    "tanh_backward": 3,  # g·(1 - y²)
    "silu": 5,  # x·sigmoid(x)
    # sigmoid (4), then g·s·(1 + x·(1 - s)) (5); ATen's cpu/Activation.cpp silu_backward
    "silu_backward": 9,
    "leaky_relu_backward": 2,  # x > 0 ? g : g·slope
    "hardtanh_backward": 2,  # min < x < max ? g : 0, two comparisons
    "softplus": 5,  # β·x > threshold ? x : log1p(exp(β·x))/β
    "softplus_backward": 6,  # z = exp(β·x); β·x > threshold ? g : g·z/(z + 1)
    "gelu": 20,  # the chapter's 3.6.4 table: GeLU costs about 20 FLOPs per element
    "mse_loss_backward": 3,  # 2·(x - y)·g/n
}
# FLOPs per *input* element of reductions and normalizations (per element of ``self``).
REDUCTION_FLOPS: dict[str, int] = {
    **dict.fromkeys(["sum", "mean", "amax", "amin", "max", "min", "prod", "argmax", "argmin",
                     "any", "all", "cumsum", "cumprod", "cummax", "cummin"], 1),
    "norm": 2,  # square and add
    "linalg_vector_norm": 2,
    "var": 3,  # subtract the mean, square, add
    "std": 3,
    "var_mean": 3,
    "mse_loss": 3,  # subtract, square, add
    "logsumexp": 4,  # max, subtract, exp, add (one log per row is not counted)
    "_softmax": 5,  # max, subtract, exp, sum, divide
    "_safe_softmax": 6,  # softmax (5), and zero the rows that are all -inf (1)
    "_log_softmax": 5,  # max, subtract, exp, sum, log-and-subtract
    "_softmax_backward_data": 4,  # g·y - y·sum(g·y)
    "_log_softmax_backward_data": 4,  # g - exp(y)·sum(g): exp, row sum, multiply, subtract
    "native_layer_norm": 8,  # mean (2), variance (3), normalize (1), scale and shift (2)
}
# Ops that move or create data but do no arithmetic: zero FLOPs, their bytes still count.
DATA_MOVEMENT: frozenset[str] = frozenset(
    ["clone", "copy", "_to_copy", "contiguous", "cat", "stack", "fill", "zero", "zeros",
     "zeros_like", "ones", "ones_like", "empty", "empty_like", "empty_strided", "full",
     "full_like", "new_zeros", "new_ones", "new_empty", "new_empty_strided", "new_full",
     "scalar_tensor", "lift_fresh", "lift_fresh_copy", "arange", "index_select", "gather",
     "scatter", "index", "embedding", "constant_pad_nd", "randn", "rand", "normal", "uniform",
     "bernoulli", "randint", "randperm", "_local_scalar_dense", "set", "resize",
     "masked_select", "nonzero", "tril", "triu", "repeat", "flip", "roll", "_unsafe_index",
     "slice_scatter", "select_scatter", "as_strided_scatter", "diagonal_scatter",
     # backward of a slice or select: zeros of the input's shape with the gradient copied in
     "slice_backward", "select_backward"]
)
# Metadata queries: not counted at all (FlopCounterMode skips the same ones).
_METADATA_OPS = frozenset(
    [getattr(torch.ops.aten, name).default for name in (
        "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense", "size",
        "sym_size", "stride", "sym_stride", "storage_offset", "sym_storage_offset", "numel",
        "sym_numel", "dim")]
    + [torch.ops.aten.is_contiguous.memory_format, torch.ops.prim.layout.default,
       torch.ops.prim.device.default]  # fake tensors dispatch it, real ones never do
)


@dataclass(frozen=True)
class OpRecord:
    """One aten op call as the counter saw it: ``base`` is its formula key (``"mul"`` for
    ``aten._foreach_mul_``), bytes count stride-0 dims once, ``live_bytes`` right after it."""

    op: str
    base: str
    module: str
    backward: bool
    flops: int
    bytes_read: int
    bytes_written: int
    dtype: str
    input_shapes: tuple[tuple[int, ...], ...]
    has_formula: bool
    is_matmul: bool
    live_bytes: int

    @property
    def bytes(self) -> int:
        """Bytes moved: read plus written."""
        return self.bytes_read + self.bytes_written


@dataclass
class OpTotals:
    """Sums over calls: ``calls``, ``flops``, ``bytes_read``, ``bytes_written``."""

    calls: int = 0
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def add(self, record: OpRecord) -> None:
        self.calls += 1
        self.flops += record.flops
        self.bytes_read += record.bytes_read
        self.bytes_written += record.bytes_written


def _base_name(packet: Any) -> str:
    name = packet.__name__.removeprefix("_foreach_")
    return name.rstrip("_") if name.endswith("_") and not name.endswith("__") else name


def _mutated(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """Tensors an op writes in place (its schema marks them ``Tensor(a!)``)."""
    named = arguments(func, args, kwargs)
    return tensors([named[a.name] for a in func._schema.arguments
                    if a.alias_info is not None and a.alias_info.is_write])


def _unique_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel must touch for ``t``: broadcast (stride-0) dims are read once."""
    kept = math.prod(n for n, stride in zip(t.shape, t.stride(), strict=True) if stride)
    return kept * t.element_size() if t.numel() else 0


def _is_view(func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
             mutated: list[torch.Tensor]) -> bool:
    """No data moves: the schema says every output aliases an input and nothing is written
    (``Tensor(a)``), or (``aten._unsafe_view``) every output shares an input's storage."""
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return True
    if mutated or not outputs:
        return False
    return all(any(_torch.is_alias_of(out, t) for t in inputs) for out in outputs)


def _dtype_label(tensors: list[torch.Tensor]) -> str:
    if not tensors:
        return "none"
    try:
        return dtype_name(tensors[0].dtype)
    except HardwareError:
        return str(tensors[0].dtype).removeprefix("torch.")


class _Mode(TorchDispatchMode):
    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return NotImplemented
        # Like FlopCounterMode: decompose composite ops without a formula, count their parts.
        if func._overloadpacket not in flop_registry:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        self.counter._record(func, args, kwargs, out)
        return out


@dataclass
class Counter(OpTotals):
    """Context manager counting FLOPs, bytes and live memory of every aten op inside it (its
    totals are an :class:`OpTotals` of every call).

    ``keep_records``: one :class:`OpRecord` per call in ``records``; ``track_memory``: the
    :class:`~minitrain.accounting.ledger.Ledger` of live storages, and ``live_at_backward``,
    its bytes by category when the backward pass starts; ``watch_saved``: see what autograd
    saves (inside :func:`minitrain.value_and_grad`) instead of counting all the forward pass
    left alive as saved.

    >>> import torch
    >>> with Counter() as c:
    ...     torch.ones(4).lgamma()
    tensor([0., 0., 0., 0.])
    >>> c.unknown
    {'aten.lgamma': 1}
    """

    keep_records: bool = True
    track_memory: bool = True
    matmul_flops: int = 0
    by_op: dict[str, OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))
    by_module: dict[str, OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))
    matmul_by_module: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    unknown: dict[str, int] = field(default_factory=dict)
    records: list[OpRecord] = field(default_factory=list)
    live_at_backward: dict[str, int] | None = None
    watch_saved: bool = False
    ledger: Ledger = field(default_factory=Ledger, repr=False)
    _phase: str = field(default="forward", repr=False)
    _tracker: ModuleTracker | None = field(default=None, repr=False)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def __enter__(self) -> Counter:
        if self.watch_saved and not self.track_memory:
            raise ValueError("watch_saved needs track_memory=True")
        if self.watch_saved:
            self._stack.enter_context(saved_tensor_hooks_inside(self._pack, lambda t: t))
        self._tracker = self._stack.enter_context(ModuleTracker())
        self._stack.enter_context(_Mode(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)
        self._tracker = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.ledger.saved(t, self._phase)
        return t

    def track(self, *trees: Any, category: str | None = None) -> None:
        """Count the tensors of ``trees`` (params, optimizer state, batch) as live memory now,
        in ``category``."""
        if category is not None:
            check_category(category)
        for t in tensors(trees) if self.track_memory else ():
            allocation = self.ledger.add(t, phase="input")
            if allocation is not None and allocation.category is None:
                allocation.category = category

    def categorize(self, *trees: Any, category: str) -> None:
        """Put the live storages of ``trees`` (grads, new params...) in ``category``, unless
        :meth:`track` counted them as inputs."""
        for t in tensors(trees):
            self.ledger.categorize(t, category)

    def set_phase(self, phase: str) -> None:
        """Name the phase of the ops from now on (``"clip"``, ``"update"``); the counter
        itself tells ``forward``, ``backward`` and ``update`` (anything after the backward)."""
        self._phase = phase

    @property
    def live_bytes(self) -> int:
        """Bytes of tracked storages alive now."""
        return self.ledger.live

    @property
    def peak_bytes(self) -> int:
        """The highest :attr:`live_bytes` seen."""
        return self.ledger.peak

    def flop_counts(self) -> dict[str, dict[str, int]]:
        """Matmul-family FLOPs as ``FlopCounterMode.get_flop_counts()`` gives them."""
        return {module: dict(ops) for module, ops in self.matmul_by_module.items()}

    def _flops(self, func: Any, base: str, args: Any, kwargs: Any, out: Any,
               view: bool) -> int | None:
        packet = func._overloadpacket
        if packet in flop_registry:
            return int(flop_registry[packet](*args, **kwargs, out_val=out))
        if view or base in DATA_MOVEMENT or func.namespace == "profiler":
            return 0
        if base in FORMULA_OPS:
            return int(FORMULA_OPS[base](arguments(func, args, kwargs) | {"result": out}))
        if base in POINTWISE_FLOPS:
            # In-place ``_foreach_*`` ops return nothing: count the tensors they write.
            written = tensors(out) or _mutated(func, args, kwargs)
            return POINTWISE_FLOPS[base] * size(written)
        if base in REDUCTION_FLOPS:
            return REDUCTION_FLOPS[base] * size(args[0] if args else ())
        return None

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        packet = func._overloadpacket
        name, base = str(packet), _base_name(packet)
        inputs, outputs = tensors((args, kwargs)), tensors(out)
        mutated = _mutated(func, args, kwargs)
        written = {id(t): t for t in (*outputs, *mutated)}
        view = _is_view(func, inputs, outputs, mutated)
        flops = self._flops(func, base, args, kwargs, out, view)
        if flops is None:
            self.unknown[name] = self.unknown.get(name, 0) + 1
        moved = not view
        backward = _torch.current_autograd_node() is not None
        if backward and self.track_memory and self.live_at_backward is None:
            self.ledger.backward_starts()
            self.live_at_backward = self.ledger.live_by_category()
        if backward:
            self._phase = "backward"
        elif self._phase == "backward":
            self._phase = "update"
        parents = set(self._tracker.parents) if self._tracker is not None else {"Global"}
        module = innermost(parents)
        if self.track_memory:
            self.ledger.op(name, self._phase, module, inputs, outputs)
        record = OpRecord(
            op=name, base=base, module=module, backward=backward, flops=flops or 0,
            bytes_read=sum(map(_unique_bytes, inputs)) if moved else 0,
            bytes_written=sum(map(_unique_bytes, written.values())) if moved else 0,
            dtype=_dtype_label(outputs or inputs),
            input_shapes=tuple(tuple(t.shape) for t in inputs), has_formula=flops is not None,
            is_matmul=packet in flop_registry, live_bytes=self.ledger.live,
        )
        self.add(record)
        self.by_op[name].add(record)
        if record.is_matmul:
            self.matmul_flops += record.flops
        for parent in parents:
            self.by_module[parent].add(record)
            if record.is_matmul:
                self.matmul_by_module[parent][name] += record.flops
        if self.keep_records:
            self.records.append(record)
