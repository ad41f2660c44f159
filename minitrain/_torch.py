"""The one module that names private torch APIs.

Each name is torch's own object, read never assigned, with a comment saying why minitrain
needs it; tests/test_torch_compat.py checks each on the installed torch.

>>> import torch
>>> pytree.tree_leaves({"a": [torch.ones(1)], "b": torch.zeros(1)})
[tensor([1.]), tensor([0.])]
"""

from __future__ import annotations

import functools
import types
import typing

import optree
import torch
import torch.utils._cxx_pytree as _cxx_pytree
import torch.utils._device as _device
import torch.utils._python_dispatch as _python_dispatch
import torch.utils._pytree as _pytree
from torch._subclasses import fake_tensor as _fake_tensor

__all__ = [
    "pytree", "TorchDispatchMode", "disable_current_modes", "FakeTensor", "FakeTensorMode",
    "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
    "saved_tensors_hooks_enable", "peek_interpreter_stack", "is_functorch_wrapped_tensor",
    "get_unwrapped", "vmap_transform", "unwrap_batched", "add_batch_dim", "foreach_norm",
    "is_alias_of", "current_autograd_node", "forward_ad_active", "make_subclass",
    "is_batchedtensor", "maybe_get_level", "scaled_mm",
    "disable_dynamo", "foreach", "fused_adam_", "fused_adamw_", "fused_sgd_", "fused_adagrad_",
    "is_gradtrackingtensor", "get_current_dispatch_mode", "is_torch_function_mode_enabled",
    "get_current_function_mode_stack", "DeviceContext", "storage_use_count",
]

# -- pytrees ------------------------------------------------------------------------------------

# Pytrees of dicts, lists, tuples and NamedTuples: flatten (with key paths), map, unflatten, and
# the key types (MappingKey, SequenceKey, GetAttrKey) that name leaves. No public alternative:
# torch 2.13 and 2.14 ship no ``torch.utils.pytree``. Flatten, unflatten, map and structure are
# the optree-backed twins (same leaf order, walked in C++: an update flattens params, grads and
# state several times), except for a tree holding a node type the Python registry alone
# knows (torch.export.register_dataclass), which optree takes for a leaf: such a tree is the
# Python functions'. Key paths exist in the Python one only.
_PYTHON_ONLY: list = [None, frozenset()]  # (size, newest key) of the Python registry, and its
# node types optree does not know


def _python_only_node(leaves: list) -> bool:
    nodes = _pytree.SUPPORTED_NODES
    key = (len(nodes), next(reversed(nodes), None))
    if key != _PYTHON_ONLY[0]:
        _PYTHON_ONLY[:] = [key, frozenset(t for t in list(nodes) if optree.register_pytree_node.get(
            t, namespace="torch") is None)]
    return not _PYTHON_ONLY[1].isdisjoint(map(type, leaves))


@functools.lru_cache(maxsize=256)
def _flat_dict_spec(keys: tuple) -> typing.Any:
    """The structure of a dict of tensors with these keys, in this order."""
    return _cxx_pytree.tree_structure(dict.fromkeys(keys, 0))


def _tree_flatten(tree: typing.Any, is_leaf: typing.Any = None) -> tuple[list, typing.Any]:
    if type(tree) is dict and is_leaf is None:  # params and grads: a quarter of optree's time
        leaves = list(tree.values())  # (str keys: 1, 1.0 and True are one key to the cache)
        if all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in leaves) and \
                all(type(k) is str for k in tree):
            return leaves, _flat_dict_spec(tuple(tree))
    leaves, spec = _cxx_pytree.tree_flatten(tree, is_leaf)
    return _pytree.tree_flatten(tree, is_leaf) if _python_only_node(leaves) else (leaves, spec)


