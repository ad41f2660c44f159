"""Communication napkin math for data parallelism: the bytes and time of a ring all-reduce.

Data-parallel training all-reduces the gradients every step. A ring all-reduce over ``N``
ranks is a reduce-scatter followed by an all-gather, each of ``N - 1`` rounds in which every
rank sends (and receives) ``1/N`` of the buffer: ``2·(N - 1)/N × bytes`` sent per rank, which is
optimal for bandwidth (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations"). NCCL calls ``bytes / time`` the *algorithm bandwidth* and that
times ``2·(N - 1)/N`` the *bus bandwidth*, the figure to compare with a link's speed
(NVIDIA nccl-tests, doc/PERFORMANCE.md). Pure Python; no torch.

>>> allreduce_bytes(gradient_bytes=4e9, ranks=8)   # 1B fp32 grads over 8 ranks
7000000000.0
>>> allreduce_seconds(gradient_bytes=4e9, ranks=8, bandwidth=100e9)
0.07
"""

from __future__ import annotations

import math

from minitrain.accounting.units import Number
from minitrain.errors import UserError

__all__ = ["allreduce_bytes", "allreduce_seconds", "communication_time"]



def _check(gradient_bytes: Number, ranks: int) -> None:
    if not math.isfinite(gradient_bytes) or gradient_bytes < 0:
        raise UserError(f"gradient_bytes must be a finite number >= 0, got {gradient_bytes!r}")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise UserError(f"ranks must be an integer >= 1, got {ranks!r}")


def allreduce_bytes(gradient_bytes: Number, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``gradient_bytes``: ``2·(N-1)/N × bytes``.

    One rank sends nothing; the factor tends to 2 as ``N`` grows.

    >>> allreduce_bytes(1000, 1), allreduce_bytes(1000, 2), allreduce_bytes(1000, 4)
    (0.0, 1000.0, 1500.0)
    """
    _check(gradient_bytes, ranks)
    return 2.0 * (ranks - 1) / ranks * gradient_bytes


def allreduce_seconds(gradient_bytes: Number, ranks: int, bandwidth: Number) -> float:
    """Seconds of one ring all-reduce at ``bandwidth`` bytes/s per rank (NCCL's bus bandwidth).

    Bandwidth only: the ``2·(N - 1)`` per-message latencies are left out, fair for gradient
    buffers of megabytes and more.

    >>> round(allreduce_seconds(gradient_bytes=2 * 7e9, ranks=1024, bandwidth=50e9), 4)
    0.5595
    """
    if not math.isfinite(bandwidth) or bandwidth <= 0:
        raise UserError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
    return allreduce_bytes(gradient_bytes, ranks) / bandwidth


def communication_time(
    params: Number,
    tokens: Number,
    batch_tokens: Number,
    ranks: int,
    bandwidth: Number,
    bytes_per_grad: Number = 2,
) -> float:
    """Seconds spent all-reducing gradients over a whole data-parallel training run.

    ``tokens / batch_tokens`` optimizer steps, each all-reducing ``params × bytes_per_grad``
    bytes (2 for bf16 gradients, 4 for fp32). With no overlap this adds to the compute time;
    with perfect overlap (DDP overlaps buckets with the backward pass) only what exceeds it
    counts.

    >>> days = communication_time(params=8e9, tokens=15e12, batch_tokens=4e6, ranks=1024,
    ...                           bandwidth=50e9) / 86400
    >>> round(days, 1)   # 8B params, bf16 grads, 4M-token batches, 50 GB/s per rank
    27.8
    """
    for name, value in (("tokens", tokens), ("batch_tokens", batch_tokens), ("params", params)):
        if not math.isfinite(value) or value <= 0:
            raise UserError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(bytes_per_grad) or bytes_per_grad <= 0:
        raise UserError(f"bytes_per_grad must be positive (2 for bf16), got {bytes_per_grad!r}")
    steps = tokens / batch_tokens
    return steps * allreduce_seconds(params * bytes_per_grad, ranks, bandwidth)
