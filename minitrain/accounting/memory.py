"""Memory napkin math: bytes per parameter, the largest trainable model, ZeRO as DeepSpeed
counts it, and the one table of optimizer-state sizes (:data:`OPTIMIZER_STATES`).

Pure Python at import. Training holds params, grads, optimizer state (plus fp32 master weights
under mixed precision) and activations (chapter 3.1.2 and 3.5.6).

>>> bytes_per_param("adamw", "fp32").total     # 4 params + 4 grads + 8 Adam moments
16
>>> round(max_params(80e9, optimizer="adamw", precision="fp32", gpus=8) / 1e9)  # 8×80 GB
40
"""

from __future__ import annotations

import inspect
import math
from typing import Any, NamedTuple

from minitrain.accounting.hardware import Hardware
from minitrain.accounting.hardware import hardware as lookup_hardware
from minitrain.accounting.units import Number
from minitrain.errors import UserError
from minitrain.precision.policies import PRECISIONS, Precision
from minitrain.precision.policies import element_bytes as precision

__all__ = ["OPTIMIZER_STATES", "PRECISIONS", "STATE_OPTIONS", "BytesPerParam", "MemoryBreakdown",
           "Precision", "ZeroMemory", "bytes_per_param", "max_params", "optimizer_key",
           "optimizer_state_elements", "optimizer_states", "state_bytes", "training_memory",
           "zero_memory"]

# Parameter-sized tensors of optimizer state per parameter tensor, as torch.optim keeps them
# (the ``state[...] = torch.zeros_like(p)`` lines of each optimizer's ``_init_group`` in
# torch/optim/*.py): SGD none; SGD with momentum "momentum_buffer"; Adagrad "sum"; RMSprop
# "square_avg" (no momentum, not centered); Adam/AdamW "exp_avg" and "exp_avg_sq"; Adadelta
# "square_avg" and "acc_delta"; Adamax "exp_avg" and "exp_inf"; NAdam and RAdam "exp_avg" and
# "exp_avg_sq"; Muon (torch/optim/_muon.py) "momentum_buffer"; Lion (Chen et al. 2023;
# lion-pytorch) its single "exp_avg"; schedule-free AdamW (Defazio et al. 2024; schedulefree's
# AdamWScheduleFree) "z" and "exp_avg_sq". Adafactor (torch/optim/_adafactor.py, Shazeer and
# Stern 2018) factors the second moment of a matrix into "row_var" (rows) and "col_var"
# (columns), ``(r + c)/(r·c)`` elements per parameter, 0 in the limit of large matrices; a
# vector keeps a full "variance" (see :func:`optimizer_state_elements`). optax's aliases
# (optax/_src/alias.py): LAMB, AdaBelief and Yogi keep two moments ("mu", "nu"), LARS one
# momentum "trace", Polyak SGD none.
OPTIMIZER_STATES: dict[str, int] = {
    "sgd": 0, "momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 2, "adamw": 2, "adadelta": 2,
    "adamax": 2, "nadam": 2, "radam": 2, "adafactor": 0, "lion": 1, "muon": 1,
    "schedule_free_adamw": 2, "lamb": 2, "lars": 1, "adabelief": 2, "yogi": 2, "polyak_sgd": 0,
}
# 0-d tensors torch keeps per parameter tensor besides those: "step" (all but SGD, Lion and
# Muon) and NAdam's "mu_product".
_SCALAR_STATES: dict[str, int] = dict.fromkeys(OPTIMIZER_STATES, 1) | {
    "sgd": 0, "momentum": 0, "lion": 0, "muon": 0, "nadam": 2,
    "schedule_free_adamw": 0,  # its step count and weight sum live in the param group
    "lars": 0, "polyak_sgd": 0,
}
# Options that add one parameter-sized tensor, and the optimizers that take each: Adam(W)'s
# "max_exp_avg_sq", SGD's and RMSprop's "momentum_buffer", RMSprop's "grad_avg".
STATE_OPTIONS: dict[str, tuple[str, ...]] = {
    "amsgrad": ("adam", "adamw"), "momentum": ("sgd", "momentum", "rmsprop"),
    "centered": ("rmsprop",)}
# What each ZeRO stage shards over the devices (Rajbhandari et al. 2020, "ZeRO", figure 1):
# stage 1 the optimizer state (with the master weights), stage 2 also the grads, stage 3 also
# the params. Stage 0 replicates everything.
_SHARDED = {0: (), 1: ("optimizer_state", "master_weights"),
            2: ("optimizer_state", "master_weights", "grads"),
            3: ("optimizer_state", "master_weights", "grads", "params")}