def _tree_map(func: typing.Any, tree: typing.Any, *rests: typing.Any,
              is_leaf: typing.Any = None) -> typing.Any:
    leaves, spec = _tree_flatten(tree, is_leaf)
    if rests:  # leaves of several trees: the flattening module's map pairs them
        return (_cxx_pytree if isinstance(spec, _cxx_pytree.TreeSpec) else _pytree).tree_map(
            func, tree, *rests, is_leaf=is_leaf)
    return pytree.tree_unflatten([func(leaf) for leaf in leaves], spec)


pytree = types.SimpleNamespace(**vars(_pytree))
pytree.TreeSpec = _cxx_pytree.TreeSpec | _pytree.TreeSpec
pytree.tree_flatten = _tree_flatten
pytree.tree_leaves = lambda tree, is_leaf=None: _tree_flatten(tree, is_leaf)[0]
pytree.tree_structure = lambda tree, is_leaf=None: _tree_flatten(tree, is_leaf)[1]
pytree.tree_map = _tree_map
pytree.tree_unflatten = lambda leaves, spec: (_cxx_pytree if isinstance(
    spec, _cxx_pytree.TreeSpec) else _pytree).tree_unflatten(leaves, spec)

# -- dispatch modes and fake tensors (accounting: counting and predicting a step) -------------

# The base class of a mode that sees every aten op below autograd (the counter, the predictor).
# No public alternative: torch.overrides.TorchFunctionMode sees torch-level calls, above autograd.
TorchDispatchMode = _python_dispatch.TorchDispatchMode
# Runs an op with every dispatch mode off (a query under fake mode). No public alternative.
disable_current_modes = _python_dispatch._disable_current_modes
# Tensors with a shape, dtype and device but no data, for predicting a step without computing
# it. No public alternative (torch.empty(..., device="meta") loses the device and meets ops
# with no meta kernel).
FakeTensor = _fake_tensor.FakeTensor
FakeTensorMode = _fake_tensor.FakeTensorMode
# What fake tensors raise for an op that needs data (.item(), nonzero) or has no fake kernel;
# the predictor turns each into one line. No public alternative.
DataDependentOutputException = _fake_tensor.DataDependentOutputException
DynamicOutputShapeException = _fake_tensor.DynamicOutputShapeException
UnsupportedOperatorException = _fake_tensor.UnsupportedOperatorException

# -- autograd and torch.func internals ----------------------------------------------------------

# Lifts torch.func.grad's refusal of saved-tensor hooks inside the differentiated function
# (activation checkpointing, the counter's record of saved activations). No public alternative:
# torch.autograd.graph.disable_saved_tensors_hooks only turns them off.
saved_tensors_hooks_enable = torch._C._autograd._saved_tensors_hooks_enable
# The innermost torch.func transform running, or None outside every transform (the plain
# autograd fast path applies only outside them). No public alternative.
peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack
# Whether a tensor is a torch.func wrapper (batched or grad-tracking): such tensors take the
# per-leaf path, as _foreach ops have no batching rule. No public alternative.
is_functorch_wrapped_tensor = torch._C._functorch.is_functorch_wrapped_tensor
# The tensor one torch.func wrapper holds (the one a dispatch mode sees). No public alternative.
get_unwrapped = torch._C._functorch.get_unwrapped
# vmap's transform type, a batched tensor's stacked tensor and batch dim at a level, and a
# tensor made batched: a vmapped optimizer update runs once on the stacked members (the
# lowering's vmap path). No public alternative: a custom autograd.Function's vmap staticmethod
# does this, with a dispatch of its own on every call.
vmap_transform = torch._C._functorch.TransformType.Vmap
unwrap_batched = torch._C._functorch._unwrap_batched
add_batch_dim = torch._C._functorch._add_batch_dim
# The current autograd node while a backward pass runs, else None: tells the counter's forward
# ops from backward ones. No public alternative.
current_autograd_node = torch._C._current_autograd_node


def forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open: its dual tensors are neither
    functorch-wrapped nor requiring grad, yet a kernel on their primals would drop the tangents.
    No public alternative (``forward_ad`` keeps the level in a module global)."""
    return torch.autograd.forward_ad._current_level >= 0

# -- tensor ops ---------------------------------------------------------------------------------

# Every tensor's norm in one call (one C++ loop on CPU, one kernel launch group on CUDA) for
# the global norm. Public alternative: torch.nn.utils.get_total_norm (torch >= 2.6), which on
# CPU loops over the tensors in Python.
foreach_norm = torch._foreach_norm
# Whether two tensors share storage (a view op moves no data), fake tensors included. Public
# alternative: comparing untyped_storage().data_ptr(), which fake and empty tensors defeat.
is_alias_of = torch._C._is_alias_of
# A tensor subclass instance on the same data, detached (a swept hyperparameter). Public
# alternative: Tensor.as_subclass, which keeps the autograd graph of its input.
make_subclass = torch.Tensor._make_subclass

# -- simulated low-precision matmuls (minitrain.precision) --------------------------------------

# Whether a torch.func wrapper is vmap's (batched) rather than grad's: a matmul vmapped inside
# the function that differentiates its amax history takes current scaling. No public alternative.
is_batchedtensor = torch._C._functorch.is_batchedtensor
# The torch.func level (nesting depth) of a wrapper, to tell a vmap inside a grad from one
# outside it. No public alternative.
maybe_get_level = torch._C._functorch.maybe_get_level
# fp8 GEMMs on fp8 tensor cores (cuBLASLt) with per-tensor scales, fp32 out (cuda-fp8). Public
# alternative: torch.nn.functional.scaled_mm, whose scale recipes are private enums.
scaled_mm = torch._scaled_mm
# torch.compiler.disable without importing dynamo until the decorated function first runs (0.8 s
# at minitrain's import otherwise): the simulated matmul is a graph break. Public alternative:
# torch.compiler.disable, which imports dynamo when it decorates.
disable_dynamo = getattr(torch, "_disable_dynamo", torch.compiler.disable)

# -- optimizer kernels and their guards (minitrain.optim) ---------------------------------------

# torch's foreach kernels by op name (``foreach["mul"]`` is ``torch._foreach_mul``): one C++
# loop or kernel group over a list of tensors, for LeafBatch's arithmetic, clipping and the
# lowering's copies. No public alternative: torch.optim's foreach paths call them privately.
foreach = types.MappingProxyType({
    name.removeprefix("_foreach_"): getattr(torch, name)
    for name in dir(torch) if name.startswith("_foreach_")
})
# torch.optim's fused kernels (all leaves in place in one pass), for the lowering of adam(w),
# sgd and adagrad chains. Public alternative: torch.optim.Adam(fused=True) and so on, which
# mutate through an object and a param_groups list.
fused_adam_ = torch._fused_adam_
fused_adamw_ = torch._fused_adamw_
fused_sgd_ = torch._fused_sgd_
fused_adagrad_ = torch._fused_adagrad_
# Whether a torch.func wrapper is grad's (or jvp's), to name a leaf's. No public alternative.
is_gradtrackingtensor = torch._C._functorch.is_gradtrackingtensor
# The innermost active TorchDispatchMode, or None: the C kernels and probes give way to torch's
# ops where a mode (the accounting Counter, fake tensors) watches. No public alternative.
get_current_dispatch_mode = _python_dispatch._get_current_dispatch_mode
# Whether any TorchFunctionMode is active, and the stack of them: the C kernels give way where
# one other than torch's default-device mode watches. No public alternative.
is_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
get_current_function_mode_stack = torch.overrides._get_current_function_mode_stack
# The TorchFunctionMode torch.set_default_device installs (no watcher). No public alternative.
DeviceContext = _device.DeviceContext
# How many tensors hold a storage (by its ``_cdata``), for the buffer pool's reuse of outputs
# nobody holds. No public alternative (sys.getrefcount counts the Python object, not the
# storage's users).
storage_use_count = torch._C._storage_Use_Count
