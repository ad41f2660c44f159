"""FLOP and communication napkin math: total training compute, the gradient all-reduce of
data parallelism, and the time they take (chapter 3.1.1).

Pure Python. ``6·N·D`` counts a multiply and an add per parameter per token forward, twice
that backward (gradients of the inputs and of the weights): Kaplan et al. 2020, section 2.1.
A ring all-reduce over ``N`` ranks sends ``2·(N - 1)/N × bytes`` per rank (Patarasuk & Yuan
2009); NCCL's bus bandwidth is the one that rate compares with (nccl-tests, PERFORMANCE.md).
"""

from __future__ import annotations

from minitrain.accounting.hardware import Hardware
from minitrain.accounting.hardware import hardware as lookup_hardware
from minitrain.accounting.units import Number, check_numbers
from minitrain.errors import UserError

__all__ = ["allreduce_bytes", "allreduce_seconds", "communication_time", "cruncher_flops",
           "effective_throughput", "optimizer_flops_per_element", "training_flops",
           "training_time"]


def training_flops(params: Number, tokens: Number) -> float:
    """``6·N·D``: forward (2·N·D) plus backward (4·N·D) over ``tokens`` tokens (Kaplan 2020).

    >>> training_flops(params=175e9, tokens=300e9)  # GPT-3: 3.14e23 reported
    3.15e+23
    """
    check_numbers(params=params, tokens=tokens)
    return 6.0 * params * tokens


def effective_throughput(hardware: str | Hardware | Number = "h100", gpus: int = 1,
                         mfu: Number = 0.5, dtype: str = "bf16") -> float:
    """FLOP/s actually delivered: ``peak × gpus × mfu`` (dense peak; never the sparse one).

    ``hardware`` is a registry name, a :class:`Hardware`, or a per-device peak in FLOP/s.

    >>> effective_throughput("h100", gpus=1024, mfu=0.5)
    5.065728e+17
    """
    if gpus < 1:
        raise UserError(f"gpus must be >= 1, got {gpus}")
    if not 0 < mfu <= 1:
        raise UserError(f"mfu must be in (0, 1] (a fraction, e.g. 0.5), got {mfu}")
    if isinstance(hardware, str):
        hardware = lookup_hardware(hardware)
    peak = hardware.peak(dtype) if isinstance(hardware, Hardware) else float(hardware)
    check_numbers(True, peak_flops=peak)
    return peak * gpus * mfu


def training_time(flops: Number, hardware: str | Hardware | Number = "h100", gpus: int = 1,
                  mfu: Number = 0.5, dtype: str = "bf16") -> float:
    """Seconds to do ``flops`` of work: ``flops / (peak × gpus × mfu)`` (chapter 3.1.1).

    >>> days = training_time(6.3e24, hardware="h100", gpus=1024, mfu=0.5) / 86_400
    >>> round(days, 1)
    143.9
    """
    check_numbers(flops=flops)
    return flops / effective_throughput(hardware, gpus=gpus, mfu=mfu, dtype=dtype)


def cruncher_flops(batch: int, dim: int, num_layers: int) -> int:
    """Exact matmul FLOPs of one training step of the chapter's Cruncher (3.5.6).

    Forward: ``2·B·P`` (each ``x @ W`` of ``(B, m) @ (m, n)`` is ``2·B·m·n``). Backward: the
    weight gradients cost ``2·B·P`` again, and the input gradients ``2·B·P`` minus the first
    layer's, which autograd never computes because the data needs no gradient. Hence
    ``6·B·P - 2·B·D²`` for ``num_layers >= 1``, against the ``6·B·P`` rule.

    >>> cruncher_flops(batch=4, dim=8, num_layers=2), 6 * 4 * (2 * 8 * 8 + 8)
    (2752, 3264)
    """
    for name, value, least in (("batch", batch, 1), ("dim", dim, 1), ("num_layers", num_layers, 0)):
        if value < least:
            raise UserError(f"{name} must be >= {least}, got {value}")
    from minitrain.models import cruncher_param_count  # torch, on this call only

    params = cruncher_param_count(dim, num_layers)
    first_layer = dim * dim if num_layers else dim
    return 6 * batch * params - 2 * batch * first_layer


FUSED_OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad")