def optimizer_key(optimizer: str) -> str:
    """``optimizer`` as :data:`OPTIMIZER_STATES` names it (case, spaces and ``-`` aside).

    >>> optimizer_key(" Schedule-Free-AdamW ")
    'schedule_free_adamw'
    """
    key = optimizer.strip().lower().replace("-", "_") if isinstance(optimizer, str) else None
    if key not in OPTIMIZER_STATES:
        raise UserError(
            f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATES)}"
        )
    return key


def optimizer_states(
    optimizer: str, *, amsgrad: bool = False, momentum: bool = False, centered: bool = False
) -> int:
    """Optimizer-state tensors per parameter tensor (``adamw`` → 2); ``amsgrad`` (Adam(W)),
    ``momentum`` (SGD, RMSprop) and ``centered`` (RMSprop) add one each (:data:`STATE_OPTIONS`).

    >>> optimizer_states("momentum"), optimizer_states("sgd", momentum=True)
    (1, 1)
    >>> optimizer_states("rmsprop", momentum=True, centered=True)
    3
    """
    key = optimizer_key(optimizer)
    for name, value in dict(amsgrad=amsgrad, momentum=momentum, centered=centered).items():
        if value and key not in STATE_OPTIONS[name]:
            takers = " and ".join(STATE_OPTIONS[name])
            raise UserError(f"{name} does not apply to {key}; it is an option of {takers} only")
    extra = bool(amsgrad) + bool(centered) + bool(momentum and key != "momentum")
    return OPTIMIZER_STATES[key] + extra


def optimizer_state_elements(optimizer: str, shape: tuple[int, ...], *, scalars: bool = True,
                             **state_options: bool) -> int:
    """Elements of optimizer state torch keeps for one parameter of ``shape`` (see
    :data:`OPTIMIZER_STATES`), with its 0-d ``step`` (and the like) when ``scalars``; options as
    in :func:`optimizer_states`. Adafactor keeps ``prod(shape[:-1])`` row and
    ``prod(shape[:-2])·shape[-1]`` column elements for a matrix (or a stack of them); Muon
    takes matrices only, other params fall back to AdamW (Jordan et al. 2024).

    >>> optimizer_state_elements("adamw", (768, 3072))    # two moments and the step
    4718593
    >>> optimizer_state_elements("adafactor", (768, 3072))    # rows + columns + step
    3841
    >>> optimizer_state_elements("muon", (768,))    # AdamW's two moments and its step
    1537
    """
    key = optimizer_key(optimizer)
    full = optimizer_states(key, **state_options)
    if not _is_shape(shape) or any(n < 0 for n in shape):
        raise UserError(f"shape must be a tuple of sizes >= 0, got {shape!r}")
    scalar = _SCALAR_STATES[key]
    if key == "muon" and len(shape) != 2:
        full, scalar = OPTIMIZER_STATES["adamw"], _SCALAR_STATES["adamw"]
    elements = full * math.prod(shape)
    if key == "adafactor":
        elements = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2
                    else math.prod(shape))
    return elements + (scalar if scalars else 0)


class BytesPerParam(NamedTuple):
    """Bytes each parameter costs in training, by kind; ``total`` sums them."""

    params: int
    grads: int
    optimizer_state: int
    master_weights: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.master_weights


def bytes_per_param(optimizer: str = "adamw", precision_name: str = "fp32",
                    **state_options: bool) -> BytesPerParam:
    """Bytes per parameter for ``optimizer`` under a precision recipe (see ``PRECISIONS``);
    options as in :func:`optimizer_states`. Adafactor counts 0, Muon 1 (large matrices).

    >>> bytes_per_param("adamw", "bf16-mixed")   # ZeRO paper: 2 + 2 + (4 + 8) = 16
    BytesPerParam(params=2, grads=2, optimizer_state=8, master_weights=4)
    >>> bytes_per_param("sgd", "fp32").total, bytes_per_param("adam", amsgrad=True).total
    (8, 20)
    """
    recipe = precision(precision_name)
    states = optimizer_states(optimizer, **state_options)
    return BytesPerParam(recipe.params, recipe.grads, states * recipe.optimizer_state,
                         recipe.master_weights)


