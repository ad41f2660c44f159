"""Token files and batches: the chapter's ``tofile``/``np.memmap`` format, and prefetching.

>>> import tempfile, numpy as np, torch
>>> from pathlib import Path
>>> data = open_tokens(write_tokens(Path(tempfile.mkdtemp()) / "data.bin", np.arange(10)))
>>> x, y = get_batch(data, batch_size=2, seq_len=4, generator=torch.Generator().manual_seed(0))
>>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
(torch.Size([2, 4]), True)
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import torch

from minitrain.atomic_io import storage_errors
from minitrain.tree import map as tree_map
from minitrain.typecheck import Int, Shaped, Tensor, typechecked

__all__ = ["TOKEN_DTYPES", "DataError", "Prefetcher", "get_batch", "open_tokens", "write_tokens"]

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "int32": np.dtype(np.int32)}
"""The on-disk token formats: ``uint16`` (vocab <= 65,536) and ``int32``."""

Batch = TypeVar("Batch")


class DataError(ValueError):
    """A token file or data argument that cannot be used, with a one-line message."""


# --------------------------------------------------------------------------- token files


def write_tokens(path: str | os.PathLike, tokens: Any, dtype: str = "uint16") -> Path:
    """Write token ids to ``path`` in the chapter's flat ``tofile`` format; return the path."""
    np_dtype = _token_dtype(dtype)
    values = np.asarray(tokens)
    if values.ndim != 1 or values.size == 0:
        raise DataError(
            f"tokens must be a non-empty 1-D sequence of ids, got shape {values.shape}; "
            "flatten the ids into one sequence"
        )
    if not np.issubdtype(values.dtype, np.integer):
        raise DataError(f"tokens must be integers, got dtype {values.dtype}; pass token ids")
    limits = np.iinfo(np_dtype)
    low, high = int(values.min()), int(values.max())
    if low < max(limits.min, 0) or high > limits.max:
        raise DataError(
            f"token ids span [{low}, {high}], outside what {dtype} holds [0, {limits.max}]; "
            "use dtype='int32' or fix the ids"
        )
    path = Path(path)
    with storage_errors(path, "write"):
        values.astype(np_dtype).tofile(path)
    return path


def open_tokens(
    path: str | os.PathLike, dtype: str = "uint16", vocab_size: int | None = None
) -> np.memmap:
    """Memory-map a token file after checking its size and (with ``vocab_size``) its ids (3.5.4)."""
    np_dtype = _token_dtype(dtype)
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"token file {path} does not exist; run 'minitrain prepare' or fix the path"
        )
    with storage_errors(path, "read"):
        size = path.stat().st_size
        if size == 0:
            raise DataError(f"token file {path} is empty (0 bytes); write token ids into it first")
        if size % np_dtype.itemsize:
            raise DataError(
                f"token file {path} has {size} bytes, not a multiple of {np_dtype.itemsize} "
                f"(the size of {dtype}); was it written with another dtype?"
            )
        data = np.memmap(path, dtype=np_dtype, mode="r")
        if vocab_size is not None:
            _check_vocabulary(data, vocab_size, path)
    return data


def _token_dtype(dtype: str) -> np.dtype:
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"token dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    return TOKEN_DTYPES[dtype]


def _check_vocabulary(data: np.ndarray, vocab_size: int, path: Path) -> None:
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    low, high = int(data.min()), int(data.max())
    if low < 0 or high >= vocab_size:
        bad = int(data.argmin()) if low < 0 else int(data.argmax())
        raise DataError(
            f"token file {path} holds id {int(data[bad])} at position {bad}, outside the "
            f"vocabulary [0, {vocab_size}); check the tokenizer or vocab_size"
        )


# --------------------------------------------------------------------------- batches


@typechecked
def get_batch(
    data: Shaped[np.ndarray, " tokens"],
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """Sample ``batch_size`` random windows: inputs ``x`` and next-token targets ``y`` (3.5.4).

    One ``torch.randint`` draw of the starts from ``generator`` and one strided gather; on CUDA
    through pinned memory.

    >>> import numpy as np, torch
    >>> x, y = get_batch(np.arange(100), 3, 5, torch.Generator().manual_seed(0))
    >>> bool(((y - x) == 1).all())
    True
    """
    _check_batch_args(len(data), batch_size, seq_len, generator)
    # Starts in [0, len - seq_len - 1]: the window of seq_len + 1 tokens (x and y) fits.
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    windows = np.lib.stride_tricks.sliding_window_view(data, seq_len + 1)[starts.numpy()]
    device = torch.device(device)
    if device.type == "cuda":  # one pinned host buffer, one asynchronous copy
        tokens = torch.from_numpy(windows.astype(np.int64)).pin_memory()
        tokens = tokens.to(device, non_blocking=True)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # numpy's single-threaded casts: torch's parallel copies cost more than they save here.
    x = torch.from_numpy(windows[:, :-1].astype(np.int64))
    y = torch.from_numpy(windows[:, 1:].astype(np.int64))
    return x.to(device), y.to(device)


def _check_batch_args(
    num_tokens: int, batch_size: int, seq_len: int, generator: torch.Generator
) -> None:
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    if seq_len >= num_tokens:
        raise DataError(
            f"seq_len={seq_len} must be shorter than the data ({num_tokens} tokens); "
            "use a shorter seq_len or more data"
        )
    if generator.device.type != "cpu":
        raise DataError(
            f"get_batch samples on the CPU; pass a CPU torch.Generator, not one on "
            f"{generator.device}"
        )


class _Speculation(NamedTuple):
    state: torch.Tensor  # the generator state the batch was drawn from
    result: Future[tuple[Any, torch.Tensor]]  # (batch, generator state after the draw)


class Prefetcher(Generic[Batch]):
    """Prepare the next batch in a background thread while the current step runs.

    ``sample(generator)`` must be a pure function of the generator's state; the worker draws from
    a private copy, used only if the caller's generator still holds that state, so the caller's
    generator stays the only RNG state.
    """

    def __init__(self, sample: Callable[[torch.Generator], Batch], pin_memory: bool = False):
        self._sample = sample
        self._pin_memory = pin_memory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minitrain-data")
        self._pending: _Speculation | None = None
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False)
        self.hits = 0
        """How many calls were served by the background thread."""

    def __call__(self, generator: torch.Generator) -> Batch:
        """Return ``sample(generator)`` (advancing ``generator``) and start on the next batch."""
        state = generator.get_state()
        pending, self._pending = self._pending, None
        if pending is not None and torch.equal(pending.state, state):
            batch, after = pending.result.result()
            generator.set_state(after)
            self.hits += 1
        else:
            if pending is not None:
                pending.result.cancel()
            batch = self._draw(generator)
            after = generator.get_state()
        speculation = self._executor.submit(self._speculate, after, generator.device)
        self._pending = _Speculation(after, speculation)
        return batch

    def _draw(self, generator: torch.Generator) -> Batch:
        batch = self._sample(generator)
        if self._pin_memory:
            batch = tree_map(_pin, batch)
        return batch

    def _speculate(self, state: torch.Tensor, device: torch.device) -> tuple[Batch, torch.Tensor]:
        private = torch.Generator(device=device)
        private.set_state(state)
        return self._draw(private), private.get_state()

    def close(self) -> None:
        """Stop the worker thread (waits for the batch in flight, if any)."""
        self._pending = None
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._finalizer.detach()

    def __enter__(self) -> Prefetcher[Batch]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pin(leaf: Any) -> Any:
    return leaf.pin_memory() if isinstance(leaf, torch.Tensor) else leaf