def optimizer_flops_per_element(
    optimizer: str, *, maximize: bool = False, weight_decay: float = 0.0, momentum: float = 0.0,
    nesterov: bool = False, first_step: bool = False, amsgrad: bool = False,
    grad_scale: bool = False,
) -> int:
    """FLOPs per parameter element of one update of torch's fused kernels (``_fused_sgd_``,
    ``_fused_adam_``, ``_fused_adamw_``, ``_fused_adagrad_``) with these hyperparameters.

    Each elementwise op of torch's single-tensor reference implementation (``foreach=False,
    fused=False``; ``_single_tensor_sgd`` in torch/optim/sgd.py, ``_single_tensor_adam`` in
    torch/optim/adam.py, ``_single_tensor_adagrad`` in torch/optim/adagrad.py) counts as the
    counter counts it: ``add``, ``mul``, ``neg``, ``sqrt``, ``div``, ``maximum`` 1 per element
    (an ``alpha=`` scale is part of the op), ``lerp``, ``addcmul``, ``addcdiv`` 3. The step
    counter (``step += 1``, one add per parameter *tensor*) is a separate op in both paths and
    is not included. ``grad_scale`` (AMP) adds the kernel's unscaling ``g / scale``.

    - SGD: ``-g`` if maximize (1); ``g + wd·p`` (1); momentum after the first step
      ``b·μ + (1 - τ)·g`` (2; the first step copies ``g``); nesterov ``g + μ·b`` (1);
      ``p - lr·g`` (1).
    - Adam(W): ``-g`` (1); weight decay ``g + wd·p`` (Adam) or ``p·(1 - lr·wd)`` (AdamW) (1);
      ``m.lerp(g, 1 - β1)`` (3); ``v·β2 + (1 - β2)·g·g`` (1 + 3); amsgrad ``max(v̂, v)`` (1);
      ``sqrt(v) / √bc2 + eps`` (3); ``p - step·m/denom`` (3): 13 with no options.
    - Adagrad: ``-g`` (1); ``g + wd·p`` (1); ``s + g·g`` (3); ``sqrt(s) + eps`` (2);
      ``p - clr·g/std`` (3): 8 with no options.

    >>> optimizer_flops_per_element("adamw", weight_decay=0.01)
    14
    >>> optimizer_flops_per_element("sgd", momentum=0.9, nesterov=True)
    4
    """
    key = optimizer.strip().lower()
    if key not in FUSED_OPTIMIZERS:
        raise UserError(f"no fused-kernel formula for {optimizer!r}; choose one of "
                        f"{', '.join(FUSED_OPTIMIZERS)}")
    common = bool(maximize) + (weight_decay != 0) + bool(grad_scale)
    if key == "sgd":
        with_momentum = momentum != 0
        return (common + 2 * (with_momentum and not first_step)
                + (with_momentum and bool(nesterov)) + 1)
    if key == "adagrad":
        return common + 8
    return common + 13 + bool(amsgrad)


def allreduce_bytes(gradient_bytes: Number, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``gradient_bytes``: ``2·(N-1)/N × bytes``.

    >>> allreduce_bytes(1000, 1), allreduce_bytes(1000, 2), allreduce_bytes(1000, 4)
    (0.0, 1000.0, 1500.0)
    """
    check_numbers(gradient_bytes=gradient_bytes)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise UserError(f"ranks must be an integer >= 1, got {ranks!r}")
    return 2.0 * (ranks - 1) / ranks * gradient_bytes


def allreduce_seconds(gradient_bytes: Number, ranks: int, bandwidth: Number) -> float:
    """Seconds of one ring all-reduce at ``bandwidth`` bytes/s per rank (bus bandwidth; the
    per-message latencies are left out, fair for buffers of megabytes and more).

    >>> round(allreduce_seconds(gradient_bytes=2 * 7e9, ranks=1024, bandwidth=50e9), 4)
    0.5595
    """
    check_numbers(True, bandwidth=bandwidth)
    return allreduce_bytes(gradient_bytes, ranks) / bandwidth


def communication_time(params: Number, tokens: Number, batch_tokens: Number, ranks: int,
                       bandwidth: Number, bytes_per_grad: Number = 2) -> float:
    """Seconds all-reducing ``params × bytes_per_grad`` bytes in each of ``tokens /
    batch_tokens`` steps of a data-parallel run (without overlap, on top of the compute).

    >>> days = communication_time(params=8e9, tokens=15e12, batch_tokens=4e6, ranks=1024,
    ...                           bandwidth=50e9) / 86400
    >>> round(days, 1)   # 8B params, bf16 grads, 4M-token batches, 50 GB/s per rank
    27.8
    """
    check_numbers(True, tokens=tokens, batch_tokens=batch_tokens, params=params,
                  bytes_per_grad=bytes_per_grad)
    steps = tokens / batch_tokens
    return steps * allreduce_seconds(params * bytes_per_grad, ranks, bandwidth)