def max_params(
    memory: str | Hardware | Number, *, optimizer: str = "adamw", precision: str = "fp32",
    gpus: int = 1, zero_stage: int = 3, **state_options: bool,
) -> float:
    """The most parameters that fit: per-device memory (bytes, or a hardware name) over
    per-device bytes per parameter, activations not included. The default ``zero_stage=3``
    spreads every byte over the devices, as the chapter's 3.1.2 (640 GB / 16 B).

    >>> max_params("h100", gpus=8, zero_stage=0) / 1e9    # replicated: one device's 80 GB / 16
    5.0
    """
    if isinstance(memory, str):
        memory = lookup_hardware(memory)
    total = memory.memory_bytes if isinstance(memory, Hardware) else memory
    if total <= 0:
        raise UserError(f"memory must be a positive number of bytes, got {total}")
    per_param = training_memory(1, optimizer=optimizer, precision=precision, gpus=gpus,
                                zero_stage=zero_stage, **state_options)
    return total / per_param.total


class MemoryBreakdown(NamedTuple):
    """Bytes on one device, by kind; ``total`` sums them."""

    params: float
    grads: float
    optimizer_state: float
    master_weights: float
    activations: float

    @property
    def total(self) -> float:
        return float(sum(self))


def training_memory(
    params: Number, *, optimizer: str = "adamw", precision: str = "fp32",
    activation_bytes: Number = 0, gpus: int = 1, zero_stage: int = 0, **state_options: bool,
) -> MemoryBreakdown:
    """Bytes on one device to train ``params`` parameters (activations given per device);
    options as in :func:`optimizer_states`.

    >>> training_memory(1e9, optimizer="adamw", precision="fp32").total / 1e9
    16.0
    >>> training_memory(1e9, optimizer="adam", precision="fp32", amsgrad=True).total / 1e9
    20.0
    """
    per_param = bytes_per_param(optimizer, precision, **state_options)
    if gpus < 1:
        raise UserError(f"gpus must be >= 1, got {gpus}")
    if zero_stage not in _SHARDED:
        raise UserError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    sharded = _SHARDED[zero_stage]
    parts = {kind: float(params * getattr(per_param, kind) / (gpus if kind in sharded else 1))
             for kind in BytesPerParam._fields}
    return MemoryBreakdown(activations=float(activation_bytes), **parts)


class ZeroMemory(NamedTuple):
    """Bytes of model states (params, grads, optimizer state) under a ZeRO optimizer: ``gpu`` on
    each GPU, the gathered layer included; ``cpu`` on each node, the buffer factor included;
    ``gathered`` the stage-3 largest-layer term inside ``gpu``."""

    gpu: float
    cpu: float
    gathered: float


# DeepSpeed's ZeRO optimizers keep fp32 partitions of the params and of the grads whatever the
# params' dtype (``single_partition_of_fp32_groups`` in runtime/zero/stage_1_and_2.py,
# ``fp32_partitioned_groups_flat`` in stage3.py), and optimizer state in fp32; each process on
# a node loads the model in fp32 before partitioning it (``4 * num_gpus_per_node`` in the
# estimators below).
_FP32 = 4


def _check_zero(params: Number, largest_layer: Number | None, zero_stage: int, counts: dict,
                offload_optimizer: bool, offload_params: bool, buffer_factor: Number) -> None:
    if zero_stage not in (1, 2, 3):
        raise UserError(f"zero_stage must be 1, 2 or 3, got {zero_stage}; stage 0 (no ZeRO "
                        f"optimizer): use training_memory")
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a whole number >= 1, got {value!r}")
    if not params >= 0 or not buffer_factor > 0:
        raise UserError(f"params must be >= 0 and buffer_factor > 0, got {params}, {buffer_factor}")
    if zero_stage == 3 and (largest_layer is None or not 0 <= largest_layer <= params):
        raise UserError(f"stage 3 gathers the largest layer: pass largest_layer, the parameters "
                        f"of the biggest module, between 0 and params, got {largest_layer}")
    if offload_params and zero_stage != 3:
        raise UserError("offload_params needs zero_stage=3 (only stage 3 partitions the params)")


