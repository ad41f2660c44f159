"""Token data: the chapter's ``tofile``/``np.memmap`` files, batches, prefetching, and corpora.

:func:`prepare` builds a byte-level corpus of Python's standard library sources (train and
held-out memmaps, a ``meta.json`` of sizes and SHA-256); :func:`load_prepared` opens one after
checking it. A corpus that fails its checks is a :class:`DataError`, never silently rebuilt.

>>> import tempfile, numpy as np, torch
>>> from pathlib import Path
>>> data = open_tokens(write_tokens(Path(tempfile.mkdtemp()) / "data.bin", np.arange(10)))
>>> x, y = get_batch(data, batch_size=2, seq_len=4, generator=torch.Generator().manual_seed(0))
>>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
(torch.Size([2, 4]), True)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from minitrain._cache import cache_dir
from minitrain.atomic_io import staged_dir, storage_errors
from minitrain.errors import StorageError, UserError
from minitrain.typecheck import Int, Shaped, Tensor, typechecked

__all__ = [
    "TOKEN_DTYPES", "DataError", "PreparedData", "default_data_dir",
    "ensure_prepared", "get_batch", "load_prepared", "open_tokens", "prepare", "source_files",
    "stdlib_dir", "write_tokens",
]

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "int32": np.dtype(np.int32)}
"""The on-disk token formats: ``uint16`` (vocab <= 65,536) and ``int32``."""

BYTE_VOCAB_SIZE = 256
_PREPARED_FORMAT = "minitrain-tokens"
_VAL_FRACTION = 0.05


class DataError(UserError):
    """A token file or data argument that cannot be used, with a one-line message."""


class PreparedData(NamedTuple):
    """Train and held-out token memmaps with their ``meta.json`` record."""

    train: np.memmap
    val: np.memmap
    meta: dict[str, Any]


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


@typechecked
def get_batch(
    data: Shaped[np.ndarray, " tokens"],
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """Sample ``batch_size`` random windows: inputs ``x`` and next-token targets ``y`` (3.5.4).

    One ``torch.randint`` draw of the starts from ``generator`` and one strided gather, on the
    CPU: the loop's :meth:`~minitrain.precision.Backend.to_device` moves a batch, pinned.

    >>> import numpy as np, torch
    >>> x, y = get_batch(np.arange(100), 3, 5, torch.Generator().manual_seed(0))
    >>> bool(((y - x) == 1).all())
    True
    """
    if batch_size < 1 or seq_len < 1:
        name, value = ("batch_size", batch_size) if batch_size < 1 else ("seq_len", seq_len)
        raise DataError(f"{name} must be at least 1, got {value}")
    if seq_len >= len(data):
        raise DataError(f"seq_len={seq_len} must be shorter than the data ({len(data)} tokens); "
                        "use a shorter seq_len or more data")
    if generator.device.type != "cpu":
        raise DataError("get_batch samples on the CPU; pass a CPU torch.Generator, not one on "
                        f"{generator.device}")
    # Starts in [0, len - seq_len - 1]: the window of seq_len + 1 tokens (x and y) fits.
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    windows = np.lib.stride_tricks.sliding_window_view(data, seq_len + 1)[starts.numpy()]
    # numpy's single-threaded casts: torch's parallel copies cost more than they save here.
    return (torch.from_numpy(windows[:, :-1].astype(np.int64)),
            torch.from_numpy(windows[:, 1:].astype(np.int64)))


def stdlib_dir() -> Path:
    """The directory of this Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | os.PathLike) -> list[Path]:
    """The ``.py`` files under ``root`` (skipping installed packages), in a fixed sorted order."""
    root = Path(root)
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted((path for path in root.rglob("*.py")
                   if path.is_file() and not skip.intersection(path.relative_to(root).parts)),
                  key=lambda path: path.relative_to(root).as_posix())


