"""``python benchmarks/data.py``: vectorized ``get_batch`` against the chapter's list
comprehension.

Both read random windows of a 100M-token uint16 memmap built in a temporary directory, at the
chapter's sizes (batch 64, sequence length 1024), interleaved round by round in one process so
both see the same machine load and the same page cache. nanoGPT's per-row ``torch.stack``
loader is timed alongside as a second reference.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch
from _pages import page
from _timing import main

from minitrain.data import get_batch, open_tokens
from minitrain.errors import UserError

GPT2_VOCAB = 50257  # ids fit uint16, as in nanoGPT's OpenWebText files
_CHUNK = 10_000_000


def chapter_get_batch(
    data: np.ndarray, batch_size: int, sequence_length: int, device: str = "cpu"
) -> torch.Tensor:
    """The chapter's ``get_batch`` (3.5.4) verbatim, plus the ``return`` its listing omits."""
    start_indices = torch.randint(len(data) - sequence_length, (batch_size,))
    x = torch.tensor([data[start : start + sequence_length] for start in start_indices])
    if torch.cuda.is_available():
        x = x.pin_memory()
    x = x.to(device, non_blocking=True)
    return x


def nanogpt_get_batch(
    data: np.ndarray, batch_size: int, sequence_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's ``get_batch`` (train.py): one ``torch.from_numpy`` per row, then ``stack``."""
    ix = torch.randint(len(data) - sequence_length, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + sequence_length].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + sequence_length].astype(np.int64)) for i in ix]
    )
    return x, y


def write_random_tokens(path: Path, num_tokens: int, seed: int = 0) -> Path:
    """``num_tokens`` uniform uint16 ids below the GPT-2 vocabulary, written in chunks."""
    generator = np.random.default_rng(seed)
    with open(path, "wb") as handle:
        for start in range(0, num_tokens, _CHUNK):
            count = min(_CHUNK, num_tokens - start)
            generator.integers(0, GPT2_VOCAB, count, dtype=np.uint16).tofile(handle)
    return path


def _seconds_per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(
    num_tokens: int = 100_000_000,
    batch_size: int = 64,
    seq_len: int = 1024,
    rounds: int = 20,
    inner: int = 10,
) -> dict[str, Any]:
    """Median seconds per batch of each loader over ``rounds`` interleaved rounds.

    Each round times one call of the chapter's loader, one of nanoGPT's and ``inner`` calls of
    :func:`minitrain.data.get_batch` (which is far faster, so it gets more calls per round).
    """
    with tempfile.TemporaryDirectory(prefix="minitrain-benchmark-data-") as tmp:
        path = write_random_tokens(Path(tmp) / "tokens.bin", num_tokens)
        tokens = open_tokens(path, "uint16")
        generator = torch.Generator().manual_seed(0)
        loaders = {
            "chapter": lambda: chapter_get_batch(tokens, batch_size, seq_len),
            "nanogpt": lambda: nanogpt_get_batch(tokens, batch_size, seq_len),
            "minitrain": lambda: get_batch(tokens, batch_size, seq_len, generator),
        }
        calls = {"chapter": 1, "nanogpt": 1, "minitrain": inner}
        times: dict[str, list[float]] = {name: [] for name in loaders}
        with warnings.catch_warnings():
            # torch warns that a tensor from a list of ndarrays is slow: that is the point.
            warnings.simplefilter("ignore", UserWarning)
            for loader in loaders.values():  # warm-up: imports, page cache, allocator
                loader()
            for _ in range(rounds):
                for name, loader in loaders.items():
                    times[name].append(_seconds_per_call(loader, calls[name]))
    medians = {name: statistics.median(values) for name, values in times.items()}
    per_batch = batch_size * seq_len
    return {
        "num_tokens": num_tokens,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "rounds": rounds,
        "seconds_per_batch": medians,
        "tokens_per_second": {name: per_batch / seconds for name, seconds in medians.items()},
        "speedup_vs_chapter": medians["chapter"] / medians["minitrain"],
        "speedup_vs_nanogpt": medians["nanogpt"] / medians["minitrain"],
    }


@click.command()
@page("data", "Token batches: get_batch against the chapter's list comprehension and nanoGPT")
@click.option("--tokens", "num_tokens", type=click.IntRange(min=2), default=100_000_000)
@click.option("--batch-size", type=click.IntRange(min=1), default=64)
@click.option("--seq-len", type=click.IntRange(min=1), default=1024)
@click.option("--rounds", type=click.IntRange(min=1), default=20, help="Interleaved rounds.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def data(num_tokens: int, batch_size: int, seq_len: int, rounds: int, as_json: bool) -> None:
    """get_batch throughput against the chapter's list comprehension (target: >= 20x)."""
    if seq_len >= num_tokens:
        raise UserError(f"--seq-len {seq_len} must be shorter than --tokens {num_tokens}")
    result = measure(num_tokens, batch_size, seq_len, rounds)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(
        f"get_batch on a {num_tokens:,}-token uint16 memmap, batch {batch_size}, "
        f"seq_len {seq_len} (median of {rounds} interleaved rounds)"
    )
    for name, seconds in result["seconds_per_batch"].items():
        rate = result["tokens_per_second"][name]
        click.echo(f"  {name:10s} {seconds * 1e3:9.3f} ms/batch  {rate / 1e6:9.1f} M tokens/s")
    click.echo(
        f"minitrain vs chapter: {result['speedup_vs_chapter']:.1f}x; "
        f"vs nanoGPT: {result['speedup_vs_nanogpt']:.1f}x"
    )


if __name__ == "__main__":
    main(data)
