"""``python benchmarks/hardware.py``: this machine's roofline, measured.

Times ``torch.mm`` on n x n matrices in fp32 and bf16 (2n³ FLOPs each) and a large tensor copy
(reads and writes every byte: 2 x nbytes moved), and prints the ridge point peak / bandwidth.
On the CPU the named peer is numpy (``np.matmul`` in fp32, ``np.copyto``), timed in the same
rounds; on a CUDA device the peer is the published spec of that GPU in the hardware registry.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import click
import numpy as np
import torch
from _pages import page
from _timing import main

from minitrain.errors import UserError


def _seconds(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _median_rates(
    work: dict[str, tuple[float | int, Callable[[], Any]]], rounds: int, sync: Callable[[], Any]
) -> dict[str, float]:
    """Median of ``amount / seconds`` over interleaved rounds, after one warm-up each."""
    for _, fn in work.values():
        fn()
    rates: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(rounds):
        for name, (amount, fn) in work.items():
            rates[name].append(amount / _seconds(fn, sync))
    return {name: statistics.median(values) for name, values in rates.items()}


def measure(
    device: str = "cpu", n: int = 1024, copy_mib: int = 64, rounds: int = 5
) -> dict[str, Any]:
    """Matmul FLOP/s (fp32, bf16) and copy bandwidth on ``device``, with the peer's figures."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    a32, b32 = (torch.randn(n, n, generator=generator).to(dev) for _ in range(2))
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    numel = copy_mib * 2**20 // 4
    src, dst = torch.ones(numel, device=dev), torch.empty(numel, device=dev)
    matmul_flops = 2 * n**3  # n² outputs, n multiply-adds each
    copy_bytes = 2 * numel * 4  # read + write
    work = {
        "torch fp32 matmul": (matmul_flops, lambda: torch.mm(a32, b32)),
        "torch bf16 matmul": (matmul_flops, lambda: torch.mm(a16, b16)),
        "torch copy": (copy_bytes, lambda: dst.copy_(src)),
    }
    if dev.type == "cpu":
        na, nb = a32.numpy(), b32.numpy()
        nsrc, ndst = src.numpy(), dst.numpy()
        work["numpy fp32 matmul"] = (matmul_flops, lambda: np.matmul(na, nb))
        work["numpy copy"] = (copy_bytes, lambda: np.copyto(ndst, nsrc))
    rates = _median_rates(work, rounds, sync)
    result: dict[str, Any] = {
        "device": device,
        "n": n,
        "copy_mib": copy_mib,
        "rounds": rounds,
        "rates": rates,
        "ridge_fp32": rates["torch fp32 matmul"] / rates["torch copy"],
        "ridge_bf16": rates["torch bf16 matmul"] / rates["torch copy"],
    }
    if dev.type == "cpu":
        result["ratio_vs_numpy"] = {
            "fp32 matmul": rates["torch fp32 matmul"] / rates["numpy fp32 matmul"],
            "copy": rates["torch copy"] / rates["numpy copy"],
        }
    else:
        from minitrain.accounting.hardware import hardware_for_cuda_device

        spec = hardware_for_cuda_device(torch.cuda.get_device_name(dev))
        if spec is not None:
            result["published"] = spec.name
            result["ratio_vs_published"] = {
                "fp32 matmul": rates["torch fp32 matmul"] / spec.peak("fp32"),
                "bf16 matmul": rates["torch bf16 matmul"] / spec.peak("bf16"),
                "copy": rates["torch copy"] / spec.memory_bandwidth,
            }
    return result


@click.command()
@page("hardware", "This machine: matmul FLOP/s, copy bandwidth, ridge point")
@click.option("--device", default="cpu", help="cpu or cuda[:i].")
@click.option("--n", type=click.IntRange(min=16), default=1024, help="Matmul size n x n.")
@click.option("--copy-mib", type=click.IntRange(min=1), default=64, help="MiB copied.")
@click.option("--rounds", type=click.IntRange(min=1), default=5, help="Interleaved rounds.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def hardware(device: str, n: int, copy_mib: int, rounds: int, as_json: bool) -> None:
    """Measure matmul FLOP/s (fp32, bf16) and copy bandwidth; print the ridge point."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("no CUDA device here; run with --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"unknown device {device!r}; use cpu or cuda[:i]")
    result = measure(device, n, copy_mib, rounds)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for name, rate in result["rates"].items():
        unit = "GB/s" if "copy" in name else "GFLOP/s"
        click.echo(f"{name:<20} {rate / 1e9:10.2f} {unit}")
    click.echo(
        f"ridge point: {result['ridge_fp32']:.2f} FLOP/byte (fp32), "
        f"{result['ridge_bf16']:.2f} FLOP/byte (bf16)"
    )
    for peer in ("ratio_vs_numpy", "ratio_vs_published"):
        for name, ratio in result.get(peer, {}).items():
            label = "numpy" if peer == "ratio_vs_numpy" else result["published"]
            click.echo(f"torch / {label} {name}: {ratio:.2f}x")


if __name__ == "__main__":
    main(hardware)