def default_data_dir() -> Path:
    """Where the stdlib corpus is cached: in :func:`~minitrain._cache.cache_dir`."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return cache_dir(required=True) / f"stdlib-bytes-py{version}"


def _held_out(names: list[str], val_fraction: float) -> list[bool]:
    """Which files are held out: about ``val_fraction``, at least one and not all, by path hash."""
    held_out = [
        int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64 < val_fraction
        for name in names
    ]
    if not any(held_out):
        held_out[-1] = True
    if all(held_out):
        held_out[0] = False
    return held_out


def prepare(
    out_dir: str | os.PathLike | None = None,
    source_dir: str | os.PathLike | None = None,
    val_fraction: float = _VAL_FRACTION,
) -> dict[str, Any]:
    r"""Build ``train.bin``/``val.bin`` byte-token memmaps (uint16) from Python source files.

    About ``val_fraction`` of the files, chosen by a hash of their path, are held out; the
    directory is built aside and renamed into place. Returns the ``meta.json`` record.

    >>> import tempfile
    >>> from pathlib import Path
    >>> src = Path(tempfile.mkdtemp()); _ = (src / "a.py").write_text("x = 1\n")
    >>> _ = (src / "b.py").write_text("y = 2\n")
    >>> meta = prepare(Path(tempfile.mkdtemp()) / "bytes", src)
    >>> meta["tokens"]["train"] + meta["tokens"]["val"], meta["vocab_size"]
    (12, 256)
    """
    out_dir = Path(out_dir) if out_dir is not None else default_data_dir()
    source = Path(source_dir) if source_dir is not None else stdlib_dir()
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not source.is_dir():
        raise DataError(f"source directory {source} does not exist; pass a folder of .py files")
    files = source_files(source)
    if len(files) < 2:
        raise DataError(
            f"{source} holds {len(files)} .py file(s); need at least 2 (one to train on, one to "
            "hold out)"
        )
    _check_replaceable(out_dir)
    names = [path.relative_to(source).as_posix() for path in files]
    held_out = _held_out(names, val_fraction)
    splits = {"train": [path for path, val in zip(files, held_out, strict=True) if not val],
              "val": [path for path, val in zip(files, held_out, strict=True) if val]}
    with storage_errors(out_dir, "write the prepared data to", mkdir=True):
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with staged_dir(out_dir) as staging:
            counts = {split: _write_split(staging / f"{split}.bin", paths)
                      for split, paths in splits.items()}
            meta = {
                "format": _PREPARED_FORMAT,
                "dtype": "uint16",
                "vocab_size": BYTE_VOCAB_SIZE,
                "source": str(source),
                "python": sys.version.split()[0],
                "val_fraction": val_fraction,
                "files": {split: count[0] for split, count in counts.items()},
                "tokens": {split: count[1] for split, count in counts.items()},
                "sha256": {split: count[2] for split, count in counts.items()},
                "val_files": [name for name, val in zip(names, held_out, strict=True) if val],
            }
            (staging / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _write_split(path: Path, files: list[Path]) -> tuple[int, int, str]:
    tokens, digest = 0, hashlib.sha256()
    with open(path, "wb") as out:
        for source in files:
            with storage_errors(source, "read"):
                content = source.read_bytes()
            if content and not content.endswith(b"\n"):
                content += b"\n"
            encoded = np.frombuffer(content, dtype=np.uint8).astype(np.uint16).tobytes()
            out.write(encoded)
            digest.update(encoded)
            tokens += len(content)
    if tokens == 0:
        raise DataError(f"the .py files for {path.name} are all empty; use a folder with source")
    return len(files), tokens, digest.hexdigest()


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir} is a file; pass a directory for the prepared data")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not (isinstance(meta, dict) and meta.get("format") == _PREPARED_FORMAT):
        raise DataError(
            f"{out_dir} exists and holds files that are not prepared data; pass a new or empty "
            "directory"
        )


def load_prepared(data_dir: str | os.PathLike | None = None) -> PreparedData:
    """Open a directory written by :func:`prepare` after checking its meta, sizes and SHA-256."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    rebuild = f"run 'minitrain prepare --out {data_dir}' to rebuild it"
    meta = _read_meta(data_dir)
    splits = {}
    for split in ("train", "val"):
        path = data_dir / f"{split}.bin"
        expected = meta["tokens"][split] * TOKEN_DTYPES[meta["dtype"]].itemsize
        with storage_errors(path, "read"):
            if not path.is_file():
                raise DataError(f"{path} is missing; {rebuild}")
            size = path.stat().st_size
            if size != expected:
                raise DataError(
                    f"{path} has {size} bytes but meta.json records {meta['tokens'][split]} "
                    f"tokens ({expected} bytes); it changed after it was prepared; {rebuild}"
                )
            with open(path, "rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
            if digest != meta["sha256"][split]:
                raise DataError(f"{path} does not match the SHA-256 in meta.json (edited or "
                                f"corrupted); {rebuild}")
        splits[split] = open_tokens(path, dtype=meta["dtype"], vocab_size=meta["vocab_size"])
    return PreparedData(splits["train"], splits["val"], meta)


def _read_meta(data_dir: Path) -> dict[str, Any]:
    """``meta.json`` of a prepared directory, every field checked."""
    path = data_dir / "meta.json"
    if data_dir.exists() and not data_dir.is_dir():
        raise DataError(f"{data_dir} is a file, not a prepared data directory")
    if not path.is_file():
        raise DataError(
            f"{data_dir} holds no prepared data (no meta.json); run 'minitrain prepare "
            f"--out {data_dir}'"
        )
    try:
        meta = json.loads(path.read_bytes())
    except OSError as exc:
        raise StorageError.from_os_error(exc, path, "read") from None
    except ValueError:
        meta = None
    if problem := _meta_problem(meta):
        raise DataError(f"{path} {problem}; run 'minitrain prepare --out {data_dir}'")
    return meta


def _meta_problem(meta: Any) -> str | None:
    """What is wrong with a ``meta.json`` record, or None."""
    if not isinstance(meta, dict) or meta.get("format") != _PREPARED_FORMAT:
        return f"is not a {_PREPARED_FORMAT} record"
    if meta.get("dtype") not in TOKEN_DTYPES:
        return f"has dtype {meta.get('dtype')!r}, not one of {sorted(TOKEN_DTYPES)}"
    vocab = meta.get("vocab_size")
    if not _is_count(vocab) or vocab > np.iinfo(TOKEN_DTYPES[meta["dtype"]]).max + 1:
        return f"has vocab_size {vocab!r}, not a positive integer that {meta['dtype']} holds"
    tokens = meta.get("tokens")
    if not isinstance(tokens, dict) or not all(_is_count(tokens.get(s)) for s in ("train", "val")):
        return "must record positive token counts for 'train' and 'val'"
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or not all(
        isinstance(digests.get(s), str) and len(digests[s]) == 64 for s in ("train", "val")
    ):
        return "must record a SHA-256 hex digest for 'train' and 'val'"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def ensure_prepared(
    data_dir: str | os.PathLike | None = None, source_dir: str | os.PathLike | None = None
) -> PreparedData:
    """:func:`load_prepared`, running :func:`prepare` first if the directory is absent or empty."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    if _absent_or_empty(data_dir):
        try:
            prepare(data_dir, source_dir)
        except StorageError:
            if _absent_or_empty(data_dir):  # else another process prepared it meanwhile
                raise
    prepared = load_prepared(data_dir)
    if source_dir is not None:
        recorded = Path(str(prepared.meta.get("source", "")))
        if recorded.resolve() != Path(source_dir).resolve():
            raise DataError(
                f"{data_dir} holds data prepared from {recorded}, not {source_dir}; pass "
                f"another data directory or run 'minitrain prepare --out {data_dir} --source "
                f"{source_dir}'"
            )
    return prepared


def _absent_or_empty(directory: Path) -> bool:
    with storage_errors(directory, "read"):
        return not directory.exists() or (directory.is_dir() and not any(directory.iterdir()))
