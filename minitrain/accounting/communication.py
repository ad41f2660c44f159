"""Communication napkin math for data parallelism: the bytes and time of a ring all-reduce.

A ring all-reduce over ``N`` ranks sends ``2·(N - 1)/N × bytes`` per rank (Patarasuk & Yuan
2009); NCCL's bus bandwidth is the one that rate compares with (nccl-tests, PERFORMANCE.md).
"""

from __future__ import annotations

from minitrain.accounting.units import Number, check_numbers
from minitrain.errors import UserError

__all__ = ["allreduce_bytes", "allreduce_seconds", "communication_time"]


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