def zero_memory(
    params: Number, *, largest_layer: Number | None = None, zero_stage: int = 3,
    gpus_per_node: int = 1, nodes: int = 1, offload_optimizer: bool = False,
    offload_params: bool = False, zero_init: bool = True, buffer_factor: Number = 1.5,
    optimizer: str = "adamw", precision: str = "bf16-mixed", **state_options: bool,
) -> ZeroMemory:
    """Model-state bytes per GPU and per node's CPU as DeepSpeed's estimators count them
    (``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs`` in
    deepspeed/runtime/zero/): ``precision`` sets the params' and grads' bytes, ``optimizer`` and
    ``state_options`` the fp32 state (see :func:`optimizer_states`); fp32 partitions of params
    and grads come on top. Stage 3 gathers the params and grads of ``largest_layer`` on each
    GPU; ``zero_init`` (stage 3) builds the model partitioned, so the CPU loads one layer at a
    time; ``buffer_factor`` pads the CPU figure. DeepSpeed's figures, except: the CPU of each
    node holds ``1/nodes`` of what is offloaded and the fp32 load of its own GPUs (its stage-2
    estimator counts the whole offload and the load of every GPU on each node), and the load
    stays counted under zero_init with offload, when larger.

    >>> m = zero_memory(7e9, largest_layer=5e8, gpus_per_node=8)   # 4·L + 18·Ψ/8 on each GPU
    >>> m.gpu / 1e9, m.gathered / 1e9, m.cpu / 1e9                 # 4·L·8 × 1.5 on the CPU
    (17.75, 2.0, 24.0)
    >>> zero_memory(7e9, zero_stage=2, offload_optimizer=True).cpu / 1e9  # 16·Ψ × 1.5
    168.0
    """
    _check_zero(params, largest_layer, zero_stage, dict(gpus_per_node=gpus_per_node, nodes=nodes),
                offload_optimizer, offload_params, buffer_factor)
    per_param = bytes_per_param(optimizer, precision, **state_options)
    p, g = per_param.params, per_param.grads
    # fp32 grads, params and state: 4 + 4 + 8 for Adam, DeepSpeed's "18 = 2_grads_16bit +
    # 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit" less the 16-bit grads, which
    # stage 2 shards on the GPU and stage 3 keeps for the gathered layer only
    fp32 = _FP32 * (2 + optimizer_states(optimizer, **state_options))
    on_gpu = p * (zero_stage < 3) + g * (zero_stage == 1)  # replicated
    sharded = (g * (zero_stage == 2 and not offload_optimizer) + fp32 * (not offload_optimizer)
               + p * (zero_stage == 3 and not offload_params))
    on_cpu = fp32 * offload_optimizer + p * offload_params  # sharded over every process
    gathered = float((p + g) * largest_layer) if zero_stage == 3 else 0.0
    loaded = (largest_layer if zero_stage == 3 and zero_init else params) * _FP32 * gpus_per_node
    return ZeroMemory(
        gpu=gathered + params * (on_gpu + sharded / (gpus_per_node * nodes)),
        cpu=float(buffer_factor * max(loaded, params * on_cpu / nodes)), gathered=gathered)


def _is_shape(leaf: Any) -> bool:
    return isinstance(leaf, tuple | list) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in leaf)


def _state_options(key: str, hyperparameters: dict[str, Any]) -> dict[str, bool]:
    """The :data:`STATE_OPTIONS` an ``mt.optim`` factory's keywords turn on; a keyword the
    factory does not take is refused (a typo would count nothing). A momentum keeps a buffer
    unless it is a plain number 0 (a tensor may hold other values later, as ``init`` assumes)."""
    from minitrain import optim

    known = inspect.signature(getattr(optim, "sgd" if key == "momentum" else key)).parameters
    for name in hyperparameters:
        if name not in known:
            raise UserError(
                f"unknown hyperparameter {name!r} for {key}; pass one of {', '.join(known)}")
    momentum = hyperparameters.get("momentum", 0)
    on = dict(amsgrad=bool(hyperparameters.get("amsgrad")),
              centered=bool(hyperparameters.get("centered")),
              momentum=not (isinstance(momentum, int | float) and momentum == 0))
    return {name: value for name, value in on.items() if key in STATE_OPTIONS[name]}


def state_bytes(optimizer: str, params: Any, **hyperparameters: Any) -> int:
    """Bytes of per-leaf state ``mt.optim.<optimizer>(**hyperparameters)`` keeps for ``params``
    (as its ``init`` makes them; O(1) scalars such as step counts are not counted).

    ``params`` is a pytree of tensors (real, fake or meta) or of shapes (fp32 elements).

    >>> state_bytes("adamw", [(1024, 1024)])
    8388608
    >>> state_bytes("muon", {"w": (8, 8), "b": (8,)})  # momentum; AdamW's two moments
    320
    """
    import torch

    from minitrain._torch import pytree

    key = optimizer_key(optimizer)
    options = _state_options(key, hyperparameters)
    if isinstance(params, list) and all(_is_shape(p) for p in params):
        leaves = list(params)  # a list of shapes, [[3, 4], [4]] too
    else:
        leaves = pytree.tree_leaves(params, is_leaf=lambda x: isinstance(x, tuple) and _is_shape(x))
    total = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape, size = tuple(leaf.shape), leaf.element_size()
        elif _is_shape(leaf):
            shape, size = tuple(leaf), 4
        else:
            raise UserError(f"expected params as tensors (real, fake or meta) or shapes, got "
                            f"{type(leaf).__name__}")
        total += optimizer_state_elements(key, shape, scalars=False, **options) * size
    return total
