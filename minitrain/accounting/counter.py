"""Count FLOPs, bytes moved and live memory of every aten op, per op and per module.

:class:`Counter` is a ``TorchDispatchMode``: it sees each aten op after autograd and
``torch.func`` have done their work, so the backward pass and the optimizer update are counted
like the forward pass. For every op it records

- **FLOPs**: matmuls, convolutions and attention by ``torch.utils.flop_counter``'s formulas (so
  its matmul FLOPs equal ``FlopCounterMode``'s exactly), elementwise ops and reductions by the
  tables below (FLOPs per element); an op with no formula goes into ``unknown`` (never a
  silent zero);
- **bytes**: read (every tensor input) and written (every tensor output), from shapes and dtypes;
  view ops move nothing;
- **live memory**: every storage it sees (plus those passed to :meth:`Counter.track`) counts as
  live until it is freed; ``peak_bytes`` is the highest total (CPU has no allocator statistics).

Per-module totals follow ``FlopCounterMode``'s naming (``"Global"``, ``"Sequential.0"``...),
also in the backward pass. Fields of :class:`OpRecord` (one per op call) are documented there.

>>> import torch
>>> a, b = torch.ones(64, 32), torch.ones(32, 16)
>>> with Counter() as c:
...     y = (a @ b).relu()
>>> c.flops, c.matmul_flops, c.bytes_read, c.bytes_written   # mm 2·64·32·16, relu 64·16
(66560, 65536, 14336, 8192)
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from minitrain.accounting.hardware import HardwareError, dtype_name

__all__ = [
    "Counter",
    "DATA_MOVEMENT",
    "FUSED_OPTIMIZER_FLOPS",
    "OpRecord",
    "OpTotals",
    "POINTWISE_FLOPS",
    "REDUCTION_FLOPS",
]

# FLOPs per output element of elementwise ops: one per arithmetic operation or elementary
# function in the op's definition (torch docs). Comparisons count one.
POINTWISE_FLOPS: dict[str, int] = {
    **dict.fromkeys(
        ["add", "sub", "rsub", "mul", "div", "neg", "abs", "reciprocal", "sqrt", "rsqrt",
         "exp", "exp2", "expm1", "log", "log2", "log1p", "sin", "cos", "tanh", "erf", "sign",
         "square", "pow", "relu", "threshold_backward", "maximum", "minimum", "clamp",
         "clamp_min", "clamp_max", "where", "eq", "ne", "lt", "le", "gt", "ge", "logical_not",
         "logical_and", "logical_or", "floor", "ceil", "round", "trunc", "fmod", "remainder",
         "masked_fill", "leaky_relu", "hardtanh"],
        1,
    ),
    "addcmul": 3,  # self + value·t1·t2
    "addcdiv": 3,  # self + value·t1/t2
    "lerp": 3,  # self + weight·(end - self)
    "sigmoid": 4,  # 1/(1 + exp(-x))
    "sigmoid_backward": 3,  # g·y·(1 - y)
    "tanh_backward": 3,  # g·(1 - y²)
    "silu": 5,  # x·sigmoid(x)
    "gelu": 20,  # the chapter's 3.6.4 table: GeLU costs about 20 FLOPs per element
    "mse_loss_backward": 3,  # 2·(x - y)·g/n
}
# FLOPs per *input* element of reductions and normalizations (per element of ``self``).
REDUCTION_FLOPS: dict[str, int] = {
    **dict.fromkeys(["sum", "mean", "amax", "amin", "max", "min", "prod", "argmax", "argmin",
                     "any", "all", "cumsum"], 1),
    "norm": 2,  # square and add
    "linalg_vector_norm": 2,
    "var": 3,  # subtract the mean, square, add
    "std": 3,
    "var_mean": 3,
    "mse_loss": 3,  # subtract, square, add
    "_softmax": 5,  # max, subtract, exp, sum, divide
    "_log_softmax": 5,  # max, subtract, exp, sum, log-and-subtract
    "_softmax_backward_data": 4,  # g·y - y·sum(g·y)
    "_log_softmax_backward_data": 3,  # g - exp(y)·sum(g)
    "native_layer_norm": 8,  # mean (2), variance (3), normalize (1), scale and shift (2)
    "nll_loss_forward": 1,
}
# FLOPs per parameter element of torch's fused optimizer kernels, counting every term of the
# update in the torch.optim docs: SGD ``p - lr·g``; Adam(W) moments (3 + 4), bias-corrected
# denominator (3), step (3), plus decoupled weight decay (2) for AdamW; Adagrad ``s + g²`` (2)
# and ``p - lr·g/(sqrt(s) + eps)`` (4).
FUSED_OPTIMIZER_FLOPS: dict[str, int] = {
    "_fused_sgd": 2,
    "_fused_adam": 13,
    "_fused_adamw": 15,
    "_fused_adagrad": 6,
}
# Ops that move or create data but do no arithmetic: zero FLOPs, their bytes still count.
DATA_MOVEMENT: frozenset[str] = frozenset(
    ["clone", "copy", "_to_copy", "contiguous", "cat", "stack", "fill", "zero", "zeros",
     "zeros_like", "ones", "ones_like", "empty", "empty_like", "empty_strided", "full",
     "full_like", "new_zeros", "new_ones", "new_empty", "new_empty_strided", "new_full",
     "scalar_tensor", "lift_fresh", "lift_fresh_copy", "arange", "index_select", "gather",
     "scatter", "index", "index_put", "embedding", "embedding_dense_backward", "constant_pad_nd",
     "randn", "rand", "normal", "uniform", "bernoulli", "randint", "randperm",
     "_local_scalar_dense", "set", "resize", "masked_select", "nonzero", "tril", "triu",
     "repeat", "flip", "roll", "_unsafe_index", "slice_scatter", "select_scatter"]
)
# Metadata queries: not counted at all (FlopCounterMode skips the same ones).
_METADATA_OPS = frozenset(
    [torch.ops.aten.is_contiguous.default, torch.ops.aten.is_contiguous.memory_format,
     torch.ops.aten.is_strides_like_format.default,
     torch.ops.aten.is_non_overlapping_and_dense.default, torch.ops.aten.size.default,
     torch.ops.aten.sym_size.default, torch.ops.aten.stride.default,
     torch.ops.aten.sym_stride.default, torch.ops.aten.storage_offset.default,
     torch.ops.aten.sym_storage_offset.default, torch.ops.aten.numel.default,
     torch.ops.aten.sym_numel.default, torch.ops.aten.dim.default, torch.ops.prim.layout.default]
)


@dataclass(frozen=True)
class OpRecord:
    """One aten op call as the counter saw it.

    - ``op``: the op without overload (``"aten.mm"``); ``base``: its formula key, with in-place
      ``_`` and ``_foreach_`` stripped (``"mul"`` for ``aten._foreach_mul_``)
    - ``module``: innermost module path (``"Global"`` outside any ``nn.Module``)
    - ``backward``: True when run by the autograd engine (the backward pass)
    - ``flops``: FLOPs by formula; 0 with ``has_formula=False`` means "no formula", see
      :attr:`Counter.unknown`
    - ``bytes_read`` / ``bytes_written``: bytes of tensor inputs / outputs (stride-0
      broadcast dims counted once; views move nothing)
    - ``dtype``: dtype name of the first output (or input) tensor, e.g. ``"fp32"``
    - ``input_shapes``: shapes of the tensor inputs, in order
    - ``live_bytes``: live bytes tracked right after the op
    """

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

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved (chapter 3.6.3); ``inf`` if no bytes."""
        return self.flops / self.bytes if self.bytes else math.inf


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
    name = packet.__name__
    if name.startswith("_foreach_"):
        name = name[len("_foreach_"):]
    return name.rstrip("_") if name.endswith("_") and not name.endswith("__") else name


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _mutated(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """Tensors an op writes in place (its schema marks them ``Tensor(a!)``)."""
    mutated = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.kwarg_only or position >= len(args):
            value = kwargs.get(argument.name)
        else:
            value = args[position]
        mutated.extend(_tensors(value))
    return mutated


def _unique_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel must touch for ``t``: broadcast (stride-0) dims are read once."""
    numel = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            numel *= size
    return numel * t.element_size() if t.numel() else 0


def _elements(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _dtype_label(tensors: list[torch.Tensor]) -> str:
    if not tensors:
        return "none"
    try:
        return dtype_name(tensors[0].dtype)
    except HardwareError:
        return str(tensors[0].dtype).removeprefix("torch.")


def _innermost(parents: set[str]) -> str:
    return max(parents, key=lambda p: (p != "Global", p.count("."), len(p)), default="Global")


class _LiveStorages:
    """Bytes of live storages, each counted once; freed storages leave through a finalizer."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        if t.is_meta or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self.sizes:
            return
        self.sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


class _Mode(TorchDispatchMode):
    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return NotImplemented
        # Like FlopCounterMode: decompose composite ops without a formula, count their parts.
        if func._overloadpacket not in flop_registry and func is not torch.ops.prim.device.default:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        self.counter._record(func, args, kwargs, out)
        return out


@dataclass
class Counter:
    """Context manager counting FLOPs, bytes and live memory of every aten op inside it.

    Args:
        keep_records: keep one :class:`OpRecord` per call in ``records`` (for rooflines).
        track_memory: track live storages for ``peak_bytes`` / ``live_bytes``.

    Results: ``flops`` (all ops with a formula), ``matmul_flops`` (the ``FlopCounterMode``
    subset), ``bytes_read``, ``bytes_written``, ``by_op`` and ``by_module`` (name ->
    :class:`OpTotals`), ``unknown`` (op -> calls with no FLOP formula), ``records``,
    ``peak_bytes``, ``live_bytes``, ``backward_start_live_bytes`` (live bytes when the
    first backward op ran: params, state, batch and the saved activations) and
    ``forward_matmul_inputs`` (storage address -> bytes of each forward matmul operand).

    >>> import torch
    >>> with Counter() as c:
    ...     torch.ones(8).cumprod(0)
    tensor([1., 1., 1., 1., 1., 1., 1., 1.])
    >>> c.unknown
    {'aten.cumprod': 1}
    """

    keep_records: bool = True
    track_memory: bool = True
    flops: int = 0
    matmul_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    by_op: dict[str, OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))
    by_module: dict[str, OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))
    matmul_by_module: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    unknown: dict[str, int] = field(default_factory=dict)
    records: list[OpRecord] = field(default_factory=list)
    backward_start_live_bytes: int | None = None
    forward_matmul_inputs: dict[int, int] = field(default_factory=dict)
    _live: _LiveStorages = field(default_factory=_LiveStorages, repr=False)
    _tracker: ModuleTracker | None = field(default=None, repr=False)
    _mode: _Mode | None = field(default=None, repr=False)

    def __enter__(self) -> Counter:
        self._tracker = ModuleTracker()
        self._tracker.__enter__()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None and self._tracker is not None, "exit without enter"
        self._mode.__exit__(*exc)
        self._tracker.__exit__(*exc)
        self._mode = self._tracker = None

    def track(self, *trees: Any) -> None:
        """Count the tensors of ``trees`` (params, optimizer state, batch) as live memory now."""
        if self.track_memory:
            for t in _tensors(trees):
                self._live.add(t)

    @property
    def live_bytes(self) -> int:
        """Bytes of tracked storages alive now."""
        return self._live.live

    @property
    def peak_bytes(self) -> int:
        """The highest :attr:`live_bytes` seen."""
        return self._live.peak

    def flop_counts(self) -> dict[str, dict[str, int]]:
        """Matmul-family FLOPs as ``FlopCounterMode.get_flop_counts()`` gives them (op names as
        text), for a side-by-side comparison."""
        return {module: dict(ops) for module, ops in self.matmul_by_module.items()}

    def _flops(self, func: Any, base: str, args: Any, kwargs: Any, out: Any) -> int | None:
        packet = func._overloadpacket
        if packet in flop_registry:
            return int(flop_registry[packet](*args, **kwargs, out_val=out))
        if func.is_view or base in DATA_MOVEMENT:
            return 0
        if base in POINTWISE_FLOPS:
            return POINTWISE_FLOPS[base] * _elements(_tensors(out))
        first = _tensors(args[0] if args else ())
        if base in REDUCTION_FLOPS:
            return REDUCTION_FLOPS[base] * _elements(first)
        if base in FUSED_OPTIMIZER_FLOPS:
            return FUSED_OPTIMIZER_FLOPS[base] * _elements(first)
        return None

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        packet = func._overloadpacket
        name, base = str(packet), _base_name(packet)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        written = {id(t): t for t in (*outputs, *_mutated(func, args, kwargs))}
        flops = self._flops(func, base, args, kwargs, out)
        if flops is None:
            self.unknown[name] = self.unknown.get(name, 0) + 1
        moved = not func.is_view
        backward = torch._C._current_autograd_node() is not None
        if self.track_memory:
            if backward and self.backward_start_live_bytes is None:
                self.backward_start_live_bytes = self._live.live
            for t in (*inputs, *outputs):
                self._live.add(t)
        parents = set(self._tracker.parents) if self._tracker is not None else {"Global"}
        record = OpRecord(
            op=name,
            base=base,
            module=_innermost(parents),
            backward=backward,
            flops=flops or 0,
            bytes_read=sum(map(_unique_bytes, inputs)) if moved else 0,
            bytes_written=sum(map(_unique_bytes, written.values())) if moved else 0,
            dtype=_dtype_label(outputs or inputs),
            input_shapes=tuple(tuple(t.shape) for t in inputs),
            has_formula=flops is not None,
            is_matmul=packet in flop_registry,
            live_bytes=self._live.live,
        )
        self.flops += record.flops
        self.bytes_read += record.bytes_read
        self.bytes_written += record.bytes_written
        self.by_op[name].add(record)
        if record.is_matmul:
            self.matmul_flops += record.flops
        for parent in parents:
            self.by_module[parent].add(record)
            if record.is_matmul:
                self.matmul_by_module[parent][name] += record.flops
        if record.is_matmul and not backward:
            for t in inputs:
                key = t.untyped_storage().data_ptr()
                self.forward_matmul_inputs.setdefault(key, _unique_bytes(t))
        if self.keep_records:
            self.records.append(record)

    def summary(self) -> dict[str, Any]:
        """Totals as plain JSON-serializable values."""
        return {
            "flops": self.flops,
            "matmul_flops": self.matmul_flops,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "peak_bytes": self.peak_bytes if self.track_memory else None,
            "unknown_ops": dict(self.unknown),
            "by_op": {name: vars(totals).copy() for name, totals in self.by_op.items()},
        }

    def table(self, top: int = 20) -> str:
        """The ``top`` ops by FLOPs as an aligned text table, unknown ops marked ``?``."""
        rows = sorted(self.by_op.items(), key=lambda item: (-item[1].flops, item[0]))[:top]
        lines = [f"{'op':<36}{'calls':>7}{'FLOPs':>12}{'bytes':>12}{'FLOP/B':>9}"]
        for name, t in rows:
            moved = t.bytes_read + t.bytes_written
            mark = "?" if name in self.unknown else " "
            ratio = f"{t.flops / moved:9.2f}" if moved else f"{'-':>9}"
            lines.append(
                f"{name + mark:<36}{t.calls:>7}{t.flops:>12.3g}{moved:>12.3g}{ratio}"
            )
        return "\n".join(lines)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self.records)
